// quantize_rows / dequantize_rows: W [N, K] <-> (wq, scales[, biases]), quantized along K, for
// every quantized mode; results identical to the CPU ops (csrc/cpu/quantize.cpp) and to
// mlx.core.quantize / dequantize (the format policy's quantize_group and dequantize,
// metal/quant_format.h, hold each mode's arithmetic).
//
//   wq [N, K*bits/32] uint32 (each row a little-endian bit stream)   scales (, biases) [N, K/G]
//
//   dequantize: 1-D grid of threads, one per decode unit (8 values = `bits` bytes)
//               thread u -> row u / (K/8), columns 8*(u % (K/8)) .. +7
//   quantize  : 1-D grid of threads, one per group of G values (its G*bits/32 words are its own:
//               no two threads write one word)
//               thread g -> row g / (K/G), columns G*(g % (K/G)) .. +G-1
#pragma once

#include "quant_common.h"

template <typename T, typename F>
inline void dequantize_impl(const device uint8_t* wq, const device typename F::scale_t* scales,
                            const device T* biases, device T* w, constant AffineParams& p, uint u) {
  constexpr int G = F::G, bits = F::BITS;
  const uint N = p.N, K = p.K;
  const uint units_per_row = K / DEQ_VALUES_PER_THREAD;
  if (u >= N * units_per_row) return;
  const uint row = u / units_per_row;
  const uint c = (u % units_per_row) * DEQ_VALUES_PER_THREAD;
  float q[DEQ_VALUES_PER_THREAD];
  F::decode8(wq + row * (K * bits / 8) + c * bits / 8, q);
  const uint g = row * (K / G) + c / G;
  for (int i = 0; i < DEQ_VALUES_PER_THREAD; ++i) w[row * K + c + i] = F::dequantize(scales, biases, g, q[i]);
}

template <typename T, typename F>
inline void quantize_impl(const device T* w, device uint32_t* wq, device typename F::scale_t* scales,
                          device T* biases, constant AffineParams& p, uint gi) {
  constexpr int G = F::G, bits = F::BITS;
  const uint N = p.N, K = p.K;
  const uint groups = K / G;
  if (gi >= N * groups) return;
  const uint row = gi / groups, g = gi % groups;
  F::quantize_group(w + row * K + g * G, wq + row * (K * bits / 32) + g * (G * bits / 32), scales, biases, gi);
}

template <typename T, typename F>
[[kernel]] void dequantize_rows(const device uint8_t* wq [[buffer(BUF_WQ)]],
                                const device typename F::scale_t* scales [[buffer(BUF_SCALES)]],
                                const device T* biases [[buffer(BUF_BIASES)]], device T* w [[buffer(BUF_DENSE)]],
                                constant AffineParams& p [[buffer(BUF_PARAMS)]], uint3 gid [[thread_position_in_grid]]) {
  dequantize_impl<T, F>(wq, scales, biases, w, p, gid.x);
}

template <typename T, typename F>
[[kernel]] void quantize_rows(device uint32_t* wq [[buffer(BUF_WQ)]], device typename F::scale_t* scales [[buffer(BUF_SCALES)]],
                              device T* biases [[buffer(BUF_BIASES)]], const device T* w [[buffer(BUF_DENSE)]],
                              constant AffineParams& p [[buffer(BUF_PARAMS)]], uint3 gid [[thread_position_in_grid]]) {
  quantize_impl<T, F>(w, wq, scales, biases, p, gid.x);
}
