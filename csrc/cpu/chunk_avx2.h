// The AVX2 multipliers of the chunk kernels (avx2_chunked.cpp; driver: chunk_driver.h), for any
// x86 CPU with AVX2 and FMA. A chunk is one 32-byte load of a packed row, decoded into kVectors
// float vectors of 8 lanes; x is rearranged once per call so that every decoded lane meets its x
// in-lane (lane l of vector j: code code(j, l) of the chunk, times x_factor(j, l)), with no shuffle of
// W across lanes. The partial sums of a chunk are kept in kHalves chains, each multiplied by its
// per-lane scales (scale_lanes) once per chunk.
//
// U4Multiplier (affine 4-bit): the chunk is 8 dwords of 8 nibbles, as F32Multiplier in chunk.h:
//   vector j (0..6), lane l:  w & (15 << 4j)  =  q[8l + j] * 16^j   (no shift; vector 7: w >> 28)
// converted (exact: 4 significant bits, below 2^31), times x[64c + 8l + j] * 2^-4j (exact for
// |x| >= 2^-98: x_in_range), so each FMA adds q * x rounded once. Lane l holds codes 8l .. 8l+7,
// one group: the scales are [s0 x4, s1 x4] for groups of 32, one broadcast for 64 and 128; the
// bias is hoisted (avx2_chunked.cpp).
//
// StreamMultiplier<B> (affine 3, 5 and 6 bits): the row is one little-endian bit stream, so codes
// straddle bytes and dwords. A chunk is kCodes codes (32; 64 for B = 3, so that it spans at least
// 16 bytes), read as two 16-byte windows, each broadcast to both 128-bit lanes: one at the
// chunk's start, one ending at its end. Vector j holds codes 8j .. 8j+7 in order; lane l's code
// starts at bit s = B(8j + l) % 8 of byte B(8j + l) / 8: one vpshufb moves that byte and the next
// into the low half of the lane's dword, one AND keeps the code in place (q * 2^s; s + B <= 13),
// converted exactly, and x is prepared times 2^-s (x_factor(j, l)): each FMA adds q * x rounded
// once, as U4Multiplier's do.
//
// E2m1Multiplier (mxfp4, nvfp4): a chunk is 64 e2m1 codes (byte i: code 2i in the low nibble,
// 2i+1 in the high one). Each nibble goes through two 16-entry vpshufb tables to the high and the
// low byte of the bfloat16 of its value (v in +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}: exact), vpunpck*bw
// interleaves them into u16 words, and a word at the top of a dword (a shift left by 16, or a
// mask of the high word) is the float32 of v: no convert. Vector j of a chunk holds, in lane l,
// code code(j, l); x is laid out to match (xc[c][j][l] = x[64c + code(j, l)]).
// Lanes 0-3 of every vector lie in the chunk's first 32 codes and lanes 4-7 in the last 32; the
// vectors of the two halves h (vpunpcklbw: codes of bytes 0-7 and 16-23; vpunpckhbw: bytes 8-15
// and 24-31) are summed apart, so each half meets one scale per 4 lanes for groups of 16 (half
// h, lanes 0-3: group h; lanes 4-7: group 2 + h) and of 32 (lanes 0-3: group 0; 4-7: group 1):
//   y[m, n] = sum_c hsum(s_c0 * p_c0 + s_c1 * p_c1),    p_ch = sum over half h of v_j * x_j
// Each product v * x is rounded once (an FMA), the sums are float32.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include <cstdint>

namespace torch_qmm {
namespace cpu {
namespace chunk {

// Prefetch into L1 the lines of [base + offset, base + offset + bytes) (integer arithmetic: the
// range may lie past the end of the buffer, where prefetches do not fault but pointer arithmetic
// would be undefined).
__attribute__((always_inline)) inline void prefetch_range(const void* base, int64_t offset, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(offset + b)), _MM_HINT_T0);
}

// The affine multipliers read a chunk of 8 dwords, each of kVectors = 32 / B fields of B bits:
// field j (all but the top one) masked in place is the code times 2^Bj, the top one is shifted
// down. Lane l of vector j holds code kVectors * l + j.
template <int B>
struct DwordFieldMultiplier {
  static constexpr int kBits = B, kVectors = 32 / B, kCodes = 8 * kVectors, kBytes = 32, kHalves = 2;
  static constexpr bool kNanCodes = false, kAffine = true;
  static constexpr int64_t kXPerChunk = kCodes;
  static constexpr float kUnit = 1.0f;
  static constexpr int code(int j, int l) { return kVectors * l + j; }
  static constexpr float x_factor(int j, int /*lane*/) { return j == kVectors - 1 ? 1.0f : 1.0f / float(1 << (B * j)); }
  // Whether the two chains meet the same scales (scale_lanes: sv[0] == sv[1]) for groups of G.
  template <int G>
  static constexpr bool halves_share_scales() { return true; }

  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const uint8_t* const (&w)[R], const float* const (&xc)[MB],
                                                        __m256 (&p)[R][MB][kHalves]) {
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r]));
      for (int j = 0; j < kVectors; ++j) {
        const __m256i q = j == kVectors - 1 ? _mm256_srli_epi32(wv, 32 - B)
                                            : _mm256_and_si256(wv, _mm256_set1_epi32(((1 << B) - 1) << (B * j)));
        const __m256 v = _mm256_cvtepi32_ps(q);
        for (int m = 0; m < MB; ++m) p[r][m][j % 2] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xc[m] + 8 * j), p[r][m][j % 2]);
      }
    }
  }
};

struct U4Multiplier : DwordFieldMultiplier<4> {
  static constexpr const char* kName = "avx2-u4";

  // The scales of the chunk's lanes; scale(i): the value of its i-th group (of 64 / G; one if
  // G >= 64).
  template <int G, typename Scale>
  __attribute__((always_inline)) static inline void scale_lanes(Scale scale, __m256 (&sv)[kHalves]) {
    static_assert(G == 32 || G == 64 || G == 128, "affine groups of 32, 64 or 128");
    if constexpr (G == 32)
      sv[0] = sv[1] = _mm256_set_m128(_mm_set1_ps(scale(1)), _mm_set1_ps(scale(0)));
    else
      sv[0] = sv[1] = _mm256_set1_ps(scale(0));
  }
};

// U8Multiplier (affine 8-bit): the same on byte fields:
//   vector j (0..2), lane l:  w & (255 << 8j)  =  q[4l + j] * 256^j   (vector 3: w >> 24)
// converted (exact: 8 significant bits, below 2^31), times x[32c + 4l + j] * 2^-8j (exact for
// |x| >= 2^-98). A chunk is 32 codes, inside one group of 32, 64 or 128: one scale broadcast.
struct U8Multiplier : DwordFieldMultiplier<8> {
  static constexpr const char* kName = "avx2-u8";

  template <int G, typename Scale>
  __attribute__((always_inline)) static inline void scale_lanes(Scale scale, __m256 (&sv)[kHalves]) {
    static_assert(G == 32 || G == 64 || G == 128, "affine groups of 32, 64 or 128");
    sv[0] = sv[1] = _mm256_set1_ps(scale(0));
  }
};

template <int B>
struct StreamMultiplier {
  static_assert(B == 3 || B == 5 || B == 6, "bit streams of 3, 5 or 6 bits");
  static constexpr const char* kName = B == 3 ? "avx2-u3" : B == 5 ? "avx2-u5" : "avx2-u6";
  static constexpr int kBits = B, kCodes = B == 3 ? 64 : 32, kBytes = kCodes * B / 8, kVectors = kCodes / 8;
  static constexpr int kHalves = 2;
  static constexpr bool kNanCodes = false, kAffine = true;
  static constexpr int64_t kXPerChunk = kCodes;
  static constexpr float kUnit = 1.0f;
  static constexpr int code(int j, int l) { return 8 * j + l; }
  static constexpr int shift(int j, int l) { return B * code(j, l) % 8; }
  static constexpr float x_factor(int j, int l) { return 1.0f / float(1 << shift(j, l)); }
  // Vector j's B bytes (B * j ..) lie in window 0 (bytes 0-15) or else in window 1 (the last 16).
  static constexpr int window(int j) { return B * j + B <= 16 ? 0 : 1; }
  static constexpr int window_start(int j) { return window(j) == 0 ? 0 : kBytes - 16; }
  // Chains: at 64 codes (B = 3) vectors 0-3 and 4-7 are the chunk's two groups of 32.
  static constexpr int chain(int j) { return kVectors == 8 ? j / 4 : j % 2; }
  template <int G>
  static constexpr bool halves_share_scales() { return kCodes <= G; }

  template <int G, typename Scale>
  __attribute__((always_inline)) static inline void scale_lanes(Scale scale, __m256 (&sv)[kHalves]) {
    static_assert(G == 32 || G == 64 || G == 128, "affine groups of 32, 64 or 128");
    if constexpr (kCodes > G) {
      sv[0] = _mm256_set1_ps(scale(0));
      sv[1] = _mm256_set1_ps(scale(1));
    } else {
      sv[0] = sv[1] = _mm256_set1_ps(scale(0));
    }
  }

  // Per vector: the vpshufb index that brings each lane's two bytes into its dword (0x80: zero),
  // and the mask of the lane's code in place.
  struct Tables {
    alignas(32) uint8_t index[kVectors][32];
    alignas(32) uint32_t mask[kVectors][8];
  };
  static constexpr Tables tables() {
    Tables t{};
    for (int j = 0; j < kVectors; ++j)
      for (int l = 0; l < 8; ++l) {
        const int bit = B * code(j, l), byte = bit / 8 - window_start(j), s = bit % 8;
        // (lanes 4-7 index the high 128 bits, which hold the same window)
        uint8_t* d = t.index[j] + 4 * l;
        d[0] = uint8_t(byte);
        d[1] = s + B > 8 ? uint8_t(byte + 1) : uint8_t(0x80);
        d[2] = d[3] = 0x80;
        t.mask[j][l] = uint32_t((1u << B) - 1) << s;
      }
    return t;
  }
  static constexpr Tables kTables = tables();

  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const uint8_t* const (&w)[R], const float* const (&xc)[MB],
                                                        __m256 (&p)[R][MB][kHalves]) {
    for (int r = 0; r < R; ++r) {
      const __m256i win[2] = {
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r]))),
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + kBytes - 16)))};
      for (int j = 0; j < kVectors; ++j) {
        const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTables.index[j]));
        const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTables.mask[j]));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_shuffle_epi8(win[window(j)], idx), mask));
        for (int m = 0; m < MB; ++m)
          p[r][m][chain(j)] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xc[m] + 8 * j), p[r][m][chain(j)]);
      }
    }
  }
};

struct E2m1Multiplier {
  static constexpr const char* kName = "avx2-e2m1";
  static constexpr int kBits = 4, kCodes = 64, kBytes = 32;
  static constexpr bool kNanCodes = false, kAffine = false;
  static constexpr int64_t kXPerChunk = 64;  // floats per chunk per x row

  // The code (0..63) in vector j (0..7), lane l (0..7) of a decoded chunk: nibble j / 4 (low,
  // high) of byte b, half (j / 2) % 2, word 2l + j % 2 of the interleaved bytes.
  static constexpr int code(int j, int l) {
    const int nib = j / 4, half = (j / 2) % 2, word = 2 * l + j % 2;
    const int byte = 16 * (word / 8) + 8 * half + word % 8;
    return 2 * byte + nib;
  }
  static constexpr int half(int j) { return (j / 2) % 2; }
  static constexpr int kVectors = 8, kHalves = 2;
  static constexpr float kUnit = 1.0f;  // a decoded lane is its element value times kUnit
  static constexpr float x_factor(int, int) { return 1.0f; }
  template <int G>
  static constexpr bool halves_share_scales() { return G == 32; }

  // The scales of half h's lanes; scale(i): the value of the chunk's i-th group (G = 16 or 32).
  template <int G, typename Scale>
  __attribute__((always_inline)) static inline void scale_lanes(Scale scale, __m256 (&sv)[kHalves]) {
    static_assert(G == 16 || G == 32, "e2m1 chunks: groups of 16 or 32");
    if constexpr (G == 32) {
      sv[0] = sv[1] = _mm256_set_m128(_mm_set1_ps(scale(1)), _mm_set1_ps(scale(0)));
    } else {
      sv[0] = _mm256_set_m128(_mm_set1_ps(scale(2)), _mm_set1_ps(scale(0)));
      sv[1] = _mm256_set_m128(_mm_set1_ps(scale(3)), _mm_set1_ps(scale(1)));
    }
  }

  // The 64 codes of the chunk at p as 8 float vectors (code(j, l)).
  __attribute__((always_inline)) static inline void decode(const uint8_t* p, __m256 (&v)[8]) {
    // High and low byte of bfloat16(e2m1 value) by code (sign bit 3), in both 128-bit lanes.
    const __m256i hi_byte = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF),
                                             char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0),
                                             0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF),
                                             char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0));
    const __m256i lo_byte = _mm256_setr_epi8(0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0),
                                             0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0),
                                             0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0),
                                             0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0));
    const __m256i nibble = _mm256_set1_epi8(0x0F), high_word = _mm256_set1_epi32(int(0xFFFF0000u));
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i idx[2] = {_mm256_and_si256(w, nibble), _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble)};
    for (int nib = 0; nib < 2; ++nib) {
      const __m256i h = _mm256_shuffle_epi8(hi_byte, idx[nib]), l = _mm256_shuffle_epi8(lo_byte, idx[nib]);
      const __m256i words[2] = {_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h)};
      for (int hf = 0; hf < 2; ++hf) {
        v[4 * nib + 2 * hf] = _mm256_castsi256_ps(_mm256_slli_epi32(words[hf], 16));
        v[4 * nib + 2 * hf + 1] = _mm256_castsi256_ps(_mm256_and_si256(words[hf], high_word));
      }
    }
  }

  // p[r][m][h] += half h of the chunk of W row r (at w[r]) times x row m (xc[m]: kXPerChunk
  // floats in vector order).
  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const uint8_t* const (&w)[R], const float* const (&xc)[MB],
                                                        __m256 (&p)[R][MB][2]) {
    for (int r = 0; r < R; ++r) {
      __m256 v[8];
      decode(w[r], v);
      for (int j = 0; j < 8; ++j)
        for (int m = 0; m < MB; ++m)
          p[r][m][half(j)] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xc[m] + 8 * j), p[r][m][half(j)]);
    }
  }
};

// E4m3Multiplier (mxfp8): a chunk is 32 e4m3 bytes. Each byte b goes to the top of a u16 word
// (vpunpck*bw with zero); an arithmetic shift right by 1 and a mask leave sign | (b & 0x7F) << 7,
// the float16 of the e4m3 value times 2^-8 (exponent field e, 3 mantissa bits; e4m3 subnormals
// become float16 subnormals: all exact), which vcvtph2ps widens to float32; kUnit = 2^-8 goes into
// the scales. Vector j holds 8 consecutive codes (code(j, l)), all of one group of 32: one scale
// per chunk. The NaN codes (0x7F, 0xFF) would decode as +-480: nan_codes() marks them, and the
// kernel makes a row that holds one sum to NaN.
struct E4m3Multiplier {
  static constexpr const char* kName = "avx2-e4m3";
  static constexpr int kBits = 8, kCodes = 32, kBytes = 32, kVectors = 4, kHalves = 2;
  static constexpr int64_t kXPerChunk = 32;
  static constexpr float kUnit = 0x1p-8f;
  static constexpr bool kNanCodes = true, kAffine = false;
  // Vector j: bytes 0-7, 16-23 (vpunpcklbw), 8-15, 24-31 (vpunpckhbw).
  static constexpr int code(int j, int l) { return 8 * (j == 0 ? 0 : j == 1 ? 2 : j == 2 ? 1 : 3) + l; }
  static constexpr float x_factor(int, int) { return 1.0f; }
  template <int G>
  static constexpr bool halves_share_scales() { return true; }

  template <int G, typename Scale>
  __attribute__((always_inline)) static inline void scale_lanes(Scale scale, __m256 (&sv)[kHalves]) {
    static_assert(G == 32, "e4m3 chunks: groups of 32");
    sv[0] = sv[1] = _mm256_set1_ps(scale(0));
  }

  // 0xFF in the bytes of the chunk at p that hold a NaN code.
  __attribute__((always_inline)) static inline __m256i nan_codes(const uint8_t* p) {
    const __m256i low7 = _mm256_set1_epi8(0x7F);
    return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), low7), low7);
  }

  template <int R, int MB>
  __attribute__((always_inline)) static inline void dot(const uint8_t* const (&w)[R], const float* const (&xc)[MB],
                                                        __m256 (&p)[R][MB][kHalves]) {
    const __m256i zero = _mm256_setzero_si256(), keep = _mm256_set1_epi16(int16_t(0xBF80));
    for (int r = 0; r < R; ++r) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r]));
      const __m256i h[2] = {_mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, b), 1), keep),
                            _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, b), 1), keep)};
      for (int i = 0; i < 2; ++i) {
        const __m256 v[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(h[i])),
                             _mm256_cvtph_ps(_mm256_extracti128_si256(h[i], 1))};
        for (int m = 0; m < MB; ++m) {  // two chains: vectors 2i, 2i + 1
          p[r][m][0] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xc[m] + 16 * i), p[r][m][0]);
          p[r][m][1] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xc[m] + 16 * i + 8), p[r][m][1]);
        }
      }
    }
  }
};

}  // namespace chunk
}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX2 + FMA
