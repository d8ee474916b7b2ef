// Argument checks shared by every backend of every affine op. Each failure names the argument,
// what was expected and what came (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError).
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_qmm {

// The stored (packed) matrix: `rows` x `cols` weights, quantized along `cols`.
struct PackedShape {
  int64_t rows;
  int64_t cols;
};

void check_bits_and_group_size(const char* op, int64_t bits, int64_t group_size);
void check_float_dtype(const char* op, const char* arg, const at::Tensor& t);

// Checks wq / scales / biases against each other and against bits / group_size and returns
// the stored matrix shape. `dtype` is the dtype the scales and biases must have.
PackedShape check_packed(const char* op, const at::Tensor& wq, const at::Tensor& scales,
                         const at::Tensor& biases, int64_t bits, int64_t group_size);

// All checks of affine_quantize but the data-dependent one. Returns (rows, K) of w viewed as
// [rows, K].
std::pair<int64_t, int64_t> check_quantize(const at::Tensor& w, int64_t bits, int64_t group_size);

// The data-dependent check of affine_quantize, one message for every backend: non-finite weights
// have no affine representation, so they are refused (documented behaviour).
void check_quantize_finite(bool all_finite);
// Refuses finite weights whose group range max - min overflows float32 (the scale would be Inf).
void check_quantize_range(bool ranges_finite);

// All checks of affine_qmm. Returns (N, K) of y[..., N] = x[..., K] @ W.
std::pair<int64_t, int64_t> check_qmm(const at::Tensor& x, const at::Tensor& wq,
                                      const at::Tensor& scales, const at::Tensor& biases,
                                      int64_t bits, int64_t group_size, bool transpose);

}  // namespace torch_qmm
