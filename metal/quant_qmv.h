// qmv_fast / qmv_bounded: y[0, n] = sum_k x[0, k] * W[n, k] for M = 1, transpose=True (W [N, K]),
// every quantized mode (the format policy F, metal/quant_format.h, decodes codes and scales).
// Geometry after MLX qmv_fast: 2 SIMD-groups x 4 W rows = 8 outputs per
// threadgroup; each lane holds a slice of x in registers and reuses it for its SIMD-group's 4 rows.
//
//   wq [N, K*bits/8 bytes]   scales (, biases) [N, K/G]   x [K]   y [N]
//
//   threadgroup t (64 threads)            one K-block = 32 lanes x V values (V = 16 or 8)
//   simdgroup 0 -> W rows 8t+0 .. 8t+3    lane l: x[k0 + l*V .. +V) in registers (pre-scaled),
//   simdgroup 1 -> W rows 8t+4 .. 8t+7        W[row, same K range] for each of its 4 rows
//   per row: acc += s * sum(q*x) (+ b * sum(x)) (weight by weight where that is not finite: qdot);
//   at the end simd_sum(acc) -> y[row]
//
// Variants (template flag `bounded`):
//   fast    : N % 8 == 0 and K % (32*V) == 0 (the planner checks), no bounds tests at all.
//   bounded : any N and any K that is a multiple of G: rows >= N are skipped (uniformly per
//             SIMD-group), lanes whose slice starts at or past K stop (a slice never straddles K,
//             since K % G == 0 and V divides G).
#pragma once

#include "quant_common.h"

template <typename T, typename F, bool bounded>
inline void qmv_impl(const device uint8_t* wq, const device typename F::scale_t* scales, const device T* biases,
                     const device T* x, device T* y, constant AffineParams& p, uint tg, uint simd_gid, uint lane) {
  constexpr int G = F::G, bits = F::BITS;
  constexpr int V = qmv_values_per_thread(bits);
  constexpr int BLOCK = V * SIMD_WIDTH;
  const uint N = p.N, K = p.K;
  const uint row_bytes = K * bits / 8;
  const uint groups = K / G;
  const uint row0 = tg * QMV_ROWS_PER_TG + simd_gid * QMV_ROWS_PER_SIMDGROUP;

  float acc[QMV_ROWS_PER_SIMDGROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
  float xt[V];
  for (uint k0 = 0; k0 < K; k0 += BLOCK) {
    const uint k = k0 + lane * V;
    if (bounded && k >= K) break;
    const float xsum = load_x_prescaled<T, F::X_PRESCALE, V>(x + k, xt);
    for (int r = 0; r < QMV_ROWS_PER_SIMDGROUP; ++r) {
      const uint n = row0 + r;
      if (bounded && n >= N) break;
      const uint g = n * groups + k / G;
      acc[r] += qdot<F, T, V>(wq + n * row_bytes + k * bits / 8, xt, x + k, F::scale(scales, g), F::bias(biases, g),
                              xsum);
    }
  }
  // Every lane reaches the reductions (rows past N reduce zeros and are not written).
  for (int r = 0; r < QMV_ROWS_PER_SIMDGROUP; ++r) {
    const float sum = simd_sum(acc[r]);
    const uint n = row0 + r;
    if (lane == 0 && (!bounded || n < N)) y[n] = static_cast<T>(sum);
  }
}

template <typename T, typename F>
[[kernel]] void qmv_fast(QMM_ARGS) {
  qmv_impl<T, F, false>(wq, scales, biases, x, y, p, tgid.x, simd_gid, lane);
}

template <typename T, typename F>
[[kernel]] void qmv_bounded(QMM_ARGS) {
  qmv_impl<T, F, true>(wq, scales, biases, x, y, p, tgid.x, simd_gid, lane);
}
