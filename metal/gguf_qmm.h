// gguf_qmv / gguf_qmm: y[M, N] = x[M, K] @ W.T with W [N, K] given as GGUF K-quant blocks (Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K) or i-quant blocks (IQ4_XS; the lattice types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
// IQ2_S, IQ3_XXS, IQ3_S) (layouts in metal/gguf_format.h), decoded in-kernel from the file's bytes;
// float32 accumulation; x, y in float / half / bfloat.
//
//   blocks uint8 [N, K/256 * B] (B = 84 Q2_K, 110 Q3_K, 144 Q4_K, 176 Q5_K, 210 Q6_K, 136 IQ4_XS,
//                                50 IQ1_S, 56 IQ1_M, 66 IQ2_XXS, 74 IQ2_XS, 82 IQ2_S, 98 IQ3_XXS, 110 IQ3_S)
//   x [M, K]   y [M, N]   K % 256 == 0
//
//   grid (ceil(N/8), ceil(M/R)); threadgroup = 2 SIMD-groups x 32 lanes
//   simdgroup s -> W rows n0 = 8*tx + 4*s .. +3 ;  x rows m0 = R*ty .. +R-1   (R = 1: qmv)
//   the 32 lanes form teams of L lanes, team t walks super-blocks t, t + 32/L, t + 2*32/L, ...
//     Q4_K, Q5_K, L = 8 : slot s = lane % 8 (iq = s/4, ir = s%4) owns 4 runs of 8 weights,
//                   chunks c in {iq, iq+2} x nibble {low, high}: weights 64c + 32*nib + 8ir .. +8
//                   (one scale/min pair per run: sub-block 2c + nib; Q5_K's fifth bits: bit
//                   2c + nib of qh[8ir .. +8))
//     Q2_K, Q3_K, Q6_K, L = 16: slot s = lane % 16 (h = s/8, l0 = 4*(s%8)) owns 4 runs of 4
//                   weights, weights 128h + 32t + l0 .. +4 for t = 0..3 (one scale per run:
//                   sub-block 8h + 2t + l0/16; Q2_K also a min)
//     IQ4_XS, L = 8   : slot s = lane % 8 owns sub-block s, 4 runs of 8 weights: weights
//                   32s + 8j .. +8 for j = 0..3 (the low (j < 2) or high (j >= 2) nibbles of
//                   qs[16s + 8*(j%2) .. +8); one scale for the 4 runs, d * (l_s - 32), no min;
//                   the codes' values from kIQ4Values)
//     lattice i-quants, L = 8: slot s owns sub-block s, its 4 groups of 8 weights 32s + 8j .. +8
//                   (j = 0..3; gguf::Lattice decodes a group: codebook entry, signs or offset,
//                   scale; no min)
//   per super-block and W row: decode the lane's runs once (codes as floats, a scale and a min
//   per run), then for each of the R rows of x: acc[m][r] += scale * dot(q, x) - min * sum(x)
//   (weight by weight where that is not finite: run_dot)
//   end: simd_sum of each acc[m][r] -> y[m0 + m, n0 + r]
//
// Design credits: the lane/block interleaving and the per-run "scale * dot - min * sum(x)"
// factoring follow llama.cpp's kernel_mul_mv_{q2_K, q3_K, q4_K, q5_K, q6_K}_f32 (ggml-metal), the
// IQ4_XS sub-block's "scale * dot(value, x)" its kernel_mul_mv_iq4_xs_f32 (which splits a
// sub-block over two lanes of 16-lane teams; here one lane takes it whole), as do the lattice
// types' groups its kernel_mul_mv_iq2_xxs_f32 and siblings (which copy the codebooks to threadgroup
// memory; here they are read from constant memory);
// reusing one decode for R rows of x is the small-M design of metal/quant_qmm_small.h.
// Bounds: rows of W past N and rows of x past M are skipped uniformly per SIMD-group; teams
// whose next super-block is past K/256 stop (no collective inside the loop).
// Alignment: Q4_K blocks are read as uint32 (runs sit at 16 + 32c + 8ir bytes of a 144-byte
// block), Q5_K as uint32 (qs runs at 48 + 32c + 8ir, qh[8ir ..) at 16 + 8ir bytes of a 176-byte
// block), Q2_K as uint32 (qs[32h + l0 ..) at byte 16 + 32h + l0 of an 84-byte block), Q3_K and
// Q6_K as uint16 (110- and 210-byte blocks are 2-aligned), IQ4_XS as uint32 (qs[16s ..) at byte
// 8 + 16s of a 136-byte block; d and scales_h as uint16 at bytes 0 and 2), the lattice types as
// their structs' uint8 / uint16 fields (every block a whole number of uint16); the executors bind
// `blocks` at a 4-byte-aligned offset.
#pragma once

#include <metal_stdlib>

#define TORCH_QMM_METAL 1
#include "gguf_params.h"
#include "kernel_names.h"

using namespace metal;

// The arguments of every gguf [[kernel]] (templated on T), written once: the buffers at their
// GGUFBuffer indices (gguf_params.h), then the thread positions. The mma tile adds
// thread_index_in_threadgroup after these.
#define GGUF_QMM_ARGS                                                                                 \
  const device uint8_t* blocks [[buffer(GGUF_BUF_BLOCKS)]], const device T* x [[buffer(GGUF_BUF_X)]], \
      device T* y [[buffer(GGUF_BUF_Y)]], constant GGUFParams& p [[buffer(GGUF_BUF_PARAMS)]],         \
      uint3 tgid [[threadgroup_position_in_grid]], uint simd_gid [[simdgroup_index_in_threadgroup]],  \
      uint lane [[thread_index_in_simdgroup]]

// ---- Decoding one lane's share of a super-block ----------------------------------------------
// RUNS runs of RUN consecutive weights; run j covers x[offset(j) .. +RUN) of the super-block and
// its weights are scale[j] * q[j][i] - min[j] (HAS_MIN) or scale[j] * q[j][i]. Compile-time
// constants are enumerators (MSL wants program-scope and static data in `constant` space).
//
// The primary template serves the lattice i-quants (every type with a gguf::Lattice; the others are
// the specializations below): slot s decodes sub-block s, its groups 4s .. 4s + 3
// (gguf::Lattice<type>::code; each group one run).
template <int type>
struct GGUFSlice {
  typedef torch_qmm::gguf::Lattice<type> L;
  typedef typename L::Block Block;
  enum : int { LANES = 8, RUNS = 4, RUN = 8, HAS_MIN = 0, BYTES = sizeof(Block) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];  // unused (the groups' values are signed or offset already)

  static uint offset(uint slot, int j) { return 32 * slot + 8 * uint(j); }

  void decode(const device uint8_t* raw, uint slot) {
    const device Block* b = (const device Block*)raw;
    const float d = float(as_type<half>(ushort(L::d_bits(b))));
    for (int j = 0; j < RUNS; ++j) {
      const torch_qmm::gguf::Group8 g = torch_qmm::gguf::group8(L::code(b, int(4 * slot) + j, d));
      for (int i = 0; i < RUN; ++i) q[j][i] = g.q[i];
      scale[j] = g.scale;
      min[j] = 0.0f;
    }
  }
};

template <>
struct GGUFSlice<torch_qmm::gguf::kTypeQ4_K> {
  enum : int { LANES = 8, RUNS = 4, RUN = 8, HAS_MIN = 1, BYTES = sizeof(torch_qmm::gguf::BlockQ4K) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];

  // Run j: chunk c = iq + 2 * (j / 2), nibble j % 2.
  static uint offset(uint slot, int j) {
    const uint iq = slot / 4, ir = slot % 4;
    return 64 * (iq + 2 * (j / 2)) + 32 * (j % 2) + 8 * ir;
  }

  void decode(const device uint8_t* raw, uint slot) {
    const device torch_qmm::gguf::BlockQ4K* b = (const device torch_qmm::gguf::BlockQ4K*)raw;
    const uint iq = slot / 4, ir = slot % 4;
    const float d = float(as_type<half>(b->d));
    const float dmin = float(as_type<half>(b->dmin));
    for (int cc = 0; cc < 2; ++cc) {
      const uint c = iq + 2 * cc;
      const device uint32_t* w = (const device uint32_t*)(b->qs + 32 * c + 8 * ir);
      const uint32_t w0 = w[0], w1 = w[1];
      for (int nib = 0; nib < 2; ++nib) {
        const int j = 2 * cc + nib;
        const torch_qmm::gguf::ScaleMin sm = torch_qmm::gguf::q4k_scale_min(int(2 * c) + nib, b->scales);
        scale[j] = d * float(sm.scale);
        min[j] = dmin * float(sm.min);
        for (int i = 0; i < 4; ++i) {
          q[j][i] = float((w0 >> (8 * i + 4 * nib)) & 0xfu);
          q[j][i + 4] = float((w1 >> (8 * i + 4 * nib)) & 0xfu);
        }
      }
    }
  }
};

// Q5_K: Q4_K's lane mapping, scales and nibbles (qs at byte 48 of the block), plus each code's fifth
// bit: bit 2c + nib of qh[8ir + i] for weight i of the run in chunk c, nibble nib. A slot's 4 runs
// read the same 8 bytes qh[8ir .. +8), one shift per run.
template <>
struct GGUFSlice<torch_qmm::gguf::kTypeQ5_K> {
  enum : int { LANES = 8, RUNS = 4, RUN = 8, HAS_MIN = 1, BYTES = sizeof(torch_qmm::gguf::BlockQ5K) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];

  static uint offset(uint slot, int j) { return GGUFSlice<torch_qmm::gguf::kTypeQ4_K>::offset(slot, j); }

  void decode(const device uint8_t* raw, uint slot) {
    const device torch_qmm::gguf::BlockQ5K* b = (const device torch_qmm::gguf::BlockQ5K*)raw;
    const uint iq = slot / 4, ir = slot % 4;
    const float d = float(as_type<half>(b->d));
    const float dmin = float(as_type<half>(b->dmin));
    // qh sits at byte 16 and qs at byte 48 of a 176-byte block, runs at multiples of 8 bytes:
    // 4-byte aligned.
    const device uint32_t* hw = (const device uint32_t*)(b->qh + 8 * ir);
    const uint32_t h0 = hw[0], h1 = hw[1];
    for (int cc = 0; cc < 2; ++cc) {
      const uint c = iq + 2 * cc;
      const device uint32_t* w = (const device uint32_t*)(b->qs + 32 * c + 8 * ir);
      const uint32_t w0 = w[0], w1 = w[1];
      for (int nib = 0; nib < 2; ++nib) {
        const int j = 2 * cc + nib;
        const uint hb = 2 * c + uint(nib);  // the run's sub-block, and its bit of qh
        const torch_qmm::gguf::ScaleMin sub = torch_qmm::gguf::q4k_scale_min(int(hb), b->scales);
        scale[j] = d * float(sub.scale);
        min[j] = dmin * float(sub.min);
        for (int i = 0; i < 4; ++i) {
          q[j][i] = float(((w0 >> (8 * i + 4 * nib)) & 0xfu) | (((h0 >> (8 * i + hb)) & 0x1u) << 4));
          q[j][i + 4] = float(((w1 >> (8 * i + 4 * nib)) & 0xfu) | (((h1 >> (8 * i + hb)) & 0x1u) << 4));
        }
      }
    }
  }
};

template <>
struct GGUFSlice<torch_qmm::gguf::kTypeQ6_K> {
  enum : int { LANES = 16, RUNS = 4, RUN = 4, HAS_MIN = 0, BYTES = sizeof(torch_qmm::gguf::BlockQ6K) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];  // unused (Q6_K is symmetric around 32)

  static uint offset(uint slot, int t) { return 128 * (slot / 8) + 32 * t + 4 * (slot % 8); }

  void decode(const device uint8_t* raw, uint slot) {
    const device torch_qmm::gguf::BlockQ6K* b = (const device torch_qmm::gguf::BlockQ6K*)raw;
    const uint h = slot / 8, l0 = 4 * (slot % 8);
    const float d = float(as_type<half>(b->d));
    // 4 bytes of ql for runs 0/2 (low/high nibble), 4 of ql + 32 for runs 1/3, 4 of qh (2 bits per run).
    const device uint16_t* qa = (const device uint16_t*)(b->ql + 64 * h + l0);
    const device uint16_t* qb = (const device uint16_t*)(b->ql + 64 * h + 32 + l0);
    const device uint16_t* qh = (const device uint16_t*)(b->qh + 32 * h + l0);
    const uint32_t a = uint32_t(qa[0]) | (uint32_t(qa[1]) << 16);
    const uint32_t c = uint32_t(qb[0]) | (uint32_t(qb[1]) << 16);
    const uint32_t hi = uint32_t(qh[0]) | (uint32_t(qh[1]) << 16);
    for (int t = 0; t < 4; ++t) {
      scale[t] = d * float(b->scales[8 * h + 2 * t + l0 / 16]);
      min[t] = 0.0f;
      const uint32_t lo = t % 2 == 0 ? a : c;
      const int lo_shift = 4 * (t / 2);
      for (int i = 0; i < 4; ++i) {
        const uint32_t v = ((lo >> (8 * i + lo_shift)) & 0xfu) | (((hi >> (8 * i + 2 * t)) & 0x3u) << 4);
        q[t][i] = float(int(v) - 32);
      }
    }
  }
};

// Q2_K and Q3_K: Q6_K's lane mapping. Within half h, weight 128h + 32t + p (p < 32) takes bits 2t,
// 2t+1 of qs[32h + p], so the 4 runs of a slot read the same 4 bytes qs[32h + l0 .. +4), one shift
// per run; run t is sub-block 8h + 2t + l0/16.
template <>
struct GGUFSlice<torch_qmm::gguf::kTypeQ2_K> {
  enum : int { LANES = 16, RUNS = 4, RUN = 4, HAS_MIN = 1, BYTES = sizeof(torch_qmm::gguf::BlockQ2K) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];

  static uint offset(uint slot, int t) { return 128 * (slot / 8) + 32 * t + 4 * (slot % 8); }

  void decode(const device uint8_t* raw, uint slot) {
    const device torch_qmm::gguf::BlockQ2K* b = (const device torch_qmm::gguf::BlockQ2K*)raw;
    const uint h = slot / 8, l0 = 4 * (slot % 8);
    const float d = float(as_type<half>(b->d));
    const float dmin = float(as_type<half>(b->dmin));
    // qs sits at byte 16 of an 84-byte block and l0 % 4 == 0: 4-byte aligned.
    const uint32_t w = *(const device uint32_t*)(b->qs + 32 * h + l0);
    for (int t = 0; t < 4; ++t) {
      const uint sc = b->scales[8 * h + 2 * t + l0 / 16];
      scale[t] = d * float(sc & 0xfu);
      min[t] = dmin * float(sc >> 4);
      for (int i = 0; i < 4; ++i) q[t][i] = float((w >> (8 * i + 2 * t)) & 0x3u);
    }
  }
};

// Q3_K adds each code's third bit: bit 4h + t of hmask[l0 + i] for weight i of run t.
template <>
struct GGUFSlice<torch_qmm::gguf::kTypeQ3_K> {
  enum : int { LANES = 16, RUNS = 4, RUN = 4, HAS_MIN = 0, BYTES = sizeof(torch_qmm::gguf::BlockQ3K) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];  // unused (Q3_K is symmetric around 4)

  static uint offset(uint slot, int t) { return 128 * (slot / 8) + 32 * t + 4 * (slot % 8); }

  void decode(const device uint8_t* raw, uint slot) {
    const device torch_qmm::gguf::BlockQ3K* b = (const device torch_qmm::gguf::BlockQ3K*)raw;
    const uint h = slot / 8, l0 = 4 * (slot % 8);
    const float d = float(as_type<half>(b->d));
    // 110-byte blocks are 2-aligned only: hmask and qs as uint16.
    const device uint16_t* qs = (const device uint16_t*)(b->qs + 32 * h + l0);
    const device uint16_t* hm = (const device uint16_t*)(b->hmask + l0);
    const uint32_t lo = uint32_t(qs[0]) | (uint32_t(qs[1]) << 16);
    const uint32_t hi = uint32_t(hm[0]) | (uint32_t(hm[1]) << 16);
    for (int t = 0; t < 4; ++t) {
      scale[t] = d * float(torch_qmm::gguf::q3k_scale(int(8 * h + 2 * t + l0 / 16), b->scales));
      min[t] = 0.0f;
      for (int i = 0; i < 4; ++i) {
        const uint32_t v = ((lo >> (8 * i + 2 * t)) & 0x3u) | (((hi >> (8 * i + 4 * h + t)) & 0x1u) << 2);
        q[t][i] = float(int(v) - 4);
      }
    }
  }
};

// IQ4_XS: slot s decodes sub-block s whole (layout in metal/gguf_format.h): its 16 bytes
// qs[16s .. +16) as four uint32, each byte's low nibble the code of weight 32s + l, its high nibble
// that of 32s + 16 + l (l = byte index in the sub-block). Run j = 2*nib + u is the nibble nib of
// bytes 8u .. 8u + 8, i.e. weights 32s + 8j .. +8. The codes index kIQ4Values (constant address
// space); a run's weights are scale * value, scale = d * (l_s - 32) (exact in float32: an f16
// times an integer of at most 6 bits).
template <>
struct GGUFSlice<torch_qmm::gguf::kTypeIQ4_XS> {
  enum : int { LANES = 8, RUNS = 4, RUN = 8, HAS_MIN = 0, BYTES = sizeof(torch_qmm::gguf::BlockIQ4XS) };

  float q[RUNS][RUN];
  float scale[RUNS];
  float min[RUNS];  // unused (no offset: the values are signed)

  static uint offset(uint slot, int j) { return 32 * slot + 8 * uint(j); }

  void decode(const device uint8_t* raw, uint slot) {
    const device torch_qmm::gguf::BlockIQ4XS* b = (const device torch_qmm::gguf::BlockIQ4XS*)raw;
    const float s = float(as_type<half>(b->d)) *
                    float(torch_qmm::gguf::iq4xs_scale(int(slot), b->scales_l, uint(b->scales_h)));
    // qs sits at byte 8 of a 136-byte block and 16s % 4 == 0: 4-byte aligned.
    const device uint32_t* w = (const device uint32_t*)(b->qs + 16 * slot);
    for (int u = 0; u < 2; ++u) {
      const uint32_t w0 = w[2 * u], w1 = w[2 * u + 1];
      for (int nib = 0; nib < 2; ++nib) {
        const int j = 2 * nib + u;
        scale[j] = s;
        min[j] = 0.0f;
        for (int i = 0; i < 4; ++i) {
          q[j][i] = float(torch_qmm::gguf::kIQ4Values[(w0 >> (8 * i + 4 * nib)) & 0xfu]);
          q[j][i + 4] = float(torch_qmm::gguf::kIQ4Values[(w1 >> (8 * i + 4 * nib)) & 0xfu]);
        }
      }
    }
  }
};

// scale * dot - min * xsum for run j of a decoded slice (dot = sum q*x, xsum = sum x over the
// run's x values xv). Where that is not finite (Inf/NaN in x or a scale, or an overflow), the
// factored form need not give what IEEE arithmetic on the decoded weights gives (F.linear's: +Inf
// in x against weights of both signs is NaN): then the run's weights one by one.
template <typename Slice>
inline float run_dot(const thread Slice& s, int j, float dot, float xsum, const thread float* xv) {
  const float factored = Slice::HAS_MIN ? s.scale[j] * dot - s.min[j] * xsum : s.scale[j] * dot;
  if (isfinite(factored)) return factored;
  float acc = 0.0f;
  for (int i = 0; i < Slice::RUN; ++i)
    acc += (Slice::HAS_MIN ? s.scale[j] * s.q[j][i] - s.min[j] : s.scale[j] * s.q[j][i]) * xv[i];
  return acc;
}

// ---- The kernel body ---------------------------------------------------------------------------
// R rows of x per threadgroup (R = 1: the M = 1 matvec). For R = 1 the lane's x values are loaded
// once per super-block and reused for the SIMD-group's 4 rows of W; for R > 1 each decoded slice
// is reused for the R rows of x (x is re-read per W row, from cache).
template <typename T, int type, int R>
inline void gguf_qmm_impl(const device uint8_t* blocks, const device T* x, device T* y, constant GGUFParams& p,
                          uint2 tg, uint simd_gid, uint lane) {
  using Slice = GGUFSlice<type>;
  constexpr int ROWS = GGUF_ROWS_PER_SIMDGROUP;
  constexpr int TEAMS = SIMD_WIDTH / Slice::LANES;  // super-blocks in flight per SIMD-group
  const uint M = p.M, N = p.N, K = p.K, nb = p.blocks_per_row;
  const uint row_bytes = nb * Slice::BYTES;
  const uint slot = lane % Slice::LANES;
  const uint n0 = tg.x * GGUF_COLS_PER_TG + simd_gid * ROWS;
  const uint m0 = tg.y * R;

  uint off[Slice::RUNS];
  for (int j = 0; j < Slice::RUNS; ++j) off[j] = Slice::offset(slot, j);

  float acc[R][ROWS];
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;

  for (uint ib = lane / Slice::LANES; ib < nb; ib += TEAMS) {
    const device T* xb = x + m0 * K + ib * torch_qmm::gguf::kQK_K;
    if (R == 1) {
      float xv[Slice::RUNS][Slice::RUN];
      float xsum[Slice::RUNS];
      for (int j = 0; j < Slice::RUNS; ++j) {
        xsum[j] = 0.0f;
        for (int i = 0; i < Slice::RUN; ++i) {
          xv[j][i] = float(xb[off[j] + i]);
          xsum[j] += xv[j][i];
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        if (n0 + r >= N) break;
        Slice s;
        s.decode(blocks + (n0 + r) * row_bytes + ib * Slice::BYTES, slot);
        for (int j = 0; j < Slice::RUNS; ++j) {
          float dot = 0.0f;
          for (int i = 0; i < Slice::RUN; ++i) dot += s.q[j][i] * xv[j][i];
          acc[0][r] += run_dot(s, j, dot, xsum[j], xv[j]);
        }
      }
    } else {
      for (int r = 0; r < ROWS; ++r) {
        if (n0 + r >= N) break;
        Slice s;
        s.decode(blocks + (n0 + r) * row_bytes + ib * Slice::BYTES, slot);
        for (int m = 0; m < R; ++m) {
          if (m0 + m >= M) break;
          const device T* xr = xb + m * K;
          for (int j = 0; j < Slice::RUNS; ++j) {
            float dot = 0.0f, xsum = 0.0f, xv[Slice::RUN];
            for (int i = 0; i < Slice::RUN; ++i) {
              xv[i] = float(xr[off[j] + i]);
              dot += s.q[j][i] * xv[i];
              xsum += xv[i];
            }
            acc[m][r] += run_dot(s, j, dot, xsum, xv);
          }
        }
      }
    }
  }
  // Every lane reaches the reductions (rows past M or N reduce zeros and are not written).
  for (int m = 0; m < R; ++m) {
    for (int r = 0; r < ROWS; ++r) {
      const float sum = simd_sum(acc[m][r]);
      if (lane == 0 && m0 + m < M && n0 + r < N) y[(m0 + m) * N + n0 + r] = static_cast<T>(sum);
    }
  }
}

// M = 1 (decode): gguf_qmv_{dtype}_{type}.
template <typename T, int type>
[[kernel]] void gguf_qmv(GGUF_QMM_ARGS) {
  gguf_qmm_impl<T, type, 1>(blocks, x, y, p, tgid.xy, simd_gid, lane);
}

// Small M (up to 16: the grid's y dimension covers M in R-row blocks): gguf_qmm_bm{R}_{dtype}_{type}.
// Larger M: gguf_qmm_mma32_{dtype}_{type} (metal/gguf_mma.h).
template <typename T, int type, int R>
[[kernel]] void gguf_qmm_small(GGUF_QMM_ARGS) {
  gguf_qmm_impl<T, type, R>(blocks, x, y, p, tgid.xy, simd_gid, lane);
}
