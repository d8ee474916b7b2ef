// MPS executor of quantize / dequantize / qmm (every quantized mode): validated problem
// (csrc/plan_torch.h) -> plan (csrc/plan.cpp) -> operands -> encode (csrc/mps/metal_executor.mm,
// shared with gguf_mps.mm). The format's layout (uint8 scale codes, biases or none) comes from
// csrc/format_spec.h; the plan binds only the buffers the format has.
//
// NOT RUN ON APPLE HARDWARE: syntax-checked on Linux by tests/test_metal_mps_syntax.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

#include "../format_spec.h"
#include "../plan.h"
#include "../plan_torch.h"
#include "../validate.h"
#include "metal_executor.h"

namespace torch_qmm {
namespace {

using plan::Operand;

at::Tensor qmm_mps(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                   const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size,
                   bool transpose) {
  const plan::Problem p = qmm_problem(x, wq, scales, biases, mode, bits, group_size, transpose);  // validates
  const std::vector<plan::Launch> launches = mps::make_plan_checked(p);
  mps::Operands ops;
  ops[Operand::kX] = x.reshape({p.M, p.K}).contiguous();
  mps::set_weight_operands(ops, wq, scales, biases);
  ops[Operand::kY] = mps::new_output(launches, p.M, p.N, x.options());
  mps::encode(launches, ops);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.N;
  return ops[Operand::kY].view(shape);
}

at::Tensor dequantize_mps(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                          std::string_view mode, int64_t bits, int64_t group_size, std::optional<at::ScalarType> dtype) {
  const plan::Problem p = dequantize_problem(wq, scales, biases, mode, bits, group_size, dtype);  // validates
  const std::vector<plan::Launch> launches = mps::make_plan_checked(p);
  mps::Operands ops;
  mps::set_weight_operands(ops, wq, scales, biases);
  const at::ScalarType out = check_dequantize_dtype("dequantize", format_spec(p.mode), scales, dtype);
  ops[Operand::kW] = at::empty({p.N, p.K}, scales.options().dtype(out));
  mps::encode(launches, ops);
  std::vector<int64_t> shape = wq.sizes().vec();
  shape.back() = p.K;
  return ops[Operand::kW].view(shape);
}

std::vector<at::Tensor> quantize_mps(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size) {
  const plan::Problem p = quantize_problem(w, mode, bits, group_size);  // validates, incl. NaN/Inf
  const FormatSpec& f = format_spec(p.mode);
  const std::vector<plan::Launch> launches = mps::make_plan_checked(p);
  mps::Operands ops;
  ops[Operand::kW] = w.reshape({p.N, p.K}).contiguous();
  ops[Operand::kWq] = at::empty({p.N, p.K * bits / 32}, w.options().dtype(at::kUInt32));
  const at::ScalarType scale_dtype = f.scale == ScaleKind::kFloat ? w.scalar_type() : at::kByte;
  ops[Operand::kScales] = at::empty({p.N, p.K / group_size}, w.options().dtype(scale_dtype));
  if (f.has_biases) ops[Operand::kBiases] = at::empty({p.N, p.K / group_size}, w.options());
  mps::encode(launches, ops);
  std::vector<int64_t> packed = w.sizes().vec(), groups = w.sizes().vec();
  packed.back() = p.K * bits / 32;
  groups.back() = p.K / group_size;
  std::vector<at::Tensor> out{ops[Operand::kWq].view(packed), ops[Operand::kScales].view(groups)};
  if (f.has_biases) out.push_back(ops[Operand::kBiases].view(groups));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, MPS, m) {
  m.impl("qmm", &qmm_mps);
  m.impl("dequantize", &dequantize_mps);
  m.impl("quantize", &quantize_mps);
}

}  // namespace torch_qmm
