// The simdgroup-matrix (8x8) tile shared by every large-M kernel: y tile = x tile @ W tile, with W
// dequantized into threadgroup memory by a format-specific W loader. Users: affine_qmm_t_mma{16,32}
// and affine_qmm_n_mma32 (metal/quant_mma.h), gguf_qmm_{type}_mma32 (metal/gguf_mma.h).
// Design after MLX's affine_qmm_t / qmm_n: a QuantizedBlockLoader-like W loader + BlockMMA.
//
//   x [M, K], y [M, N]; W [N, K] seen through the loader
//   tile: BM (16 or 32) rows of x  x  BN = 32 columns of y, K-steps of BK = 32
//   grid (ceil(N/32), ceil(M/BM)); one SIMD-group per 16x16 sub-tile of y:
//       BM = 32: 2x2 SIMD-groups (128 threads)    BM = 16: 1x2 SIMD-groups (64 threads)
//   per K-step:
//     xs [BM][BK + pad(T)] <- x tile (T; 8 consecutive k per unit, units spread over the threads;
//                             zeros past M and K)
//     ws [32][36] float    <- the loader's units, u = tid, tid + NTHREADS, ... < BN*BK/8:
//                               W_NK = 1: ws[n][k]   W_NK = 0: ws[k][n]   (zeros past N / K)
//     barrier; each SIMD-group: 4 k-slices x 2x2 fragments multiply-accumulate (float32); barrier
//   store: each lane writes its 2 elements of each fragment, bounds-checked against M and N.
//
// A W loader is a struct with
//   enum : int { W_NK = 0 or 1 };                        // layout of ws (above)
//   void load(threadgroup float* ws, uint u, uint n0, uint k0);
// which dequantizes unit u (8 values along W's quantized axis) of the W tile at (n0, k0) into ws,
// row stride MMA_LDW, writing zeros for elements past N / K.
//
// Rows of x and y through a row map (metal/row_map.h): tile rows m0 .. m0 + BM - 1 are rows of the
// map; rows it does not hold stage zeros and are not stored (DenseRows{M}: the rows past M).
//
// Why W is float32 in threadgroup memory (MLX keeps T): rounding each dequantized weight to half
// would add 2^-11 relative error per term, beyond the tolerance rule (tests/conftest.py).
// Strides (metal/qmm_params.h mma_tile_ld): BK + 16 bytes -> 36 floats, 40 halfs/bfloats.
#pragma once

#include <metal_stdlib>

#define TORCH_QMM_METAL 1
#include "qmm_params.h"
#include "row_map.h"

using namespace metal;

// Row stride (floats) of ws, the W tile in threadgroup memory.
enum MmaTileLayout : int { MMA_LDW = mma_tile_ld(sizeof(float)) };

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

// xs: BM * mma_tile_ld(sizeof(T)) elements; ws: MMA_BN * MMA_LDW floats (threadgroup memory).
template <typename T, int BM, typename WLoader, typename Rows>
inline void mma_tile(WLoader wl, const device T* x, device T* y, Rows rows, uint N, uint K, threadgroup T* xs,
                     threadgroup float* ws, uint2 tg, uint tid, uint simd_gid, uint lane) {
  constexpr int BN = MMA_BN, BK = MMA_BK, U = MMA_UNIT;
  constexpr int LDX = mma_tile_ld(sizeof(T));
  constexpr int LDW = MMA_LDW;
  constexpr int NTHREADS = mma_threads(BM);
  constexpr int SG_COLS = BN / MMA_SUBTILE;
  const uint m0 = tg.y * BM, n0 = tg.x * BN;
  const uint sm = (simd_gid / SG_COLS) * MMA_SUBTILE;  // sub-tile origin in the tile
  const uint sn = (simd_gid % SG_COLS) * MMA_SUBTILE;
  const FragCoord fc = frag_coord(lane);

  simdgroup_matrix<float, 8, 8> C[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) C[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = 0; k0 < K; k0 += BK) {
    // x tile, 8 consecutive k per unit.
    for (uint u = tid; u < BM * BK / U; u += NTHREADS) {
      const uint r = u / (BK / U), c = (u % (BK / U)) * U;
      const bool live = rows.live(m0 + r);
      const uint gm = live ? rows.x_row(m0 + r) : 0, gk = k0 + c;
      for (int i = 0; i < U; ++i) xs[r * LDX + c + i] = (live && gk + i < K) ? x[gm * K + gk + i] : T(0);
    }
    // W tile, one unit per step.
    for (uint u = tid; u < BN * BK / U; u += NTHREADS) wl.load(ws, u, n0, k0);
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
        B[j].thread_elements()[0] = WLoader::W_NK ? ws[n * LDW + k] : ws[k * LDW + n];
        B[j].thread_elements()[1] = WLoader::W_NK ? ws[(n + 1) * LDW + k] : ws[k * LDW + n + 1];
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(C[i][j], A[i], B[j], C[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int i = 0; i < 2; ++i) {
    const uint tm = m0 + sm + i * MMA_FRAG + fc.fm;
    if (!rows.live(tm)) continue;
    const uint gm = rows.y_row(tm);
    for (int j = 0; j < 2; ++j) {
      const uint gn = n0 + sn + j * MMA_FRAG + fc.fn;
      if (gn < N) y[gm * N + gn] = static_cast<T>(C[i][j].thread_elements()[0]);
      if (gn + 1 < N) y[gm * N + gn + 1] = static_cast<T>(C[i][j].thread_elements()[1]);
    }
  }
}
