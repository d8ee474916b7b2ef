// Meta kernels of the torch_qmm ops: output shapes and dtypes without computing anything, for
// meta tensors, FakeTensor and torch.compile (which calls them with symbolic shapes). Each runs
// the same argument checks as the real kernels (validate.h, gguf_validate.h), so a shape-only run
// raises exactly the errors a real call would; only the data-dependent check (non-finite weights
// in affine_quantize) is left to the real kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "format.h"
#include "gguf_validate.h"
#include "validate.h"

namespace torch_qmm {
namespace {

// x's shape with the last dimension replaced by n.
std::vector<c10::SymInt> with_last(const at::Tensor& t, const c10::SymInt& n) {
  std::vector<c10::SymInt> shape(t.sym_sizes().begin(), t.sym_sizes().end());
  shape.back() = n;
  return shape;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> affine_quantize_meta(const at::Tensor& w, int64_t bits,
                                                                   int64_t group_size) {
  const auto [rows, K] = check_quantize_sym(w, bits, group_size);
  (void)rows;
  const auto groups = with_last(w, K / group_size);
  return {at::empty_symint(with_last(w, K * bits / 32), w.options().dtype(at::kUInt32)),
          at::empty_symint(groups, w.options()), at::empty_symint(groups, w.options())};
}

at::Tensor affine_dequantize_meta(const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases,
                                  int64_t bits, int64_t group_size) {
  const SymPackedShape s = check_packed_sym("affine_dequantize", wq, scales, biases, bits, group_size);
  return at::empty_symint({s.rows, s.cols}, scales.options());
}

at::Tensor affine_qmm_meta(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                           const at::Tensor& biases, int64_t bits, int64_t group_size, bool transpose) {
  const auto [N, K] = check_qmm_sym(x, wq, scales, biases, bits, group_size, transpose);
  (void)K;
  return at::empty_symint(with_last(x, N), x.options());
}

at::Tensor gguf_qmm_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K) {
  check_gguf_qmm(x, blocks, ggml_type, N, K);
  return at::empty_symint(with_last(x, c10::SymInt(N)), x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, Meta, m) {
  m.impl("affine_quantize", &affine_quantize_meta);
  m.impl("affine_dequantize", &affine_dequantize_meta);
  m.impl("affine_qmm", &affine_qmm_meta);
  m.impl("gguf_qmm", &gguf_qmm_meta);
}

}  // namespace torch_qmm
