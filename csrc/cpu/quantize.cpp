// CPU affine_quantize / affine_dequantize.
//
// Quantization follows mlx.core.quantize (mlx/backend/cpu/quantized.cpp, affine mode) step by
// step in float32 so that packed words, scales and biases are identical to MLX's:
//   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|;
//   the larger-magnitude extreme `edge` is represented exactly: q0 = rint(edge / scale) and,
//   when q0 != 0, scale = edge / q0, bias = edge (else bias = 0);
//   q = clamp(rint((w - bias) / scale), 0, 2^bits - 1), rint = round half to even.
// Scales and biases are rounded to the dtype of w only when stored; q uses the float32 values.
// Weights MLX would turn into a non-finite scale are refused: NaN/Inf, and finite groups whose
// range max - min overflows float32 (beyond 3.4028235e38: mlx.core.quantize gives such a group
// scale -inf and dequantizes it to NaN).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "../format.h"
#include "../validate.h"

namespace torch_qmm {
namespace {

template <typename T>
void quantize_rows(const T* w, uint8_t* wq, T* scales, T* biases, int64_t rows, int64_t K, int bits,
                   int group_size, std::atomic<bool>& non_finite, std::atomic<bool>& range_overflow) {
  const float n_bins = float((1 << bits) - 1);
  const int64_t groups = K / group_size;
  const int64_t row_bytes = packed_words(K, bits) * 4;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* out = wq + r * row_bytes;
      std::memset(out, 0, row_bytes);
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = w + r * K + g * group_size;
        float w_min = INFINITY, w_max = -INFINITY;
        for (int j = 0; j < group_size; ++j) {
          const float v = float(src[j]);
          w_max = std::max(w_max, v);
          w_min = std::min(w_min, v);
          if (!std::isfinite(v)) non_finite.store(true, std::memory_order_relaxed);
        }
        if (std::isinf(w_max - w_min)) range_overflow.store(true, std::memory_order_relaxed);
        const bool min_is_edge = std::abs(w_min) > std::abs(w_max);
        float scale = std::max((w_max - w_min) / n_bins, 1e-7f);
        scale = min_is_edge ? scale : -scale;
        const float edge = min_is_edge ? w_min : w_max;
        const float q0 = std::rint(edge / scale);
        float bias = 0.0f;
        if (q0 != 0.0f) {
          scale = edge / q0;
          bias = edge;
        }
        for (int j = 0; j < group_size; ++j) {
          float q = std::rint((float(src[j]) - bias) / scale);
          q = std::min(std::max(q, 0.0f), n_bins);
          // Little-endian bit stream: element k at bits [k*bits, (k+1)*bits).
          const int64_t bit = (g * group_size + j) * bits;
          uint32_t v = uint32_t(q) << (bit & 7);
          for (int64_t b = bit >> 3; v != 0; ++b, v >>= 8) out[b] |= uint8_t(v & 0xff);
        }
        scales[r * groups + g] = T(scale);
        biases[r * groups + g] = T(bias);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> affine_quantize_cpu(const at::Tensor& w_in, int64_t bits,
                                                                  int64_t group_size) {
  const auto [rows, K] = check_quantize(w_in, bits, group_size);
  const at::Tensor w = w_in.contiguous();

  auto packed_shape = w.sizes().vec();
  packed_shape.back() = packed_words(K, bits);
  auto group_shape = w.sizes().vec();
  group_shape.back() = K / group_size;
  at::Tensor wq = at::empty(packed_shape, w.options().dtype(at::kUInt32));
  at::Tensor scales = at::empty(group_shape, w.options());
  at::Tensor biases = at::empty(group_shape, w.options());

  std::atomic<bool> non_finite{false}, range_overflow{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "affine_quantize", [&] {
    quantize_rows<scalar_t>(w.data_ptr<scalar_t>(), reinterpret_cast<uint8_t*>(wq.data_ptr()),
                            scales.data_ptr<scalar_t>(), biases.data_ptr<scalar_t>(), rows, K, int(bits),
                            int(group_size), non_finite, range_overflow);
  });
  check_quantize_finite(!non_finite.load());
  check_quantize_range(!range_overflow.load());
  return {wq, scales, biases};
}

template <typename T>
void dequantize_rows(const uint8_t* wq, const T* scales, const T* biases, T* out, int64_t rows, int64_t cols,
                     int bits, int group_size) {
  const int64_t groups = cols / group_size;
  const int64_t row_bytes = packed_words(cols, bits) * 4;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = wq + r * row_bytes;
      for (int64_t c = 0; c < cols; ++c) {
        const float s = float(scales[r * groups + c / group_size]);
        const float b = float(biases[r * groups + c / group_size]);
        // One rounding (fma), as the Metal kernel computes it, whatever the compiler contracts.
        out[r * cols + c] = T(std::fma(s, float(unpack_element(row, c, bits)), b));
      }
    }
  });
}

at::Tensor affine_dequantize_cpu(const at::Tensor& wq_in, const at::Tensor& scales_in, const at::Tensor& biases_in,
                                 int64_t bits, int64_t group_size) {
  const PackedShape shape = check_packed("affine_dequantize", wq_in, scales_in, biases_in, bits, group_size);
  const at::Tensor wq = wq_in.contiguous(), scales = scales_in.contiguous(), biases = biases_in.contiguous();
  at::Tensor out = at::empty({shape.rows, shape.cols}, scales.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scales.scalar_type(), "affine_dequantize", [&] {
    dequantize_rows<scalar_t>(reinterpret_cast<const uint8_t*>(wq.data_ptr()), scales.data_ptr<scalar_t>(),
                              biases.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), shape.rows, shape.cols,
                              int(bits), int(group_size));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("affine_quantize", &affine_quantize_cpu);
  m.impl("affine_dequantize", &affine_dequantize_cpu);
}

}  // namespace torch_qmm
