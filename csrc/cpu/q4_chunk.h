// The 128-code chunk kernels for 4-bit, transpose=True, small M (qmm_q4_chunked.cpp drives
// them). A 64-byte load of a packed row is one *chunk* of 128 codes; x is rearranged once per
// call so that every code meets its x in-lane, with no shuffle of W. Two ways to multiply a chunk:
//
// bfloat16 (AVX512_BF16: vdpbf16ps, 32 products per instruction summed in float32). The chunk is
// 32 u16 words of 4 nibbles; for nibble j (0..3) one vpermw maps each word's low 5 bits through
// a 32-entry table to the bfloat16 of q (exact: 4 significant bits), after a 4j shift:
//   vector j, u16 lane i = bf16(q[128c + 4i + j]);  float32 lane l sums u16 lanes 2l, 2l+1,
//   i.e. codes 8l .. 8l+7
// and each row of x enters as P bfloat16 terms (xb[c][j][t], u16 lane i = term t of
// x[128c + 4i + j]). Each product q * term is exact in float32, and P = 3 / 2 / 1 terms hold
// float32 / float16 / bfloat16 x exactly: the result is a float32 sum of the exact products
// q * x. For float32 x, torch.set_float32_matmul_precision("high" / "medium") allows P = 2 / 1
// (x kept to ~16 / 8 significant bits, relative error <= 2^-16 / 2^-8 per element): the trade
// PyTorch makes for its own float32 matmuls at those settings (QmmArgs::x_bf16_terms).
// A W chunk is decoded once for all the x rows of a tile.
//
// float32 (AVX-512 without BF16; M = 1 only). The chunk is 16 dwords of 8 nibbles:
//   vector j (0..7), lane l:  w & (15 << 4j)  =  q[128c + 8l + j] * 16^j     (no shift)
//   converted unsigned (exact: 4 significant bits), times xw[c][j][l] = x[128c + 8l + j] * 2^-4j
// so every 16 codes cost one and, one convert and one FMA; scaling x by a power of two makes
// each product exactly q * x (for |x| >= 2^-98).
//
// Both leave lane l with codes 8l .. 8l+7, in group 8l / group_size, so the scale is a per-lane
// vector (one broadcast + one in-lane byte shuffle) applied once per chunk, and the bias is
// hoisted out of the chunk loop (qmm_q4_chunked.cpp):
//   y[m, n] = sum_c hsum(s_c * p_c) + sum_g b[g] * xsum[m, g]     (xsum = sum of x over a group)
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {
namespace q4chunk {

// Per-lane scales of chunk c: lane l gets float(s[(8l) / G]), s pointing at the chunk's first
// group. Reads exactly the 128/G values of the chunk.
template <typename T, int G>
inline __m512 chunk_lanes(const T* s) {
  constexpr int E = 128 / G;  // groups per chunk: 4, 2, 1
  constexpr int kBytes = E * int(sizeof(T));
  // Broadcast the chunk's values to every 128-bit lane (vpshufb indexes within one).
  __m512i v;
  if constexpr (kBytes == 16) {
    v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  } else if constexpr (kBytes == 8) {  // float broadcasts load straight from memory (no GPR hop)
    double d;
    std::memcpy(&d, s, 8);
    v = _mm512_castpd_si512(_mm512_set1_pd(d));
  } else if constexpr (kBytes == 4) {
    float f;
    std::memcpy(&f, s, 4);
    v = _mm512_castps_si512(_mm512_set1_ps(f));
  } else {
    uint16_t h;
    std::memcpy(&h, s, 2);
    v = _mm512_set1_epi32(h);
  }
  alignas(64) static constexpr auto ctl = [] {
    struct { int8_t b[64]; } t{};
    for (int l = 0; l < 16; ++l) {
      const int g = 8 * l / G;  // group of lane l within the chunk
      for (int i = 0; i < 4; ++i) {
        int8_t src;
        if constexpr (sizeof(T) == 4) src = int8_t(4 * g + i);
        else if constexpr (std::is_same_v<T, c10::BFloat16>) src = i < 2 ? -1 : int8_t(2 * g + i - 2);  // bits << 16
        else src = i < 2 ? int8_t(2 * g + i) : -1;  // half: low 16 bits, converted below
        t.b[4 * l + i] = src;
      }
    }
    return t;
  }();
    const __m512i d = _mm512_shuffle_epi8(v, _mm512_load_si512(ctl.b));
    if constexpr (std::is_same_v<T, c10::Half>)
      return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
    else
      return _mm512_castsi512_ps(d);
}

// The next tile's scales and biases (rows [n+R, n+2R)): 2*R more streams than the hardware
// prefetcher follows well (float32 scales: ~10-15% faster with this, 2 threads).
template <typename T, int R>
inline void prefetch_params(const QmmArgs& a, int64_t n, int64_t groups) {
  const T* scale = static_cast<const T*>(a.scales) + (n + R) * groups;
  const T* bias = static_cast<const T*>(a.biases) + (n + R) * groups;
  for (int64_t off = 0; off < R * groups * int64_t(sizeof(T)); off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(scale) + off, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(bias) + off, _MM_HINT_T1);
  }
}

// How the codes of one chunk meet x, for R rows of W and MB rows of x at once:
// p[r][m] += (q of W row r) * (x row m), lane l holding the products of codes 8l .. 8l+7 (so
// chunk_lanes applies to either). Always inlined: a call would send w and p through memory
// (GCC did not inline it: ~50% slower).
struct F32Chunk {
  using X = float;
  static constexpr int64_t kXPerChunk = 128;  // xw floats per chunk per x row
  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const __m512i (&w)[R], const float* const (&xc)[MB],
                                                        __m512 (&p)[R][MB]) {
    // One chain per (r, m): 8 FMAs per chunk at 4 cycles each hide under the other rows' work.
    auto step = [&](auto jc) {
      constexpr int j = decltype(jc)::value;
      const __m512i mask = _mm512_set1_epi32(int(15u << (4 * j)));
      __m512 xj[MB];
      for (int m = 0; m < MB; ++m) xj[m] = _mm512_loadu_ps(xc[m] + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 q = _mm512_cvtepu32_ps(_mm512_and_si512(w[r], mask));
        for (int m = 0; m < MB; ++m) p[r][m] = _mm512_fmadd_ps(q, xj[m], p[r][m]);
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    step(std::integral_constant<int, 4>{});
    step(std::integral_constant<int, 5>{});
    step(std::integral_constant<int, 6>{});
    step(std::integral_constant<int, 7>{});
  }
};

#if defined(__AVX512BF16__)
// u16 entry e = bfloat16 bits of float(e & 15): vpermw indexes by the low 5 bits.
alignas(64) constexpr uint16_t kCodeToBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

template <int P>
struct Bf16Chunk {
  using X = uint16_t;
  static constexpr int64_t kXPerChunk = 128 * P;  // bfloat16 terms per chunk per x row
  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const __m512i (&w)[R], const uint16_t* const (&xc)[MB],
                                                        __m512 (&p)[R][MB]) {
    const __m512i table = _mm512_load_si512(kCodeToBf16);
    // vdpbf16ps has ~6 cycles of latency: below 8 independent (r, m) chains, alternate two
    // accumulators per chain.
    constexpr bool kTwoChains = R * MB < 8;
    __m512 q[R][MB];
    if constexpr (kTwoChains)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) q[r][m] = _mm512_setzero_ps();
    auto step = [&](auto jc) {
      constexpr int j = decltype(jc)::value;
      __m512i v[R];
      for (int r = 0; r < R; ++r)
        v[r] = _mm512_permutexvar_epi16(j == 0 ? w[r] : _mm512_srli_epi16(w[r], 4 * j), table);
      for (int t = 0; t < P; ++t)
        for (int m = 0; m < MB; ++m) {
          const __m512i xv = _mm512_loadu_si512(xc[m] + (j * P + t) * 32);
          for (int r = 0; r < R; ++r) {
            __m512& chain = kTwoChains && (j * P + t) % 2 ? q[r][m] : p[r][m];
            chain = _mm512_dpbf16_ps(chain, (__m512bh)v[r], (__m512bh)xv);
          }
        }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    if constexpr (kTwoChains)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) p[r][m] = _mm512_add_ps(p[r][m], q[r][m]);
  }
};
#endif

// W rows [n, n+R) times MB rows of x (xr[m]: that row's prepared x, C::kXPerChunk per chunk):
// out[r][m] = sum over whole chunks of s*q*x.
template <typename T, int R, int MB, int G, typename C>
void tile(const QmmArgs& a, int64_t n, const typename C::X* const (&xr)[MB], float (&out)[R][MB]) {
  const int64_t chunks = a.K / 128, row_bytes = a.K / 2, groups = a.K / G;
  const uint8_t* row[R];
  const T* s[R];
  for (int r = 0; r < R; ++r) {
    row[r] = a.wq + (n + r) * row_bytes;
    s[r] = static_cast<const T*>(a.scales) + (n + r) * groups;
  }
  prefetch_params<T, R>(a, n, groups);
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      // The same chunk of the next tile's row r: the rows are contiguous.
      _mm_prefetch(reinterpret_cast<const char*>(row[r] + R * row_bytes + c * 64), _MM_HINT_T1);
      w[r] = _mm512_loadu_si512(row[r] + c * 64);
    }
    __m512 p[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) p[r][m] = _mm512_setzero_ps();
    const typename C::X* xc[MB];
    for (int m = 0; m < MB; ++m) xc[m] = xr[m] + c * C::kXPerChunk;
    C::template dot<R, MB>(w, xc, p);
    for (int r = 0; r < R; ++r) {
      const __m512 sl = chunk_lanes<T, G>(s[r] + c * (128 / G));
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(p[r][m], sl, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

}  // namespace q4chunk
}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX-512
