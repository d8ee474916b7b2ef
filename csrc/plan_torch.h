// From torch tensors to a validated planner Problem: the one place where every Metal
// executor (csrc/mps/*.mm, torch_qmm/metalsim/backend.py through `_plan_for`) runs the argument
// checks of csrc/validate.* before planning, so bad input raises the CPU ops' errors everywhere.
#pragma once

#include <ATen/core/Tensor.h>

#include "plan.h"

namespace torch_qmm {

plan::DType plan_dtype(at::ScalarType t);

// Checks of affine_quantize (mirror csrc/cpu/quantize.cpp; the NaN/Inf check needs the data
// and is done by each executor). Returns rows N and columns K of w viewed as [N, K].
std::pair<int64_t, int64_t> check_quantize(const at::Tensor& w, int64_t bits, int64_t group_size);

plan::Problem qmm_problem(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const at::Tensor& biases, int64_t bits, int64_t group_size, bool transpose);
plan::Problem dequantize_problem(const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases,
                                 int64_t bits, int64_t group_size);
plan::Problem quantize_problem(const at::Tensor& w, int64_t bits, int64_t group_size);

}  // namespace torch_qmm
