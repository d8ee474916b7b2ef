// MPS executor of gather_qmm (every quantized mode): validated problem and index operands
// (csrc/plan_torch.h, gather_qmm_operands) -> plan (csrc/plan.cpp) -> encode
// (csrc/mps/metal_executor.mm). The pair order the plan asks for (plan::Launch::order) is made
// on the device by torch ops before the launch, so nothing here synchronizes but the index
// range check of the validation.
//
// NOT RUN ON APPLE HARDWARE: syntax-checked on Linux by tests/test_metal_mps_syntax.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

#include "../plan.h"
#include "../plan_torch.h"
#include "metal_executor.h"

namespace torch_qmm {
namespace {

using plan::Operand;

at::Tensor gather_qmm_mps(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                          const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                          int64_t group_size, bool transpose, bool sorted_indices) {
  const GatherOperands g = gather_qmm_operands(x, w, scales, biases, lhs_indices, rhs_indices, mode, bits, group_size,
                                               transpose, sorted_indices);  // validates
  const plan::Problem& p = g.problem;
  const std::vector<plan::Launch> launches = mps::make_plan_checked(p);
  mps::Operands ops;
  ops[Operand::kX] = x.reshape({p.x_batch * p.M, p.K}).contiguous();
  mps::set_weight_operands(ops, w, scales, biases);
  ops[Operand::kLhs] = g.lhs;
  ops[Operand::kRhs] = g.rhs;
  ops[Operand::kY] = mps::new_output(launches, p.pairs * p.M, p.N, x.options());
  if (!launches.empty()) ops[Operand::kOrder] = gather_order(g.rhs, launches.front().order);
  mps::encode(launches, ops);
  std::vector<int64_t> shape = g.batch;
  shape.push_back(p.M);
  shape.push_back(p.N);
  return ops[Operand::kY].view(shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, MPS, m) { m.impl("gather_qmm", &gather_qmm_mps); }

}  // namespace torch_qmm
