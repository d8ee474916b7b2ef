// qmm_mma (routes qmm_t_mma{16,32}, qmm_n_mma32): y = x @ W.T / x @ W for larger M on the shared
// simdgroup-matrix tile (metal/mma_tile.h: x staging, 8x8 multiply-accumulate, bounded store);
// this file holds only the quantized-mode W loader (format policy F, metal/quant_format.h). Design after MLX affine_qmm_t / qmm_n
// (QuantizedBlockLoader + BlockMMA).
//
//   transpose=True : wq [N, K*bits/8 bytes], scales (, biases) [N, K/G]   (W quantized along K)
//   transpose=False: wq [K, N*bits/8 bytes], scales (, biases) [K, N/G]   (W quantized along N)
//   x [M, K], y [M, N]
//
//   tile and thread mapping: metal/mma_tile.h (BM = 16 or 32 rows of x x 32 columns of y, BK = 32)
//   W loader: unit u = one decode unit (8 values along the quantized axis) of packed row a:
//     transpose: a = n, ws[n][k]  (W_NK = 1)     else: a = k, ws[k][n]  (W_NK = 0)
//   i.e. ws is always [packed row][quantized axis], written as F::weight(s, q, b) in float32.
//
// Edges: packed rows past the end, and (for G = 16, where the quantized axis need not be a
// multiple of the 32-wide tile) units past the end of a packed row, write zeros: a select, not
// s = 0, since an fp code may decode to NaN and 0 * NaN is NaN.
#pragma once

#include "quant_common.h"
#include "mma_tile.h"

template <typename T, typename F, bool transpose>
struct QuantWLoader {
  enum : int { W_NK = transpose ? 1 : 0 };

  const device uint8_t* wq;
  const device typename F::scale_t* scales;
  const device T* biases;
  uint rows;       // packed rows of W: N (transpose) or K
  uint row_bytes;  // bytes of one packed row
  uint groups;     // scale groups of one packed row

  void load(threadgroup float* ws, uint u, uint n0, uint k0) {
    constexpr int U = MMA_UNIT, G = F::G, bits = F::BITS;
    constexpr int UNITS = (transpose ? MMA_BK : MMA_BN) / U;  // units along one ws row
    const uint a = u / UNITS, c = (u % UNITS) * U;
    const uint a0 = transpose ? n0 : k0, c0 = transpose ? k0 : n0;
    // Units past the end decode the last row / unit (inside this tile: no extra traffic) and
    // store zeros.
    const bool live = a0 + a < rows && c0 + c < groups * G;
    const uint ga = min(a0 + a, rows - 1), gc = min(c0 + c, groups * G - U);
    float q[U];
    F::decode8(wq + ga * row_bytes + gc * bits / 8, q);
    const float s = F::scale(scales, ga * groups + gc / G);
    const float b = F::bias(biases, ga * groups + gc / G);
    for (int i = 0; i < U; ++i) ws[a * MMA_LDW + c + i] = live ? F::weight(s, q[i], b) : 0.0f;
  }
};

template <typename T, typename F, int BM, bool transpose>
[[kernel]] void qmm_mma(QMM_ARGS, uint tid [[thread_index_in_threadgroup]]) {
  threadgroup T xs[BM * mma_tile_ld(sizeof(T))];
  threadgroup float ws[MMA_BN * MMA_LDW];
  const uint qlen = transpose ? p.K : p.N;  // length of a packed row
  const QuantWLoader<T, F, transpose> wl{wq, scales, biases, transpose ? p.N : p.K, qlen * F::BITS / 8, qlen / F::G};
  mma_tile<T, BM>(wl, x, y, DenseRows{p.M}, p.N, p.K, xs, ws, tgid.xy, tid, simd_gid, lane);
}
