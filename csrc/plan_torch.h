// From torch tensors to a validated planner Problem: the one place where every Metal
// executor (csrc/mps/*.mm, torch_qmm/metalsim/backend.py through `_plan_for`) runs the argument
// checks of csrc/validate.* before planning, so bad input raises the CPU ops' errors everywhere.
#pragma once

#include <ATen/core/Tensor.h>

#include "plan.h"

namespace torch_qmm {

plan::DType plan_dtype(at::ScalarType t);

plan::Problem qmm_problem(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const at::Tensor& biases, int64_t bits, int64_t group_size, bool transpose);
plan::Problem dequantize_problem(const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases,
                                 int64_t bits, int64_t group_size);
// Includes the NaN/Inf check of w (reads the data).
plan::Problem quantize_problem(const at::Tensor& w, int64_t bits, int64_t group_size);

}  // namespace torch_qmm
