// gguf_qmm_mma32_{dtype}_{type}: y = x @ W.T for large M on the shared simdgroup-matrix tile
// (metal/mma_tile.h: x staging, 8x8 multiply-accumulate, bounded store; after MLX's
// QuantizedBlockLoader + BlockMMA), W given as GGUF K-quant or i-quant blocks (metal/gguf_format.h).
// This file holds only their W loader: a unit is 8 consecutive weights of one super-block, which
// always share one sub-block scale (and min):
//
//   Q4_K: k % 256 = 32j + 8u   -> qs[32*(j/2) + 8u .. +8), low (j even) or high nibbles, sub-block j
//   Q5_K: as Q4_K (qs from byte 48), fifth bits: qh[8u .. +8) bit j
//   Q6_K: k % 256 = 128h + 32t + l (l in {0, 8, 16, 24}) -> ql[64h + 32*(t%2) + l ..) nibble t/2,
//         qh[32h + l ..) bits 2t, scale 8h + 2t + l/16
//   Q2_K: k % 256 = 128h + 32t + l -> qs[32h + l .. +8) bits 2t, 2t+1 (two uint32), scale and min
//         of sub-block 8h + 2t + l/16
//   Q3_K: as Q2_K (qs as four uint16), third bits: hmask[l .. +8) bit 4h + t (four uint16), scale
//         of sub-block 8h + 2t + l/16
//   IQ4_XS: k % 256 = 32j + 16*nib + 8u -> qs[16j + 8u .. +8) (two uint32), low (nib 0) or high
//         nibbles, values kIQ4Values[code], scale d * (l_j - 32) of sub-block j
//   lattice i-quants: k % 256 = 8r -> group r (gguf::Lattice<type>::code)
//
//   blocks uint8 [N, K/256 * B]   x [M, K]   y [M, N]
//   tile: 32 rows of x x 32 columns of y, K-steps of 32 (K % 256 == 0: the K mask never fires)
//   grid (ceil(N/32), ceil(M/32)); 2x2 SIMD-groups (128 threads), one per 16x16 sub-tile of y
//   W loader: ws[n][k] float (W_NK = 1), 128 units of W per K-step (one per thread); rows past N
//   decode row N-1 and are zeroed.
#pragma once

#include "gguf_qmm.h"
#include "mma_tile.h"

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
inline void gguf_decode8<torch_qmm::gguf::kTypeQ5_K>(const device uint8_t* raw, uint k, thread float* w) {
  const device torch_qmm::gguf::BlockQ5K* b = (const device torch_qmm::gguf::BlockQ5K*)raw;
  const uint j = k / 32, u = (k % 32) / 8;
  const float d = float(as_type<half>(b->d)), dmin = float(as_type<half>(b->dmin));
  const torch_qmm::gguf::ScaleMin sub = torch_qmm::gguf::q4k_scale_min(int(j), b->scales);
  const float s = d * float(sub.scale), m = dmin * float(sub.min);
  const device uint32_t* q = (const device uint32_t*)(b->qs + 32 * (j / 2) + 8 * u);  // 4-byte aligned
  const device uint32_t* qh = (const device uint32_t*)(b->qh + 8 * u);                // 4-byte aligned
  const uint shift = 4 * (j % 2);
  for (int h = 0; h < 2; ++h) {
    const uint32_t v = q[h], hi = qh[h];
    for (int i = 0; i < 4; ++i)
      w[4 * h + i] = s * float(((v >> (8 * i + shift)) & 0xfu) | (((hi >> (8 * i + j)) & 0x1u) << 4)) - m;
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

template <>
inline void gguf_decode8<torch_qmm::gguf::kTypeQ2_K>(const device uint8_t* raw, uint k, thread float* w) {
  const device torch_qmm::gguf::BlockQ2K* b = (const device torch_qmm::gguf::BlockQ2K*)raw;
  const uint h = k / 128, t = (k % 128) / 32, l = k % 32;
  const uint sc = b->scales[8 * h + 2 * t + l / 16];
  const float s = float(as_type<half>(b->d)) * float(sc & 0xfu);
  const float m = float(as_type<half>(b->dmin)) * float(sc >> 4);
  const device uint32_t* q = (const device uint32_t*)(b->qs + 32 * h + l);  // 4-byte aligned
  for (int p = 0; p < 2; ++p) {
    const uint32_t v = q[p];
    for (int i = 0; i < 4; ++i) w[4 * p + i] = s * float((v >> (8 * i + 2 * t)) & 0x3u) - m;
  }
}

template <>
inline void gguf_decode8<torch_qmm::gguf::kTypeQ3_K>(const device uint8_t* raw, uint k, thread float* w) {
  const device torch_qmm::gguf::BlockQ3K* b = (const device torch_qmm::gguf::BlockQ3K*)raw;
  const uint h = k / 128, t = (k % 128) / 32, l = k % 32;
  const float s = float(as_type<half>(b->d)) * float(torch_qmm::gguf::q3k_scale(int(8 * h + 2 * t + l / 16), b->scales));
  const device uint16_t* qs = (const device uint16_t*)(b->qs + 32 * h + l);  // 2-byte aligned
  const device uint16_t* hm = (const device uint16_t*)(b->hmask + l);
  for (int p = 0; p < 4; ++p) {
    const uint32_t lo = qs[p], hi = hm[p];
    for (int i = 0; i < 2; ++i) {
      const uint32_t v = ((lo >> (8 * i + 2 * t)) & 0x3u) | (((hi >> (8 * i + 4 * h + t)) & 0x1u) << 2);
      w[2 * p + i] = s * float(int(v) - 4);
    }
  }
}

template <>
inline void gguf_decode8<torch_qmm::gguf::kTypeIQ4_XS>(const device uint8_t* raw, uint k, thread float* w) {
  const device torch_qmm::gguf::BlockIQ4XS* b = (const device torch_qmm::gguf::BlockIQ4XS*)raw;
  const uint j = k / 32, nib = (k % 32) / 16, u = (k % 16) / 8;
  const float s = float(as_type<half>(b->d)) *
                  float(torch_qmm::gguf::iq4xs_scale(int(j), b->scales_l, uint(b->scales_h)));
  const device uint32_t* q = (const device uint32_t*)(b->qs + 16 * j + 8 * u);  // 4-byte aligned
  for (int h = 0; h < 2; ++h) {
    const uint32_t v = q[h];
    for (int i = 0; i < 4; ++i)
      w[4 * h + i] = s * float(torch_qmm::gguf::kIQ4Values[(v >> (8 * i + 4 * nib)) & 0xfu]);
  }
}

template <int type>
inline void lattice_decode8(const device uint8_t* raw, uint k, thread float* w) {
  typedef torch_qmm::gguf::Lattice<type> L;
  const device typename L::Block* b = (const device typename L::Block*)raw;
  const torch_qmm::gguf::Group8 g = torch_qmm::gguf::group8(L::code(b, int(k / 8), float(as_type<half>(ushort(L::d_bits(b))))));
  for (int i = 0; i < 8; ++i) w[i] = g.scale * g.q[i];
}

#define GGUF_LATTICE_DECODE8(type_id)                                                                 \
  template <>                                                                                         \
  inline void gguf_decode8<type_id>(const device uint8_t* raw, uint k, thread float* w) {             \
    lattice_decode8<type_id>(raw, k, w);                                                              \
  }

GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ2_XXS)
GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ2_XS)
GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ2_S)
GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ3_XXS)
GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ3_S)
GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ1_S)
GGUF_LATTICE_DECODE8(torch_qmm::gguf::kTypeIQ1_M)

template <int type>
struct GGUFWLoader {
  enum : int { W_NK = 1 };

  const device uint8_t* blocks;
  uint N;
  uint row_bytes;  // bytes of one row of W: K/256 blocks

  void load(threadgroup float* ws, uint u, uint n0, uint k0) {
    constexpr int U = MMA_UNIT, BYTES = GGUFSlice<type>::BYTES;
    const uint n = u / (MMA_BK / U), c = (u % (MMA_BK / U)) * U;
    const bool live = n0 + n < N;
    const uint gn = live ? n0 + n : N - 1, gk = k0 + c;
    float w[U];
    gguf_decode8<type>(blocks + gn * row_bytes + (gk / torch_qmm::gguf::kQK_K) * BYTES,
                       gk % torch_qmm::gguf::kQK_K, w);
    for (int i = 0; i < U; ++i) ws[n * MMA_LDW + c + i] = live ? w[i] : 0.0f;
  }
};

template <typename T, int type>
[[kernel]] void gguf_qmm_mma(GGUF_QMM_ARGS, uint tid [[thread_index_in_threadgroup]]) {
  constexpr int BM = 32;
  threadgroup T xs[BM * mma_tile_ld(sizeof(T))];
  threadgroup float ws[MMA_BN * MMA_LDW];
  const GGUFWLoader<type> wl{blocks, p.N, p.blocks_per_row * GGUFSlice<type>::BYTES};
  mma_tile<T, BM>(wl, x, y, DenseRows{p.M}, p.N, p.K, xs, ws, tgid.xy, tid, simd_gid, lane);
}
