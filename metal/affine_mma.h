// affine_qmm_t_mma{16,32} and affine_qmm_n_mma32: y = x @ W.T / x @ W for larger M on the shared
// simdgroup-matrix tile (metal/mma_tile.h: x staging, 8x8 multiply-accumulate, bounded store);
// this file holds only the affine W loader. Design after MLX affine_qmm_t / qmm_n
// (QuantizedBlockLoader + BlockMMA) and the seed's mt_qmm_mma / mt_qmm_mma_m16.
//
//   transpose=True : wq [N, K*bits/8 bytes], scales/biases [N, K/G]   (W quantized along K)
//   transpose=False: wq [K, N*bits/8 bytes], scales/biases [K, N/G]   (W quantized along N)
//   x [M, K], y [M, N]
//
//   tile and thread mapping: metal/mma_tile.h (BM = 16 or 32 rows of x x 32 columns of y, BK = 32)
//   W loader: unit u = one decode unit (8 values along the quantized axis) of packed row a:
//     transpose: a = n, ws[n][k]  (W_NK = 1)     else: a = k, ws[k][n]  (W_NK = 0)
//   i.e. ws is always [packed row][quantized axis], written as s * q + b in float32.
//
// Edges: K % 32 == 0 for transpose=True (K % G == 0), N % 32 == 0 for transpose=False
// (N % G == 0), so only M and N (resp. M and K) need masks.
#pragma once

#include "affine_common.h"
#include "mma_tile.h"

template <typename T, int G, int bits, bool transpose>
struct AffineWLoader {
  enum : int { W_NK = transpose ? 1 : 0 };

  const device uint8_t* wq;
  const device T* scales;
  const device T* biases;
  uint rows;       // packed rows of W: N (transpose) or K
  uint row_bytes;  // bytes of one packed row
  uint groups;     // scale groups of one packed row

  void load(threadgroup float* ws, uint u, uint n0, uint k0) {
    constexpr int U = MMA_UNIT;
    constexpr int UNITS = (transpose ? MMA_BK : MMA_BN) / U;  // units along one ws row
    const uint a = u / UNITS, c = (u % UNITS) * U;
    const uint a0 = transpose ? n0 : k0, c0 = transpose ? k0 : n0;
    // Rows past the end decode the last row (inside this tile: no extra traffic) and are zeroed
    // by s = b = 0, without a branch.
    const bool live = a0 + a < rows;
    const uint ga = live ? a0 + a : rows - 1, gc = c0 + c;
    float q[U];
    decode8<bits>(wq + ga * row_bytes + gc * bits / 8, q);
    const float s = live ? float(scales[ga * groups + gc / G]) : 0.0f;
    const float b = live ? float(biases[ga * groups + gc / G]) : 0.0f;
    // fma: one rounding, as affine_dequantize (a weight is 0 only where s*q + b is).
    for (int i = 0; i < U; ++i) ws[a * MMA_LDW + c + i] = fma(s, q[i], b);
  }
};

template <typename T, int G, int bits, int BM, bool transpose>
[[kernel]] void affine_qmm_mma(AFFINE_QMM_ARGS, uint tid [[thread_index_in_threadgroup]]) {
  threadgroup T xs[BM * mma_tile_ld(sizeof(T))];
  threadgroup float ws[MMA_BN * MMA_LDW];
  const uint qlen = transpose ? p.K : p.N;  // length of a packed row
  const AffineWLoader<T, G, bits, transpose> wl{wq, scales, biases, transpose ? p.N : p.K, qlen * bits / 8, qlen / G};
  mma_tile<T, BM>(wl, x, y, p.M, p.N, p.K, xs, ws, tgid.xy, tid, simd_gid, lane);
}
