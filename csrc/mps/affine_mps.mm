// MPS executor of the affine ops: validated problem (csrc/plan_torch.h) -> plan (csrc/plan.cpp)
// -> operands -> encode (csrc/mps/metal_executor.mm, shared with gguf_mps.mm).
//
// NOT RUN ON APPLE HARDWARE: syntax-checked on Linux by tests/test_metal_mps_syntax.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

#include "../plan.h"
#include "../plan_torch.h"
#include "metal_executor.h"

namespace torch_qmm {
namespace {

using mps::encode;
using mps::make_plan_checked;
using mps::Operands;
using plan::Operand;

at::Tensor qmm_mps(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                   const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size,
                   bool transpose) {
  const plan::Problem p = qmm_problem(x, wq, scales, biases, mode, bits, group_size, transpose);  // validates
  const std::vector<plan::Launch> launches = make_plan_checked(p);
  Operands ops;
  ops[Operand::kX] = x.reshape({p.M, p.K}).contiguous();
  ops[Operand::kWq] = wq.contiguous();
  ops[Operand::kScales] = scales.contiguous();
  ops[Operand::kBiases] = biases->contiguous();
  ops[Operand::kY] = launches.empty() ? at::zeros({p.M, p.N}, x.options()) : at::empty({p.M, p.N}, x.options());
  encode(launches, ops);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.N;
  return ops[Operand::kY].view(shape);
}

at::Tensor dequantize_mps(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                          std::string_view mode, int64_t bits, int64_t group_size, std::optional<at::ScalarType> dtype) {
  const plan::Problem p = dequantize_problem(wq, scales, biases, mode, bits, group_size);
  TORCH_CHECK_VALUE(!dtype || *dtype == scales.scalar_type(), "dequantize: argument 'dtype' other than the scales' ",
                    "dtype has no Metal kernel yet, got ", *dtype);
  const std::vector<plan::Launch> launches = make_plan_checked(p);
  Operands ops;
  ops[Operand::kWq] = wq.contiguous();
  ops[Operand::kScales] = scales.contiguous();
  ops[Operand::kBiases] = biases->contiguous();
  ops[Operand::kW] = at::empty({p.N, p.K}, scales.options());
  encode(launches, ops);
  return ops[Operand::kW];
}

std::vector<at::Tensor> quantize_mps(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size) {
  const plan::Problem p = quantize_problem(w, mode, bits, group_size);  // validates, incl. NaN/Inf
  const std::vector<plan::Launch> launches = make_plan_checked(p);
  Operands ops;
  ops[Operand::kW] = w.reshape({p.N, p.K}).contiguous();
  ops[Operand::kWq] = at::empty({p.N, p.K * bits / 32}, w.options().dtype(at::kUInt32));
  ops[Operand::kScales] = at::empty({p.N, p.K / group_size}, w.options());
  ops[Operand::kBiases] = at::empty({p.N, p.K / group_size}, w.options());
  encode(launches, ops);
  std::vector<int64_t> packed = w.sizes().vec(), groups = w.sizes().vec();
  packed.back() = p.K * bits / 32;
  groups.back() = p.K / group_size;
  return {ops[Operand::kWq].view(packed), ops[Operand::kScales].view(groups), ops[Operand::kBiases].view(groups)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, MPS, m) {
  m.impl("qmm", &qmm_mps);
  m.impl("dequantize", &dequantize_mps);
  m.impl("quantize", &quantize_mps);
}

}  // namespace torch_qmm
