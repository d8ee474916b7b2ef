// qmm_t_small (routes qmm_t_bm{2,4,8}): y = x @ W.T for small M (2 .. 8), transpose=True (W [N, K]),
// every quantized mode (format policy F, metal/quant_format.h).
// Weights are decoded once per K-block and reused for R = 2, 4 or 8 rows of x (a
// register-blocked design of 2 and 4 rows, extended to 8): W traffic is ceil(M / R) x its size, not M x.
//
//   wq [N, K*bits/8 bytes]   scales (, biases) [N, K/G]   x [M, K]   y [M, N]
//
//   grid (ceil(N/8), ceil(M/R)); threadgroup (tx, ty) = 2 SIMD-groups x 32 lanes
//   simdgroup s -> W rows n0 = 8*tx + 4*s .. +3 ; x rows m0 = R*ty .. +R-1
//   K-block of 256 = 32 lanes x 8 values:
//     lane l decodes q[4 rows][8] at k = k0 + 8l once (one unit of `bits` bytes per row),
//     then for each of the R rows of x: loads x[m, k .. k+8), acc[m][r] += s*dot(q, x) (+ b*sum(x))
//     (weight by weight where that is not finite: group_dot8)
//   end: simd_sum of each acc[m][r] -> y[m0+m, n0+r]
// Bounds: rows of x past M and rows of W past N are skipped (uniform per SIMD-group); lanes whose
// 8 values start at or past K stop (K % G == 0, so a unit never straddles K).
// The body takes its rows of x and y through a row map (metal/row_map.h): DenseRows here,
// GatherRows for gather_qmv (metal/quant_gather.h), which runs it over one expert's rows.
#pragma once

#include "quant_common.h"

// Rows m0 .. m0 + R - 1 of the row map `rows`, columns of threadgroup column tn.
template <typename T, typename F, int R, typename Rows>
inline void qmm_small_impl(const device uint8_t* wq, const device typename F::scale_t* scales, const device T* biases,
                           const device T* x, device T* y, uint N, uint K, Rows rows, uint tn, uint m0,
                           uint simd_gid, uint lane) {
  constexpr int G = F::G, bits = F::BITS;
  constexpr int ROWS = BM_ROWS_PER_SIMDGROUP;
  const uint row_bytes = K * bits / 8;
  const uint groups = K / G;
  const uint n0 = tn * BM_COLS_PER_TG + simd_gid * ROWS;

  float acc[R][ROWS];
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;

  float q[ROWS][8];
  float s[ROWS], b[ROWS];
  for (uint k0 = 0; k0 < K; k0 += BM_BLOCK_K) {
    const uint k = k0 + lane * BM_VALUES_PER_THREAD;
    if (k >= K) break;
    for (int r = 0; r < ROWS; ++r) {
      const uint n = n0 + r;
      if (n < N) {
        F::decode8(wq + n * row_bytes + k * bits / 8, q[r]);
        s[r] = F::scale(scales, n * groups + k / G);
        b[r] = F::bias(biases, n * groups + k / G);
      } else {
        for (int i = 0; i < 8; ++i) q[r][i] = 0.0f;
        s[r] = 0.0f;
        b[r] = 0.0f;
      }
    }
    for (int m = 0; m < R; ++m) {
      if (!rows.live(m0 + m)) break;
      const device T* xr = x + rows.x_row(m0 + m) * K + k;
      float xv[8];
      float xsum = 0.0f;
      for (int i = 0; i < 8; ++i) {
        xv[i] = float(xr[i]);
        xsum += xv[i];
      }
      for (int r = 0; r < ROWS; ++r) acc[m][r] += group_dot8<F>(q[r], xv, s[r], b[r], xsum);
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int r = 0; r < ROWS; ++r) {
      const float sum = simd_sum(acc[m][r]);
      if (lane == 0 && rows.live(m0 + m) && n0 + r < N) y[rows.y_row(m0 + m) * N + n0 + r] = static_cast<T>(sum);
    }
  }
}

template <typename T, typename F, int R>
[[kernel]] void qmm_t_small(QMM_ARGS) {
  qmm_small_impl<T, F, R>(wq, scales, biases, x, y, p.N, p.K, DenseRows{p.M}, tgid.x, tgid.y * R, simd_gid, lane);
}
