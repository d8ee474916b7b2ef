// affine_quantize_rows / affine_dequantize_rows: W [N, K] <-> (wq, scales, biases), quantized
// along K, results identical to the CPU ops (csrc/cpu/quantize.cpp) and to mlx.core.quantize.
//
//   wq [N, K*bits/32] uint32 (each row a little-endian bit stream)   scales, biases [N, K/G]
//
//   dequantize: 1-D grid of threads, one per decode unit (8 values = `bits` bytes)
//               thread u -> row u / (K/8), columns 8*(u % (K/8)) .. +7
//   quantize  : 1-D grid of threads, one per group of G values (its G*bits/32 words are its own:
//               no two threads write one word)
//               thread g -> row g / (K/G), columns G*(g % (K/G)) .. +G-1
//
// Quantize follows MLX's algorithm step by step in float32 (see csrc/cpu/quantize.cpp):
//   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|; the larger-
//   magnitude extreme `edge` is kept exact: q0 = rint(edge / scale), if q0 != 0 then
//   scale = edge / q0, bias = edge (else bias = 0); q = clamp(rint((w - bias) / scale), 0, 2^bits-1).
// rint rounds half to even in Metal as in C. Non-finite weights, and groups whose range max - min
// overflows float32, are refused by the host before the launch (a kernel cannot raise).
#pragma once

#include "affine_common.h"

template <typename T, int G, int bits>
inline void affine_dequantize_impl(const device uint8_t* wq, const device T* scales, const device T* biases,
                                   device T* w, constant AffineParams& p, uint u) {
  const uint N = p.N, K = p.K;
  const uint units_per_row = K / DEQ_VALUES_PER_THREAD;
  if (u >= N * units_per_row) return;
  const uint row = u / units_per_row;
  const uint c = (u % units_per_row) * DEQ_VALUES_PER_THREAD;
  float q[DEQ_VALUES_PER_THREAD];
  decode8<bits>(wq + row * (K * bits / 8) + c * bits / 8, q);
  const uint g = row * (K / G) + c / G;
  const float s = float(scales[g]), b = float(biases[g]);
  // fma: one rounding, the float32 value nearest s*q + b (the float64 reference rounded); the
  // CPU op's `s * q + b` compiles to the same fma with -march=native (GCC contracts by default).
  for (int i = 0; i < DEQ_VALUES_PER_THREAD; ++i) w[row * K + c + i] = static_cast<T>(fma(s, q[i], b));
}

template <typename T, int G, int bits>
inline void affine_quantize_impl(const device T* w, device uint32_t* wq, device T* scales, device T* biases,
                                 constant AffineParams& p, uint gi) {
  const uint N = p.N, K = p.K;
  const uint groups = K / G;
  if (gi >= N * groups) return;
  const uint row = gi / groups, g = gi % groups;
  const device T* src = w + row * K + g * G;

  float w_max = -numeric_limits<float>::infinity();
  float w_min = numeric_limits<float>::infinity();
  for (int j = 0; j < G; ++j) {
    const float v = float(src[j]);
    w_max = max(w_max, v);
    w_min = min(w_min, v);
  }
  const float n_bins = float((1 << bits) - 1);
  const bool min_is_edge = abs(w_min) > abs(w_max);
  float scale = max((w_max - w_min) / n_bins, 1e-7f);
  scale = min_is_edge ? scale : -scale;
  const float edge = min_is_edge ? w_min : w_max;
  const float q0 = rint(edge / scale);
  float bias = 0.0f;
  if (q0 != 0.0f) {
    scale = edge / q0;
    bias = edge;
  }

  // Pack the group's codes into its own words, least-significant bits first.
  device uint32_t* out = wq + row * (K * bits / 32) + g * (G * bits / 32);
  uint32_t cur = 0;
  int used = 0;
  int word = 0;
  for (int j = 0; j < G; ++j) {
    const uint32_t q = uint32_t(clamp(rint((float(src[j]) - bias) / scale), 0.0f, n_bins));
    cur |= q << used;
    used += bits;
    if (used >= 32) {
      out[word++] = cur;
      used -= 32;
      cur = used > 0 ? q >> (bits - used) : 0u;
    }
  }
  scales[gi] = static_cast<T>(scale);
  biases[gi] = static_cast<T>(bias);
}

template <typename T, int G, int bits>
[[kernel]] void affine_dequantize_rows(const device uint8_t* wq [[buffer(BUF_WQ)]],
                                       const device T* scales [[buffer(BUF_SCALES)]],
                                       const device T* biases [[buffer(BUF_BIASES)]],
                                       device T* w [[buffer(BUF_DENSE)]], constant AffineParams& p [[buffer(BUF_PARAMS)]],
                                       uint3 gid [[thread_position_in_grid]]) {
  affine_dequantize_impl<T, G, bits>(wq, scales, biases, w, p, gid.x);
}

template <typename T, int G, int bits>
[[kernel]] void affine_quantize_rows(device uint32_t* wq [[buffer(BUF_WQ)]], device T* scales [[buffer(BUF_SCALES)]],
                                     device T* biases [[buffer(BUF_BIASES)]], const device T* w [[buffer(BUF_DENSE)]],
                                     constant AffineParams& p [[buffer(BUF_PARAMS)]],
                                     uint3 gid [[thread_position_in_grid]]) {
  affine_quantize_impl<T, G, bits>(w, wq, scales, biases, p, gid.x);
}
