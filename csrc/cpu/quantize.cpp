// CPU quantize / dequantize, every mode of the format table (csrc/format_spec.h).
//
// Quantization follows mlx.core.quantize's CPU path step by step
// so that packed words, scales and biases are identical to MLX's.
// affine, in float32:
//   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|;
//   the larger-magnitude extreme `edge` is represented exactly: q0 = rint(edge / scale) and,
//   when q0 != 0, scale = edge / q0, bias = edge (else bias = 0);
//   q = clamp(rint((w - bias) / scale), 0, 2^bits - 1), rint = round half to even.
//   Scales and biases are rounded to the dtype of w only when stored; q uses the float32 values.
// fp modes, every step rounded to w's dtype T (fp_codec.h has the codecs):
//   s = T(amax / element_max) over the group;
//   e8m0 scale: n = ceil(log2(s)) (0 for s == 0), byte (n + 127) mod 256, q = T(w / 2^n),
//     element distances in T;
//   e4m3 scale: byte = e4m3(s), q = float(T(w / value(byte))), element distances in float32.
// Weights MLX would turn into codes that do not represent them are refused: NaN/Inf in every
// mode, and (affine) finite groups whose range max - min overflows float32 (beyond 3.4028235e38:
// mlx.core.quantize gives such a group scale -inf and dequantizes it to NaN).
// Each 32-bit word holds codes as one little-endian bit stream (csrc/format.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "../format.h"
#include "../fp_codec.h"
#include "../validate.h"

namespace torch_qmm {
namespace {

// Writes `code` as element k of a zeroed packed row.
inline void pack_element(uint8_t* row, int64_t k, int bits, uint32_t code) {
  const int64_t bit = k * bits;
  uint32_t v = code << (bit & 7);
  for (int64_t b = bit >> 3; v != 0; ++b, v >>= 8) row[b] |= uint8_t(v & 0xff);
}

// The packed geometry of rows of K values: groups per row, bytes per packed row.
struct Rows {
  int64_t groups, row_bytes;
  Rows(int64_t K, int bits, int group_size) : groups(K / group_size), row_bytes(packed_words(K, bits) * 4) {}
};

// f(r) for every row r in [0, rows), rows split across threads.
template <typename F>
void for_each_row(int64_t rows, F&& f) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

template <typename T>
void quantize_rows(const T* w, uint8_t* wq, T* scales, T* biases, int64_t rows, int64_t K, int bits,
                   int group_size, std::atomic<bool>& non_finite, std::atomic<bool>& range_overflow) {
  const float n_bins = float((1 << bits) - 1);
  const Rows geo(K, bits, group_size);
  const int64_t groups = geo.groups;
  for_each_row(rows, [&](int64_t r) {
    uint8_t* out = wq + r * geo.row_bytes;
    std::memset(out, 0, geo.row_bytes);
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
        pack_element(out, g * group_size + j, bits, uint32_t(q));
      }
      scales[r * groups + g] = T(scale);
      biases[r * groups + g] = T(bias);
    }
  });
}

template <typename T>
void quantize_fp_rows(const FormatSpec& f, const T* w, uint8_t* wq, uint8_t* scales, int64_t rows, int64_t K,
                      int bits, int group_size, std::atomic<bool>& non_finite) {
  const Rows geo(K, bits, group_size);
  const int64_t groups = geo.groups;
  const auto in_t = [](float v) { return float(T(v)); };
  const auto in_f32 = [](float v) { return v; };
  for_each_row(rows, [&](int64_t r) {
    uint8_t* out = wq + r * geo.row_bytes;
    std::memset(out, 0, geo.row_bytes);
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = w + r * K + g * group_size;
      float amax = 0.0f;
      for (int j = 0; j < group_size; ++j) {
        const float v = float(src[j]);
        if (!std::isfinite(v)) non_finite.store(true, std::memory_order_relaxed);
        amax = std::max(amax, std::fabs(v));
      }
      const float s = in_t(amax / f.element_max);
      const int64_t k0 = g * group_size;
      if (f.scale == ScaleKind::kE8M0) {
        const int n = fp::e8m0_exponent(s);
        scales[r * groups + g] = uint8_t(fp::e8m0_encode(n));
        for (int j = 0; j < group_size; ++j) {
          // w / 2^n is exact in double; one rounding to T (float first is exact: few bits).
          const float q = in_t(float(std::ldexp(double(float(src[j])), -n)));
          pack_element(out, k0 + j, bits, fp::element_encode(f.element, q, in_t));
        }
      } else {
        const uint32_t code = fp::e4m3_encode(s);
        scales[r * groups + g] = uint8_t(code);
        const float sv = fp::e4m3_value(code);
        for (int j = 0; j < group_size; ++j) {
          const float q = in_t(float(src[j]) / sv);
          pack_element(out, k0 + j, bits, fp::element_encode(f.element, q, in_f32));
        }
      }
    }
  });
}

std::vector<at::Tensor> quantize_cpu(const at::Tensor& w_in, std::string_view mode, int64_t bits, int64_t group_size) {
  const FormatSpec& f = check_mode("quantize", mode);
  const auto [rows, K] = check_quantize(f, w_in, bits, group_size);
  const at::Tensor w = w_in.contiguous();

  auto packed_shape = w.sizes().vec();
  packed_shape.back() = packed_words(K, bits);
  auto group_shape = w.sizes().vec();
  group_shape.back() = K / group_size;
  at::Tensor wq = at::empty(packed_shape, w.options().dtype(at::kUInt32));
  std::atomic<bool> non_finite{false}, range_overflow{false};
  uint8_t* wq_bytes = reinterpret_cast<uint8_t*>(wq.data_ptr());
  if (f.has_biases) {
    at::Tensor scales = at::empty(group_shape, w.options());
    at::Tensor biases = at::empty(group_shape, w.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "quantize", [&] {
      quantize_rows<scalar_t>(w.data_ptr<scalar_t>(), wq_bytes, scales.data_ptr<scalar_t>(),
                              biases.data_ptr<scalar_t>(), rows, K, int(bits), int(group_size), non_finite,
                              range_overflow);
    });
    check_quantize_finite(!non_finite.load());
    check_quantize_range(!range_overflow.load());
    return {wq, scales, biases};
  }
  at::Tensor scales = at::empty(group_shape, w.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "quantize", [&] {
    quantize_fp_rows<scalar_t>(f, w.data_ptr<scalar_t>(), wq_bytes, scales.data_ptr<uint8_t>(), rows, K, int(bits),
                               int(group_size), non_finite);
  });
  check_quantize_finite(!non_finite.load());
  return {wq, scales};
}

// affine: out = O(S(S(s * q) + b)), as mlx.core.dequantize rounds: in the scales' dtype S, the
// product first, then the sum (the Metal kernel, metal/quant_format.h, rounds the same way). The
// product is exact in double and rounded to S by a conversion, which no compiler fuses with the
// sum; a float32 sum of two S values rounded to S is the S sum (float32 has more than 2p + 2 bits
// for half and bfloat16).
template <typename S, typename O>
void dequantize_rows(const uint8_t* wq, const S* scales, const S* biases, O* out, int64_t rows, int64_t cols, int bits,
                     int group_size) {
  const Rows geo(cols, bits, group_size);
  const int64_t groups = geo.groups;
  for_each_row(rows, [&](int64_t r) {
    const uint8_t* row = wq + r * geo.row_bytes;
    for (int64_t c = 0; c < cols; ++c) {
      const double s = double(scales[r * groups + c / group_size]);
      const float product = float(S(s * double(unpack_element(row, c, bits))));
      out[r * cols + c] = O(S(product + float(biases[r * groups + c / group_size])));
    }
  });
}

// fp modes: out = O(value(q) * O(scale)): the scale rounded to the output dtype first, then the
// product (exact in float32 but for overflow) rounded once, as MLX's CPU path.
template <typename O>
void dequantize_fp_rows(const FormatSpec& f, const uint8_t* wq, const uint8_t* scales, O* out, int64_t rows,
                        int64_t cols, int bits, int group_size) {
  const Rows geo(cols, bits, group_size);
  for_each_row(rows, [&](int64_t r) {
    const uint8_t* row = wq + r * geo.row_bytes;
    for (int64_t g = 0; g < geo.groups; ++g) {
    const float s = float(O(fp::scale_value(f.scale, scales[r * geo.groups + g])));
    for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c)
      out[r * cols + c] = O(fp::element_value(f.element, unpack_element(row, c, bits)) * s);
    }
  });
}

at::Tensor dequantize_cpu(const at::Tensor& wq_in, const at::Tensor& scales_in, const std::optional<at::Tensor>& biases_in,
                          std::string_view mode, int64_t bits, int64_t group_size, std::optional<at::ScalarType> dtype) {
  const char* op = "dequantize";
  const FormatSpec& f = check_mode(op, mode);
  const PackedShape shape = check_packed(op, f, wq_in, scales_in, biases_in, bits, group_size);
  const at::ScalarType out_dtype = check_dequantize_dtype(op, f, scales_in, dtype);
  const at::Tensor wq = wq_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor out = at::empty({shape.rows, shape.cols}, scales.options().dtype(out_dtype));
  const uint8_t* wq_bytes = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  if (f.has_biases) {
    const at::Tensor biases = biases_in->contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scales.scalar_type(), "dequantize", [&] {
      using S = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "dequantize", [&] {
        dequantize_rows<S, scalar_t>(wq_bytes, scales.data_ptr<S>(), biases.data_ptr<S>(), out.data_ptr<scalar_t>(),
                                     shape.rows, shape.cols, int(bits), int(group_size));
      });
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "dequantize", [&] {
    dequantize_fp_rows<scalar_t>(f, wq_bytes, scales.data_ptr<uint8_t>(), out.data_ptr<scalar_t>(), shape.rows,
                                 shape.cols, int(bits), int(group_size));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace torch_qmm
