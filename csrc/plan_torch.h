// From torch tensors to a validated planner Problem: the one place where every Metal
// executor (csrc/mps/*.mm, torch_qmm/metalsim_backend.py through `_plan_for`) runs the argument
// checks of csrc/validate.* (csrc/gguf_validate.* for gguf_qmm) before planning, so bad input
// raises the CPU ops' errors everywhere. `mode` is a format of csrc/format_spec.h; a mode the
// planner has no kernels for (plan::serves) is refused with ValueError.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <vector>

#include "plan.h"

namespace torch_qmm {

plan::DType plan_dtype(at::ScalarType t);

plan::Problem qmm_problem(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits,
                          int64_t group_size, bool transpose);
// dtype: of the result (None: the mode's default, csrc/validate.h check_dequantize_dtype); affine
// kernels write the scales' dtype only.
plan::Problem dequantize_problem(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                                 std::string_view mode, int64_t bits, int64_t group_size,
                                 std::optional<at::ScalarType> dtype);
// Includes the NaN/Inf check of w (reads the data).
plan::Problem quantize_problem(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size);
// gguf_qmm: the checks of csrc/gguf_validate.* (the CPU op's), then M = rows of x.
plan::Problem gguf_qmm_problem(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                               int64_t K);

// gather_qmm: the checks of csrc/validate.* (check_gather_qmm, the CPU op's, and the range of
// the given indices, which reads them), then the problem and the index operands the kernels bind.
struct GatherOperands {
  plan::Problem problem;
  at::Tensor lhs, rhs;         // int32 [pairs], on x's device: the broadcast indices, flattened (MLX's
                               // rule: an absent index is the arange of that operand's batch shape)
  std::vector<int64_t> batch;  // y is [*batch, M, N]
};
GatherOperands gather_qmm_operands(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& biases,
                                   const std::optional<at::Tensor>& lhs_indices,
                                   const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                                   int64_t group_size, bool transpose, bool sorted_indices);
// The kOrder operand of a gather_qmm launch (plan::Launch::order), made on rhs's device: the
// pairs as given, or a stable argsort of their experts.
at::Tensor gather_order(const at::Tensor& rhs, plan::Launch::Order order);

}  // namespace torch_qmm
