// MPS executor of gguf_qmm: validated problem (csrc/plan_torch.h: the checks of
// csrc/gguf_validate.*) -> plan (csrc/plan.cpp, GGUF routes) -> operands -> encode
// (csrc/mps/metal_executor.mm, shared with quant_mps.mm). Kernels: metal/gguf_qmm.h.
//
// NOT RUN ON APPLE HARDWARE: syntax-checked on Linux by tests/test_metal_mps_syntax.py; the same
// plans run on metalsim in CI (tests/test_metal_gguf.py).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../plan.h"
#include "../plan_torch.h"
#include "metal_executor.h"

namespace torch_qmm {
namespace {

using plan::Operand;

at::Tensor gguf_qmm_mps(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K) {
  const plan::Problem p = gguf_qmm_problem(x, blocks, ggml_type, N, K);  // validates
  const std::vector<plan::Launch> launches = mps::make_plan_checked(p);
  mps::Operands ops;
  ops[Operand::kX] = x.reshape({p.M, p.K}).contiguous();
  // The kernels read Q2_K, Q4_K, Q5_K and IQ4_XS words as uint32, Q3_K, Q6_K and the lattice
  // i-quants' as uint16 (metal/gguf_qmm.h): the blocks must start on a 4-byte boundary of their
  // buffer (a copy otherwise; views of a loaded file may not).
  at::Tensor b = blocks.contiguous();
  if ((b.storage_offset() * b.element_size()) % 4 != 0) b = b.clone();
  ops[Operand::kBlocks] = b;
  ops[Operand::kY] = mps::new_output(launches, p.M, p.N, x.options());
  mps::encode(launches, ops);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.N;
  return ops[Operand::kY].view(shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, MPS, m) { m.impl("gguf_qmm", &gguf_qmm_mps); }

}  // namespace torch_qmm
