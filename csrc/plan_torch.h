// From torch tensors to a validated planner Problem: the one place where every Metal
// executor (csrc/mps/*.mm, torch_qmm/metalsim/backend.py through `_plan_for`) runs the argument
// checks of csrc/validate.* (csrc/gguf_validate.* for gguf_qmm) before planning, so bad input raises the CPU ops' errors everywhere.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

#include "plan.h"

namespace torch_qmm {

plan::DType plan_dtype(at::ScalarType t);

// mode: a format of csrc/format_spec.h; the planner serves "affine" (other modes are refused).
plan::Problem qmm_problem(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits,
                          int64_t group_size, bool transpose);
plan::Problem dequantize_problem(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                                 std::string_view mode, int64_t bits, int64_t group_size);
// Includes the NaN/Inf check of w (reads the data).
plan::Problem quantize_problem(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size);
// gguf_qmm: the checks of csrc/gguf_validate.* (the CPU op's), then M = rows of x.
plan::Problem gguf_qmm_problem(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                               int64_t K);

}  // namespace torch_qmm
