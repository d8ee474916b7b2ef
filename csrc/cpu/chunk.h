// The AVX-512 multipliers of the chunk kernels for transpose=True, small M (the driver is
// chunk_driver.h; qmm_chunked.cpp and gguf_chunked.cpp define the kernels that use these). A
// load of a packed row is one *chunk*: 64 bytes (512/BITS codes) for bits 2/4/8, one 32-code
// block (4*BITS bytes, masked load) for the bit streams of bits 3/5/6; x is rearranged once per
// call so that every code meets its x in-lane, with no shuffle of W. Two multipliers:
//
// Bf16Multiplier (AVX512_BF16: vdpbf16ps, 32 products per instruction summed in float32). The
// chunk is 32 u16 words, each cut into *planes* of F = 4 bits (2 for BITS=2): plane j holds bits
// [F*j, F*j + F) of every word. One vpermw per plane maps each word's low 5 bits, after an F*j
// shift, through a 32-entry table to the bfloat16 of the field (exact: <= 4 significant bits):
//   4-bit: plane j (0..3), u16 lane i = q[4i + j]
//   8-bit: planes 2h, 2h+1 = low / high nibble of q[2i + h]  (x of the high one times 16)
//   2-bit: plane j (0..7), u16 lane i = q[8i + j]
//   3/5/6-bit: one plane, u16 lane i = q[i]: vpermb gathers the two bytes under code i, vpsrlvw
//   shifts it down, vpermw (vpermi2w: 64 entries for 6 bits) maps it to bfloat16
// and float32 lane l sums u16 lanes 2l, 2l+1 (codes of one group).
// Each row of x enters as P bfloat16 terms laid out the same way (xb[c][plane][t][32]). Each
// product field * term is exact in float32, and P = 3 / 2 / 1 terms hold float32 / float16 /
// bfloat16 x exactly: the result is a float32 sum of the exact products q * x. For float32 x,
// torch.set_float32_matmul_precision("high" / "medium") allows P = 2 / 1 (x kept to ~16 / 8
// significant bits, relative error <= 2^-16 / 2^-8 per element): the trade PyTorch makes for
// its own float32 matmuls at those settings (QmmArgs::x_bf16_terms).
// A W chunk is decoded once for all the x rows of a tile.
//
// F32Multiplier<BITS> (bits 4 and 8; AVX-512 F). The chunk is 16 dwords of 32/BITS fields:
//   vector j, lane l:  w & (2^BITS - 1 << BITS*j)  =  q[(32/BITS) l + j] * 2^(BITS j)   (no shift)
//   converted unsigned (exact: <= 8 significant bits), times xw[c][j][l] = x[...] * 2^-(BITS j)
// so every 16 codes cost one and, one convert and one FMA per x row (the and and the convert
// shared by the tile's x rows); the powers of two cancel exactly (for |x| >= 2^-98), so each FMA
// adds q * x, rounded once as an FMA does. Where it goes before the bfloat16 products:
// qmm_chunked.cpp.
// Both leave lane l with codes of one group, so the scale is a per-lane vector (chunk_lanes)
// applied once per chunk, and the bias is hoisted out of the chunk loop (qmm_chunked.cpp):
//   y[m, n] = sum_c hsum(s_c * p_c) + sum_g b[g] * xsum[m, g]     (xsum = sum of x over a group)
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)

#include <immintrin.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "chunk_driver.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {
namespace chunk {

// Bits 2/4/8: a chunk is 64 bytes of whole u16 words. Bits 3/5/6 (a bit stream): one block of
// 32 codes, 4*BITS bytes.
template <int BITS>
constexpr bool kStream = BITS == 3 || BITS == 5 || BITS == 6;
// The bit-stream decode gathers bytes with vpermb (AVX512_VBMI): without it (e.g. Cooper Lake,
// which has AVX512_BF16) bits 3/5/6 keep the fused kernels.
#if defined(__AVX512VBMI__)
constexpr bool kHaveStreamChunks = true;
#else
constexpr bool kHaveStreamChunks = false;
#endif

// Prefetch into L2 the line at base + offset (integer arithmetic: the address may lie past the
// end of the buffer, where prefetches do not fault but pointer arithmetic would be undefined).
__attribute__((always_inline)) inline void prefetch_l2(const void* base, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(offset)), _MM_HINT_T1);
}
template <int BITS>
constexpr int kCodesPerChunk = kStream<BITS> ? 32 : 512 / BITS;
template <int BITS>
constexpr int kChunkBytes = kCodesPerChunk<BITS> * BITS / 8;

// A chunk of a packed row into a register (bit streams: a masked load, never past the block).
template <int BITS>
__attribute__((always_inline)) inline __m512i load_chunk(const uint8_t* p) {
  if constexpr (kChunkBytes<BITS> == 64)
    return _mm512_loadu_si512(p);
  else
    return _mm512_maskz_loadu_epi8(__mmask64((1ull << kChunkBytes<BITS>) - 1), p);
}

// Keeps v in a register (the empty asm reads and writes it there). Where several W rows meet one
// loaded vector of x, GCC folds that load into each row's FMA instead, which doubles the loads at
// two W rows: on Zen 4 (one thread, W in L3, Q4_K, four rows of x) 23.0 cycles per W row, x row
// and super-block with the loads folded, 21.0 with x held.
template <typename V>
__attribute__((always_inline)) inline void in_register(V& v) {
  asm("" : "+v"(v));
}

// f(integral_constant<int, J>) for J in the sequence, unrolled.
template <typename F, int... J>
__attribute__((always_inline)) inline void for_each_index(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}

// Per-lane scales of a chunk: lane l gets float(s[(32/BITS) * l / G]), s pointing at the group
// of the chunk's first code. Reads exactly the groups the chunk touches (one if G > its codes).
template <typename T, int G, int BITS>
inline __m512 chunk_lanes(const T* s) {
  constexpr int kCodes = kCodesPerChunk<BITS>, kGroups = kCodes >= G ? kCodes / G : 1;
  constexpr __mmask16 kMask = __mmask16((1u << kGroups) - 1);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // One vpermw: the scale's bfloat16 bits into the high half of each float32 lane, the low
    // half zeroed (word 2l + 1 <- word group(l)).
    alignas(64) static constexpr auto words = [] {
      struct { int16_t i[32]; } t{};
      for (int l = 0; l < 16; ++l) t.i[2 * l + 1] = int16_t(kGroups == 1 ? 0 : (32 / BITS) * l / G);
      return t;
    }();
    const __m512i h = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(kMask, s));
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(__mmask32(0xAAAAAAAAu), _mm512_load_si512(words.i), h));
  }
  __m512 v;
  if constexpr (std::is_same_v<T, float>)
    v = _mm512_maskz_loadu_ps(kMask, s);
  else
    v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(kMask, s));
  if constexpr (kGroups == 1) return _mm512_permutexvar_ps(_mm512_setzero_si512(), v);
  alignas(64) static constexpr auto idx = [] {
    struct { int32_t i[16]; } t{};
    for (int l = 0; l < 16; ++l) t.i[l] = (32 / BITS) * l / G;
    return t;
  }();
  return _mm512_permutexvar_ps(_mm512_load_si512(idx.i), v);
}

// The next tile's scales and biases (rows [n+R, n+2R)) of groups [g0, g1): 2*R more streams
// than the hardware prefetcher follows well.
template <typename T, int R>
inline void prefetch_params(const QmmArgs& a, int64_t n, int64_t groups, int64_t g0, int64_t g1) {
  for (int r = 0; r < R; ++r) {
    const int64_t first = ((n + R + r) * groups + g0) * int64_t(sizeof(T));  // byte offsets
    const int64_t last = ((n + R + r) * groups + g1) * int64_t(sizeof(T));
    for (int64_t off = first & ~int64_t(63); off < last; off += 64) {
      prefetch_l2(a.scales, off);
      prefetch_l2(a.biases, off);
    }
  }
}

// How the codes of one chunk meet x, for R rows of W and MB rows of x at once:
// p[r][m] += (q of W row r) * (x row m), lane l holding the products of codes (32/BITS) * l ..
// + 32/BITS - 1, all in one group (chunk_lanes). Always inlined: a call would send w and p through
// memory.
template <int BITS>
struct F32Multiplier {
  static_assert(BITS == 4 || BITS == 8, "float32 chunks: bits 4 and 8");
  static constexpr const char* kName = "f32";
  static constexpr int kBits = BITS;
  static constexpr int kMaxXBlock = 4;
  using X = float;
  static constexpr int kVectors = 32 / BITS;                   // fields per dword
  static constexpr int64_t kXPerChunk = 16 * kVectors;         // xw floats per chunk per x row
  // Code (within the chunk) that vector j, lane l holds, and the factor on its x.
  static constexpr int code(int j, int l) { return kVectors * l + j; }
  static constexpr float x_factor(int j) { return 1.0f / float(uint64_t(1) << (BITS * j)); }
  // Field j of every dword as float32, q * 2^(BITS j). 4-bit field 0 sits in the index bits of
  // vpermps: one table lookup (float(i) at entry i) instead of an and and a convert.
  template <int J>
  __attribute__((always_inline)) static inline __m512 field(__m512i w, __m512i mask) {
    if constexpr (BITS == 4 && J == 0)
      return _mm512_permutexvar_ps(w, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_cvtepu32_ps(_mm512_and_si512(w, mask));
  }
  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const __m512i (&w)[R], const float* const (&xc)[MB],
                                                        __m512 (&p)[R][MB]) {
    // One chain per (r, m): kVectors FMAs per chunk at 4 cycles each hide under the other rows'
    // work. A field masked in place is q * 2^(BITS j), converted unsigned (exact: <= 8
    // significant bits).
    auto step = [&](auto jc) __attribute__((always_inline)) {
      constexpr int j = decltype(jc)::value;
      const __m512i mask = _mm512_set1_epi32(int(((1u << BITS) - 1) << (BITS * j)));
      __m512 xj[MB];
      for (int m = 0; m < MB; ++m) {
        xj[m] = _mm512_loadu_ps(xc[m] + 16 * j);
        // Held for 8-bit codes (Zen 4, one thread, W in L3, cycles per 256 weights and x row at
        // M = 1, 2, 4, 8: 52.7, 34.2, 26.4, 25.9 -> 40.8, 30.0, 24.5, 24.4); 4-bit codes lose
        // with it (M = 2: 25.0 -> 28.4) and keep the folded loads.
        if constexpr (BITS == 8 && R > 1) in_register(xj[m]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 q = field<j>(w[r], mask);
        for (int m = 0; m < MB; ++m) p[r][m] = _mm512_fmadd_ps(q, xj[m], p[r][m]);
      }
    };
    for_each_index(step, std::make_integer_sequence<int, kVectors>{});
  }
};

#if defined(__AVX512BF16__)
// bfloat16 of a small integer v (exact below 256): exponent + 7 bits of significand.
constexpr uint16_t bf16_of(int v) {
  int exp = 0;
  while ((2 << exp) <= v) ++exp;
  return v == 0 ? 0 : uint16_t(((127 + exp) << 7) | (((v << 7) >> exp) & 0x7F));
}

// Plane geometry of BITS. Bits 2/4/8: F-bit fields, 16 / F planes per u16 word, each decoded by a
// shift and a vpermw. Bits 3/5/6: one plane, u16 lane i = code i of the 32-code block, decoded
// by a vpermb (the two bytes holding the code), a per-lane shift (vpsrlvw) and a vpermw (vpermi2w
// for 6 bits: 64 entries).
template <int BITS>
struct Planes {
  static_assert(BITS >= 2 && BITS <= 8 && BITS != 7, "bfloat16 chunks: bits 2, 3, 4, 5, 6, 8");
  static constexpr int kFieldBits = kStream<BITS> ? BITS : BITS == 2 ? 2 : 4;
  static constexpr int kCount = kStream<BITS> ? 1 : 16 / kFieldBits;
  // Code (within the chunk) of plane j, u16 lane i, and the power of two its x is scaled by.
  static constexpr int code(int j, int i) { return kStream<BITS> ? i : (16 / BITS) * i + kFieldBits * j / BITS; }
  static constexpr int x_shift(int j) { return kStream<BITS> ? 0 : kFieldBits * j % BITS; }
  // u16 entry e = bfloat16 of (e mod 2^F); 64 entries (vpermi2w) for 6-bit fields, else the low
  // 32 (vpermw indexes by 5 bits, so fields narrower than 5 bits repeat).
  struct Table { alignas(64) uint16_t e[64]; };
  static constexpr Table table() {
    Table t{};
    for (int e = 0; e < 64; ++e) t.e[e] = bf16_of(e & ((1 << kFieldBits) - 1));
    return t;
  }
  // Bit streams: the bytes under u16 lane i (vpermb indices) and its shift (vpsrlvw).
  struct StreamIdx {
    alignas(64) uint8_t bytes[64];
    alignas(64) uint16_t shift[32];
  };
  static constexpr StreamIdx stream_idx() {
    StreamIdx t{};
    for (int i = 0; i < 32; ++i) {
      t.bytes[2 * i] = uint8_t(BITS * i / 8);
      t.bytes[2 * i + 1] = uint8_t(BITS * i / 8 + 1);  // past the block only for codes that end in the first byte
      t.shift[i] = uint16_t(BITS * i % 8);
    }
    return t;
  }

  // Plane j of the chunk w as bfloat16.
  template <int J>
  __attribute__((always_inline)) static inline __m512i decode(__m512i w) {
    alignas(64) static constexpr Table kTable = table();
    if constexpr (kStream<BITS>) {
#if defined(__AVX512VBMI__)
      alignas(64) static constexpr StreamIdx kIdx = stream_idx();
      const __m512i words = _mm512_srlv_epi16(_mm512_permutexvar_epi8(_mm512_load_si512(kIdx.bytes), w),
                                              _mm512_load_si512(kIdx.shift));
      if constexpr (BITS == 6)
        return _mm512_permutex2var_epi16(_mm512_load_si512(kTable.e), words, _mm512_load_si512(kTable.e + 32));
      else
        return _mm512_permutexvar_epi16(words, _mm512_load_si512(kTable.e));
#else
      static_assert(!kStream<BITS>, "bit-stream chunks need AVX512_VBMI (kHaveStreamChunks)");
      return w;
#endif
    } else {
      return _mm512_permutexvar_epi16(J == 0 ? w : _mm512_srli_epi16(w, kFieldBits * J), _mm512_load_si512(kTable.e));
    }
  }
};

template <int P, int BITS>
struct Bf16Multiplier {
  static constexpr const char* kName = P == 1 ? "bf16x1" : P == 2 ? "bf16x2" : "bf16x3";
  static constexpr int kBits = BITS;
  static constexpr int kMaxXBlock = 4;
  using X = uint16_t;
  using Geometry = Planes<BITS>;
  static constexpr int64_t kXPerChunk = 32 * Geometry::kCount * P;  // bfloat16 terms per chunk per x row
  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const __m512i (&w)[R], const uint16_t* const (&xc)[MB],
                                                        __m512 (&p)[R][MB]) {
    // vdpbf16ps has ~6 cycles of latency: below 8 independent (r, m) chains, alternate two
    // accumulators per chain.
    constexpr bool kTwoChains = R * MB < 8;
    __m512 q[R][MB];
    if constexpr (kTwoChains)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) q[r][m] = _mm512_setzero_ps();
    auto step = [&](auto jc) __attribute__((always_inline)) {
      constexpr int j = decltype(jc)::value;
      __m512i v[R];
      for (int r = 0; r < R; ++r) v[r] = Geometry::template decode<j>(w[r]);
      for (int t = 0; t < P; ++t)
        for (int m = 0; m < MB; ++m) {
          const __m512i xv = _mm512_loadu_si512(xc[m] + (j * P + t) * 32);
          for (int r = 0; r < R; ++r) {
            __m512& chain = kTwoChains && (j * P + t) % 2 ? q[r][m] : p[r][m];
            chain = _mm512_dpbf16_ps(chain, (__m512bh)v[r], (__m512bh)xv);
          }
        }
    };
    for_each_index(step, std::make_integer_sequence<int, Geometry::kCount>{});
    if constexpr (kTwoChains)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) p[r][m] = _mm512_add_ps(p[r][m], q[r][m]);
  }
};
#endif

}  // namespace chunk
}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX-512
