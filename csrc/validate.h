// Argument checks shared by every backend of quantize / dequantize / qmm, and by the Meta kernels
// (csrc/meta.cpp) that torch.compile, FakeTensor and meta tensors run: one validation, so a
// shape-only run refuses exactly what the real kernels refuse. What is allowed comes from the
// format table (csrc/format_spec.h). Each failure names the argument, what was expected and what
// came (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError).
//
// The checks read shapes as c10::SymInt (tensor.sym_size): concrete on real tensors, symbolic
// under torch.compile(dynamic=True), where each comparison becomes a guard. The *_sym functions
// return symbolic sizes (for the Meta kernels); the plain ones return int64_t for the kernels.
// No check reads tensor data except check_quantize_finite / check_quantize_range, which only real
// kernels can make.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "format_spec.h"

namespace torch_qmm {

// The stored (packed) matrix: `rows` x `cols` weights, quantized along `cols`.
struct PackedShape {
  int64_t rows;
  int64_t cols;
};
struct SymPackedShape {
  c10::SymInt rows;
  c10::SymInt cols;
};

// The format named by `mode`; unknown names are refused with the list of known ones.
const FormatSpec& check_mode(const char* op, std::string_view mode);
// The format of an int8-activation op (qmm_int8_activations, gather_qmm_int8_activations): the
// affine one, the only one its kernels implement (csrc/cpu/actq_qmm.cpp).
const FormatSpec& check_int8_activations_mode(const char* op, std::string_view mode);
void check_bits_and_group_size(const char* op, const FormatSpec& f, int64_t bits, int64_t group_size);
void check_float_dtype(const char* op, const char* arg, const at::Tensor& t);

// Checks wq / scales / biases against each other, against the format and against bits /
// group_size, and returns the stored matrix shape. biases: required where the format has
// biases, None otherwise.
SymPackedShape check_packed_sym(const char* op, const FormatSpec& f, const at::Tensor& wq, const at::Tensor& scales,
                                const std::optional<at::Tensor>& biases, int64_t bits, int64_t group_size);
PackedShape check_packed(const char* op, const FormatSpec& f, const at::Tensor& wq, const at::Tensor& scales,
                         const std::optional<at::Tensor>& biases, int64_t bits, int64_t group_size);

// The dtype dequantize returns: `dtype` when given (float32, float16 or bfloat16), else the
// scales' dtype for float scales and bfloat16 for coded scales (as mx.dequantize).
at::ScalarType check_dequantize_dtype(const char* op, const FormatSpec& f, const at::Tensor& scales,
                                      std::optional<at::ScalarType> dtype);

// All checks of quantize but the data-dependent ones. Returns (rows, K) of w viewed as [rows, K].
std::pair<c10::SymInt, c10::SymInt> check_quantize_sym(const FormatSpec& f, const at::Tensor& w, int64_t bits,
                                                       int64_t group_size);
std::pair<int64_t, int64_t> check_quantize(const FormatSpec& f, const at::Tensor& w, int64_t bits,
                                           int64_t group_size);

// The data-dependent checks of quantize, one message for every backend: non-finite weights are
// refused in every mode (documented in docs/formats.md), and affine also refuses finite weights
// whose group range max - min overflows float32 (the scale would be Inf).
void check_quantize_finite(bool all_finite);
void check_quantize_range(bool ranges_finite);

// All checks of qmm. Returns (N, K) of y[..., N] = x[..., K] @ W.
std::pair<c10::SymInt, c10::SymInt> check_qmm_sym(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                                  const std::optional<at::Tensor>& biases, const FormatSpec& f,
                                                  int64_t bits, int64_t group_size, bool transpose);
std::pair<int64_t, int64_t> check_qmm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                      const std::optional<at::Tensor>& biases, const FormatSpec& f, int64_t bits,
                                      int64_t group_size, bool transpose);

// gather_qmm (mlx.core.gather_qmm): x [..., M, K] and W a stack of matrices [..., rows, cols]
// (wq, scales and biases with the same leading dimensions). lhs_indices / rhs_indices (int32,
// int64 or uint32) pick matrices by flat index into x's / W's leading (batch) dimensions; None
// means every one of them (an arange of that batch shape). The two index shapes broadcast to
// `batch`; y is [*batch, M, N]. x_batch / w_batch: how many matrices x / W hold.
template <typename Int>
struct GatherShapeT {
  Int M, N, K, x_batch, w_batch;
  std::vector<Int> batch;
};
using SymGatherShape = GatherShapeT<c10::SymInt>;
using GatherShape = GatherShapeT<int64_t>;

SymGatherShape check_gather_qmm_sym(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& biases,
                                    const std::optional<at::Tensor>& lhs_indices,
                                    const std::optional<at::Tensor>& rhs_indices, const FormatSpec& f, int64_t bits,
                                    int64_t group_size, bool transpose);
GatherShape check_gather_qmm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                             const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                             const std::optional<at::Tensor>& rhs_indices, const FormatSpec& f, int64_t bits,
                             int64_t group_size, bool transpose);

// The data-dependent check of gather_qmm, made by the real kernels before any read: the indices
// `arg` (smallest lo, largest hi) index the `limit` matrices of `target` (x or wq) of shape `shape`.
void check_gather_index_range(const char* arg, int64_t lo, int64_t hi, int64_t limit, const char* target,
                              at::IntArrayRef shape);

}  // namespace torch_qmm
