// Meta kernels of the torch_qmm ops: output shapes and dtypes without computing anything, for
// meta tensors, FakeTensor and torch.compile (which calls them with symbolic shapes). Each runs
// the same argument checks as the real kernels (validate.h, gguf_validate.h), so a shape-only run
// raises exactly the errors a real call would; only the data-dependent checks (non-finite weights
// in quantize) are left to the real kernels. The affine_* aliases (csrc/ops.cpp) need none.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

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

std::vector<at::Tensor> quantize_meta(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size) {
  const FormatSpec& f = check_mode("quantize", mode);
  const auto [rows, K] = check_quantize_sym(f, w, bits, group_size);
  (void)rows;
  const auto groups = with_last(w, K / group_size);
  const auto scale_options = f.scale == ScaleKind::kFloat ? w.options() : w.options().dtype(at::kByte);
  std::vector<at::Tensor> out{at::empty_symint(with_last(w, K * bits / 32), w.options().dtype(at::kUInt32)),
                              at::empty_symint(groups, scale_options)};
  if (f.has_biases) out.push_back(at::empty_symint(groups, w.options()));
  return out;
}

at::Tensor dequantize_meta(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                           std::string_view mode, int64_t bits, int64_t group_size, std::optional<at::ScalarType> dtype) {
  const char* op = "dequantize";
  const FormatSpec& f = check_mode(op, mode);
  const SymPackedShape s = check_packed_sym(op, f, wq, scales, biases, bits, group_size);
  const at::ScalarType out_dtype = check_dequantize_dtype(op, f, scales, dtype);
  return at::empty_symint({s.rows, s.cols}, scales.options().dtype(out_dtype));
}

at::Tensor qmm_meta(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                    const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size,
                    bool transpose) {
  const FormatSpec& f = check_mode("qmm", mode);
  const auto [N, K] = check_qmm_sym(x, wq, scales, biases, f, bits, group_size, transpose);
  (void)K;
  return at::empty_symint(with_last(x, N), x.options());
}

// qmm_int8_activations: qmm's checks and shape (transpose=True) for the affine format only.
at::Tensor qmm_int8_activations_meta(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits,
                                     int64_t group_size) {
  check_int8_activations_mode("qmm_int8_activations", mode);
  return qmm_meta(x, wq, scales, biases, mode, bits, group_size, true);
}

at::Tensor gather_qmm_meta(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                           const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                           int64_t group_size, bool transpose, bool sorted_indices) {
  (void)sorted_indices;
  const FormatSpec& f = check_mode("gather_qmm", mode);
  SymGatherShape s =
      check_gather_qmm_sym(x, w, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, transpose);
  s.batch.push_back(s.M);
  s.batch.push_back(s.N);
  return at::empty_symint(s.batch, x.options());
}

// gather_qmm_int8_activations: gather_qmm's checks and shape (transpose=True) for the affine format only.
at::Tensor gather_qmm_int8_activations_meta(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                            const std::optional<at::Tensor>& biases,
                                            const std::optional<at::Tensor>& lhs_indices,
                                            const std::optional<at::Tensor>& rhs_indices, std::string_view mode,
                                            int64_t bits, int64_t group_size, bool sorted_indices) {
  check_int8_activations_mode("gather_qmm_int8_activations", mode);
  return gather_qmm_meta(x, w, scales, biases, lhs_indices, rhs_indices, mode, bits, group_size, true, sorted_indices);
}

at::Tensor gguf_qmm_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K) {
  check_gguf_qmm(x, blocks, ggml_type, N, K);
  return at::empty_symint(with_last(x, c10::SymInt(N)), x.options());
}

at::Tensor gguf_int8x_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K) {
  check_gguf_int8_activations(x, blocks, ggml_type, N, K);
  return at::empty_symint(with_last(x, c10::SymInt(N)), x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, Meta, m) {
  m.impl("quantize", &quantize_meta);
  m.impl("dequantize", &dequantize_meta);
  m.impl("qmm", &qmm_meta);
  m.impl("gather_qmm", &gather_qmm_meta);
  m.impl("gguf_qmm", &gguf_qmm_meta);
  m.impl("qmm_int8_activations", &qmm_int8_activations_meta);
  m.impl("gguf_qmm_int8_activations", &gguf_int8x_meta);
  m.impl("gather_qmm_int8_activations", &gather_qmm_int8_activations_meta);
}

}  // namespace torch_qmm
