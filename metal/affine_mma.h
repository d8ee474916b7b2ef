// affine_qmm_t_mma{16,32} and affine_qmm_n_mma32: y = x @ W.T / x @ W for larger M with
// simdgroup-matrix (8x8) tiles; W is dequantized into threadgroup memory once per tile and
// K-step. Design after MLX affine_qmm_t / qmm_n (QuantizedBlockLoader + BlockMMA) and the seed's
// mt_qmm_mma / mt_qmm_mma_m16.
//
//   transpose=True : wq [N, K*bits/8 bytes], scales/biases [N, K/G]   (W quantized along K)
//   transpose=False: wq [K, N*bits/8 bytes], scales/biases [K, N/G]   (W quantized along N)
//   x [M, K], y [M, N]
//
//   tile: BM (16 or 32) rows of x  x  BN = 32 columns of y, K-steps of BK = 32
//   grid (ceil(N/32), ceil(M/BM)); one SIMD-group per 16x16 sub-tile of y:
//       BM = 32: 2x2 SIMD-groups (128 threads)    BM = 16: 1x2 SIMD-groups (64 threads)
//   per K-step:
//     xs [BM][BK + pad(T)] <- x tile (T; 8 values per thread; zeros past M and K)
//     ws                   <- W tile dequantized to float32 (8 values = one decode unit each):
//                               transpose: ws[n][k]   else: ws[k][n]   (zeros past N / K)
//     barrier; each SIMD-group: 4 k-slices x 2x2 fragments multiply-accumulate (float32); barrier
//   store: each lane writes its 2 elements of each fragment, bounds-checked against M and N.
//
// Why W is float32 in threadgroup memory (MLX keeps T): rounding each dequantized weight to
// half would add 2^-11 relative error per term, beyond the tolerance rule (tests/conftest.py).
// Strides (metal/qmm_params.h mma_tile_ld): BK + 16 bytes -> 36 floats, 40 halfs/bfloats.
// Edges: K % 32 == 0 for transpose=True (K % G == 0), N % 32 == 0 for transpose=False
// (N % G == 0), so only M and N (resp. M and K) need masks.
#pragma once

#include "affine_common.h"

// The two elements (row fm, columns fn and fn+1) a lane owns in an 8x8 simdgroup_matrix
// (Apple's layout, as MLX's MMAFrag uses it).
struct FragCoord {
  uint fm;
  uint fn;
};
inline FragCoord frag_coord(uint lane) {
  const uint qid = lane / 4;
  return FragCoord{(qid & 4) + ((lane / 2) % 4), (qid & 2) * 2 + (lane % 2) * 2};
}

template <typename T, int G, int bits, int BM, bool transpose>
inline void affine_mma_impl(const device uint8_t* wq, const device T* scales, const device T* biases,
                            const device T* x, device T* y, constant AffineParams& p, threadgroup T* xs,
                            threadgroup float* ws, uint2 tg, uint tid, uint simd_gid, uint lane) {
  constexpr int BN = MMA_BN, BK = MMA_BK, U = MMA_UNIT;
  constexpr int LDX = mma_tile_ld(sizeof(T));
  constexpr int LDW = mma_tile_ld(sizeof(float));
  constexpr int NTHREADS = mma_threads(BM);
  constexpr int SG_COLS = BN / MMA_SUBTILE;
  const uint M = p.M, N = p.N, K = p.K;
  const uint m0 = tg.y * BM, n0 = tg.x * BN;
  const uint sm = (simd_gid / SG_COLS) * MMA_SUBTILE;  // sub-tile origin in the tile
  const uint sn = (simd_gid % SG_COLS) * MMA_SUBTILE;
  const uint qlen = transpose ? K : N;  // length of a packed row
  const uint row_bytes = qlen * bits / 8;
  const uint groups = qlen / G;
  const FragCoord fc = frag_coord(lane);

  simdgroup_matrix<float, 8, 8> C[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) C[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = 0; k0 < K; k0 += BK) {
    // x tile, 8 consecutive k per unit.
    for (uint u = tid; u < BM * BK / U; u += NTHREADS) {
      const uint r = u / (BK / U), c = (u % (BK / U)) * U;
      const uint gm = m0 + r, gk = k0 + c;
      for (int i = 0; i < U; ++i) xs[r * LDX + c + i] = (gm < M && gk + i < K) ? x[gm * K + gk + i] : T(0);
    }
    // W tile, one decode unit (8 values along the quantized axis) per step.
    for (uint u = tid; u < BN * BK / U; u += NTHREADS) {
      float q[U];
      if (transpose) {
        const uint n = u / (BK / U), c = (u % (BK / U)) * U;
        // Rows past N decode row N-1 (inside this tile: no extra traffic) and are zeroed by
        // s = b = 0, without a branch.
        const bool live = n0 + n < N;
        const uint gn = live ? n0 + n : N - 1, gk = k0 + c;
        decode8<bits>(wq + gn * row_bytes + gk * bits / 8, q);
        const float s = live ? float(scales[gn * groups + gk / G]) : 0.0f;
        const float b = live ? float(biases[gn * groups + gk / G]) : 0.0f;
        for (int i = 0; i < U; ++i) ws[n * LDW + c + i] = s * q[i] + b;
      } else {
        const uint r = u / (BN / U), c = (u % (BN / U)) * U;
        // Rows past K decode row K-1 (inside this tile) and are zeroed by s = b = 0.
        const bool live = k0 + r < K;
        const uint gk = live ? k0 + r : K - 1, gn = n0 + c;
        decode8<bits>(wq + gk * row_bytes + gn * bits / 8, q);
        const float s = live ? float(scales[gk * groups + gn / G]) : 0.0f;
        const float b = live ? float(biases[gk * groups + gn / G]) : 0.0f;
        for (int i = 0; i < U; ++i) ws[r * LDW + c + i] = s * q[i] + b;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int kk = 0; kk < BK; kk += MMA_FRAG) {
      simdgroup_matrix<float, 8, 8> A[2], B[2];
      for (int i = 0; i < 2; ++i) {
        const uint r = sm + i * MMA_FRAG + fc.fm, c = kk + fc.fn;
        A[i].thread_elements()[0] = float(xs[r * LDX + c]);
        A[i].thread_elements()[1] = float(xs[r * LDX + c + 1]);
      }
      for (int j = 0; j < 2; ++j) {
        // B[k][n]: row k = kk + fm, columns n = sn + 8j + fn, +1.
        const uint k = kk + fc.fm, n = sn + j * MMA_FRAG + fc.fn;
        B[j].thread_elements()[0] = transpose ? ws[n * LDW + k] : ws[k * LDW + n];
        B[j].thread_elements()[1] = transpose ? ws[(n + 1) * LDW + k] : ws[k * LDW + n + 1];
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(C[i][j], A[i], B[j], C[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int i = 0; i < 2; ++i) {
    const uint gm = m0 + sm + i * MMA_FRAG + fc.fm;
    if (gm >= M) continue;
    for (int j = 0; j < 2; ++j) {
      const uint gn = n0 + sn + j * MMA_FRAG + fc.fn;
      if (gn < N) y[gm * N + gn] = static_cast<T>(C[i][j].thread_elements()[0]);
      if (gn + 1 < N) y[gm * N + gn + 1] = static_cast<T>(C[i][j].thread_elements()[1]);
    }
  }
}

template <typename T, int G, int bits, int BM, bool transpose>
[[kernel]] void affine_qmm_mma(const device uint8_t* wq [[buffer(BUF_WQ)]],
                               const device T* scales [[buffer(BUF_SCALES)]],
                               const device T* biases [[buffer(BUF_BIASES)]], const device T* x [[buffer(BUF_DENSE)]],
                               device T* y [[buffer(BUF_Y)]], constant AffineParams& p [[buffer(BUF_PARAMS)]],
                               uint3 tgid [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint simd_gid [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  threadgroup T xs[BM * mma_tile_ld(sizeof(T))];
  threadgroup float ws[MMA_BN * mma_tile_ld(sizeof(float))];
  affine_mma_impl<T, G, bits, BM, transpose>(wq, scales, biases, x, y, p, xs, ws, tgid.xy, tid, simd_gid, lane);
}
