// qvm_bounded: y[m, :] = x[m, :] @ W for small M, transpose=False (W [K, N] quantized along N;
// MLX's qvm layout), every quantized mode (format policy F, metal/quant_format.h). Geometry after MLX qvm: lanes own consecutive output columns,
// SIMD-groups split K and are reduced through threadgroup memory.
//
//   wq [K, N*bits/8 bytes]   scales (, biases) [K, N/G]   x [M, K]   y [M, N]
//
//   grid (ceil(N/256), M); threadgroup = 4 SIMD-groups x 32 lanes
//   lane l of every SIMD-group -> columns n = 256*tx + 8l .. +7 (one decode unit per row k)
//   SIMD-group s -> rows k = s, s+4, s+8, ...   (consecutive lanes read consecutive bytes)
//     acc[i] += (x[m,k] * s_k) * q_i ; bsum += x[m,k] * b_k (F::HAS_BIAS)   (the 8 columns share
//     a group; where acc + bsum is not finite, redone as acc[i] += x[m,k] * F::weight(s_k, q_i, b_k))
//   SIMD-groups 1..3 park acc + bsum in threadgroup memory; SIMD-group 0 adds and writes y.
// Bounds: any K; N is a multiple of G (hence of 8), columns past N are skipped per lane.
#pragma once

#include "quant_common.h"

template <typename T, typename F>
inline void qvm_impl(const device uint8_t* wq, const device typename F::scale_t* scales, const device T* biases,
                     const device T* x, device T* y, constant AffineParams& p, threadgroup float* red, uint2 tg,
                     uint simd_gid, uint lane) {
  constexpr int G = F::G, bits = F::BITS;
  constexpr int C = QVM_COLS_PER_LANE;
  const uint N = p.N, K = p.K;
  const uint row_bytes = N * bits / 8;
  const uint groups = N / G;
  const uint m = tg.y;
  const uint n = tg.x * QVM_COLS_PER_TG + lane * C;

  float acc[C];
  for (int i = 0; i < C; ++i) acc[i] = 0.0f;
  float bsum = 0.0f;
  if (n < N) {
    float q[C];
    for (uint k = simd_gid; k < K; k += QVM_SIMDGROUPS) {
      const float xk = float(x[m * K + k]);
      F::decode8(wq + k * row_bytes + n * bits / 8, q);
      const float xs = xk * F::scale(scales, k * groups + n / G);
      if (F::HAS_BIAS) bsum += xk * F::bias(biases, k * groups + n / G);
      for (int i = 0; i < C; ++i) acc[i] += xs * q[i];
    }
    // Where a column's sum is not finite, the lane's columns again weight by weight, x * w
    // (why: qdot_by_weight in quant_common.h).
    bool finite = true;
    for (int i = 0; i < C; ++i) finite = finite && isfinite(acc[i] + bsum);
    if (!finite) {
      for (int i = 0; i < C; ++i) acc[i] = 0.0f;
      bsum = 0.0f;
      for (uint k = simd_gid; k < K; k += QVM_SIMDGROUPS) {
        const float xk = float(x[m * K + k]);
        F::decode8(wq + k * row_bytes + n * bits / 8, q);
        const float s = F::scale(scales, k * groups + n / G), b = F::bias(biases, k * groups + n / G);
        for (int i = 0; i < C; ++i) acc[i] += xk * F::weight(s, q[i], b);
      }
    }
  }
  if (simd_gid > 0) {
    for (int i = 0; i < C; ++i) red[((simd_gid - 1) * SIMD_WIDTH + lane) * C + i] = acc[i] + bsum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_gid == 0 && n < N) {
    for (int i = 0; i < C; ++i) {
      float v = acc[i] + bsum;
      for (int s = 1; s < QVM_SIMDGROUPS; ++s) v += red[((s - 1) * SIMD_WIDTH + lane) * C + i];
      y[m * N + n + i] = static_cast<T>(v);
    }
  }
}

template <typename T, typename F>
[[kernel]] void qvm_bounded(QMM_ARGS) {
  threadgroup float red[(QVM_SIMDGROUPS - 1) * QVM_COLS_PER_TG];
  qvm_impl<T, F>(wq, scales, biases, x, y, p, red, tgid.xy, simd_gid, lane);
}
