// gguf_qmm_{type}_mma32: y = x @ W.T for large M with simdgroup-matrix (8x8) tiles, W given as
// GGUF K-quant blocks (metal/gguf_format.h) dequantized into threadgroup memory once per tile and
// K-step. The tile, fragments and strides are the affine tile's (metal/affine_mma.h, after MLX's
// QuantizedBlockLoader + BlockMMA); only the W loader differs: a unit is 8 consecutive weights of
// one super-block, which always share one sub-block scale (and min):
//
//   Q4_K: k % 256 = 32j + 8u   -> qs[32*(j/2) + 8u .. +8), low (j even) or high nibbles, sub-block j
//   Q6_K: k % 256 = 128h + 32t + l (l in {0, 8, 16, 24}) -> ql[64h + 32*(t%2) + l ..) nibble t/2,
//         qh[32h + l ..) bits 2t, scale 8h + 2t + l/16
//
//   blocks uint8 [N, K/256 * B]   x [M, K]   y [M, N]
//   tile: 32 rows of x x 32 columns of y, K-steps of 32 (K % 256 == 0: no K mask)
//   grid (ceil(N/32), ceil(M/32)); 2x2 SIMD-groups (128 threads), one per 16x16 sub-tile of y
//   per K-step: xs [32][BK + pad(T)] <- x (zeros past M); ws [32][36] float <- 128 units of W (one per
//   thread; rows past N decode row N-1 and are zeroed); barrier; 4 k-slices x 2x2 fragments; barrier
// W is float32 in threadgroup memory for the reason given in affine_mma.h (tolerance rule).
#pragma once

#include "affine_mma.h"  // FragCoord / frag_coord: the 8x8 fragment layout, written once
#include "gguf_qmm.h"

// 8 dequantized weights starting at k (a multiple of 8) of super-block `raw`.
template <int type>
inline void gguf_decode8(const device uint8_t* raw, uint k, thread float* w);

template <>
inline void gguf_decode8<torch_qmm::gguf::kTypeQ4_K>(const device uint8_t* raw, uint k, thread float* w) {
  const device torch_qmm::gguf::BlockQ4K* b = (const device torch_qmm::gguf::BlockQ4K*)raw;
  const uint j = k / 32, u = (k % 32) / 8;
  const torch_qmm::gguf::ScaleMin sm = torch_qmm::gguf::q4k_scale_min(int(j), b->scales);
  const float s = float(as_type<half>(b->d)) * float(sm.scale);
  const float m = float(as_type<half>(b->dmin)) * float(sm.min);
  const device uint32_t* q = (const device uint32_t*)(b->qs + 32 * (j / 2) + 8 * u);  // 4-byte aligned
  const uint shift = 4 * (j % 2);
  for (int h = 0; h < 2; ++h) {
    const uint32_t v = q[h];
    for (int i = 0; i < 4; ++i) w[4 * h + i] = s * float((v >> (8 * i + shift)) & 0xfu) - m;
  }
}

template <>
inline void gguf_decode8<torch_qmm::gguf::kTypeQ6_K>(const device uint8_t* raw, uint k, thread float* w) {
  const device torch_qmm::gguf::BlockQ6K* b = (const device torch_qmm::gguf::BlockQ6K*)raw;
  const uint h = k / 128, t = (k % 128) / 32, l = k % 32;
  const float s = float(as_type<half>(b->d)) * float(b->scales[8 * h + 2 * t + l / 16]);
  const device uint16_t* ql = (const device uint16_t*)(b->ql + 64 * h + 32 * (t % 2) + l);  // 2-byte aligned
  const device uint16_t* qh = (const device uint16_t*)(b->qh + 32 * h + l);
  for (int p = 0; p < 4; ++p) {
    const uint32_t lo = ql[p], hi = qh[p];
    for (int i = 0; i < 2; ++i) {
      const uint32_t v = ((lo >> (8 * i + 4 * (t / 2))) & 0xfu) | (((hi >> (8 * i + 2 * t)) & 0x3u) << 4);
      w[2 * p + i] = s * float(int(v) - 32);
    }
  }
}

template <typename T, int type>
inline void gguf_mma_impl(const device uint8_t* blocks, const device T* x, device T* y, constant GGUFParams& p,
                          threadgroup T* xs, threadgroup float* ws, uint2 tg, uint tid, uint simd_gid, uint lane) {
  constexpr int BM = 32, BN = MMA_BN, BK = MMA_BK, U = MMA_UNIT;
  constexpr int LDX = mma_tile_ld(sizeof(T));
  constexpr int LDW = mma_tile_ld(sizeof(float));
  constexpr int NTHREADS = mma_threads(BM);
  constexpr int SG_COLS = BN / MMA_SUBTILE;
  constexpr int BYTES = GGUFSlice<type>::BYTES;
  const uint M = p.M, N = p.N, K = p.K;
  const uint row_bytes = p.blocks_per_row * BYTES;
  const uint m0 = tg.y * BM, n0 = tg.x * BN;
  const uint sm = (simd_gid / SG_COLS) * MMA_SUBTILE;
  const uint sn = (simd_gid % SG_COLS) * MMA_SUBTILE;
  const FragCoord fc = frag_coord(lane);

  simdgroup_matrix<float, 8, 8> C[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) C[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = 0; k0 < K; k0 += BK) {
    for (uint u = tid; u < BM * BK / U; u += NTHREADS) {
      const uint r = u / (BK / U), c = (u % (BK / U)) * U;
      const uint gm = m0 + r, gk = k0 + c;
      for (int i = 0; i < U; ++i) xs[r * LDX + c + i] = gm < M ? x[gm * K + gk + i] : T(0);
    }
    for (uint u = tid; u < BN * BK / U; u += NTHREADS) {
      const uint n = u / (BK / U), c = (u % (BK / U)) * U;
      const bool live = n0 + n < N;
      const uint gn = live ? n0 + n : N - 1, gk = k0 + c;
      float w[U];
      gguf_decode8<type>(blocks + gn * row_bytes + (gk / torch_qmm::gguf::kQK_K) * BYTES,
                         gk % torch_qmm::gguf::kQK_K, w);
      for (int i = 0; i < U; ++i) ws[n * LDW + c + i] = live ? w[i] : 0.0f;
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
        const uint k = kk + fc.fm, n = sn + j * MMA_FRAG + fc.fn;
        B[j].thread_elements()[0] = ws[n * LDW + k];
        B[j].thread_elements()[1] = ws[(n + 1) * LDW + k];
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

template <typename T, int type>
[[kernel]] void gguf_qmm_mma(const device uint8_t* blocks [[buffer(GGUF_BUF_BLOCKS)]],
                             const device T* x [[buffer(GGUF_BUF_X)]], device T* y [[buffer(GGUF_BUF_Y)]],
                             constant GGUFParams& p [[buffer(GGUF_BUF_PARAMS)]],
                             uint3 tgid [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint simd_gid [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup T xs[32 * mma_tile_ld(sizeof(T))];
  threadgroup float ws[MMA_BN * mma_tile_ld(sizeof(float))];
  gguf_mma_impl<T, type>(blocks, x, y, p, xs, ws, tgid.xy, tid, simd_gid, lane);
}
