// Decoding packed affine weights into SIMD registers (CPU kernels).
//
// The unit of work is a 32-code *block* of one packed row: 32 * BITS bits = 4 * BITS bytes,
// always byte aligned and never split across groups (every group size is a multiple of 32).
// A block decodes into two 16-lane float vectors holding the integer codes q. The lanes are in
// *codec order*, chosen so that decoding needs only a load, shifts and masks; the kernels
// permute x (K side) or y (N side) to match instead of shuffling the weights:
//
//   bits 8      v0 = q[0..15], v1 = q[16..31] (identity)     16 bytes widened (vpmovzxbd)
//   bits 4      vj lane l = q[2l + j]                         16 bytes widened, v0 = low nibbles,
//               v1 = high nibbles (widen, and, shift: 5 instructions per 32 codes)
//   bits 2      identity                                     one word broadcast, shifted by 2l
//   bits 3/5/6  identity. AVX-512: the block's BITS words are loaded (masked) and each lane
//               permutes in the word(s) holding its code and funnel-shifts it out. Elsewhere: 8
//               codes of a BITS-byte unit are spread to 8 bytes with three SWAR steps on a
//               uint64 (no BMI2 pdep: microcoded on AMD Zen 1/2), then widened (~4x slower).
//
// The vectors are GCC/Clang vector extensions, so one source compiles to AVX-512 (one zmm per
// vector), AVX2 (two ymm) or NEON (four q registers); -march=native picks the instructions.
// The shifts/converts map to vpmovzxbd / vpsrlvd / vpand / vcvtdq2ps on x86 (check with
// `objdump -d`), with no table lookups or gathers.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
// Passing 64-byte vectors between non-inlined functions changes ABI without AVX-512; all our
// uses are inlined, so the warning is noise.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace torch_qmm {
namespace cpu {

constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
// One vbroadcastss. (`f32x16{} + s` adds 0.0f; a lane-by-lane loop becomes 16 masked broadcasts.)
inline f32x16 splat16(float s) { return f32x16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

inline float hsum16(f32x16 v) {
  // Pairwise halves: the compiler lowers this to extract/add, log2(16) steps.
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  float s8[8];
  for (int i = 0; i < 8; ++i) s8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) s8[i] += s8[i + 4];
  return (s8[0] + s8[2]) + (s8[1] + s8[3]);
}

// 16 byte codes -> 16 int32 lanes. GCC 12 lowers __builtin_convertvector(u8 -> u32) to 16
// scalar extract/insert pairs, so x86 uses the widening instruction explicitly.
inline i32x16 widen_bytes(u8x16 b) {
#if defined(__AVX512F__)
  return (i32x16)_mm512_cvtepu8_epi32((__m128i)b);
#elif defined(__AVX2__)
  const __m256i lo = _mm256_cvtepu8_epi32((__m128i)b);
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64((__m128i)b, (__m128i)b));
  i32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  return (i32x16)__builtin_convertvector(b, u32x16);  // Clang/NEON: two ushll steps
#endif
}

// Codes < 256, so the signed convert is exact and a single instruction (no unsigned convert on AVX2).
inline f32x16 codes_to_float(i32x16 q) { return __builtin_convertvector(q, f32x16); }

inline u8x16 load_bytes16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The 4 bytes at p in every 32-bit lane (one vpbroadcastd from memory).
inline u32x16 splat_u32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return u32x16{} + w;
}

// Spreads 8 codes of B bits (the low 8*B bits of u) to one code per byte, in order.
template <int B>
inline uint64_t spread8(uint64_t u) {
  static_assert(B >= 1 && B <= 7, "spread8: 1..7 bits");
  constexpr uint64_t m4 = (uint64_t(1) << (4 * B)) - 1;              // codes 0..3
  constexpr uint64_t m2 = ((uint64_t(1) << (2 * B)) - 1) * 0x100000001ull;  // 2 codes per 32-bit half
  constexpr uint64_t m1 = ((uint64_t(1) << B) - 1) * 0x0001000100010001ull; // 1 code per 16-bit quarter
  u &= (uint64_t(1) << (8 * B)) - 1;
  u = (u & m4) | ((u << (32 - 4 * B)) & (m4 << 32));
  u = (u & m2) | ((u << (16 - 2 * B)) & (m2 << 16));
  u = (u & m1) | ((u << (8 - B)) & (m1 << 8));
  return u;
}

template <int BITS>
struct Block32 {
  static_assert(BITS == 2 || BITS == 3 || BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8,
                "Block32: unsupported bit width");
  static constexpr int kBytes = 4 * BITS;

  // Codes of the block at p (kBytes bytes, read exactly) as floats in codec order.
  static inline void decode(const uint8_t* p, f32x16& v0, f32x16& v1) {
    if constexpr (BITS == 8) {
      v0 = codes_to_float(widen_bytes(load_bytes16(p)));
      v1 = codes_to_float(widen_bytes(load_bytes16(p + 16)));
    } else if constexpr (BITS == 4) {
      // 16 bytes widened once; low nibbles are the even codes, high nibbles the odd ones.
      const i32x16 b = widen_bytes(load_bytes16(p));
      v0 = codes_to_float(b & 15);
      v1 = codes_to_float(b >> 4);
    } else if constexpr (BITS == 2) {
      // Lane l: 2-bit field l of one word (natural order).
      const u32x16 sh = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
      v0 = codes_to_float((i32x16)((splat_u32(p) >> sh) & 3u));
      v1 = codes_to_float((i32x16)((splat_u32(p + 4) >> sh) & 3u));
    } else {
#if defined(__AVX512F__)
      // Each lane gathers the two words around its code from the block's BITS words (masked
      // load: never past the block) and funnel-shifts it out: no scalar work at all.
      const __m512i w = _mm512_maskz_loadu_epi32(__mmask16((1u << BITS) - 1), p);
      v0 = stream16(w, 0);
      v1 = stream16(w, 1);
#else
      // Four units of 8 codes (BITS bytes each); copy the block exactly, never past its end.
      uint8_t raw[32] = {0};
      std::memcpy(raw, p, kBytes);
      uint64_t u[4];
      for (int i = 0; i < 4; ++i) {
        uint64_t w;
        std::memcpy(&w, raw + i * BITS, 8);
        u[i] = spread8<BITS>(w);
      }
      v0 = codes_to_float(widen_bytes((u8x16)(u64x2{u[0], u[1]})));
      v1 = codes_to_float(widen_bytes((u8x16)(u64x2{u[2], u[3]})));
#endif
    }
  }

#if defined(__AVX512F__)
  // Codes 16j .. 16j+15 of a bit-stream block held in w (BITS words), as floats.
  static inline f32x16 stream16(__m512i w, int j) {
    alignas(64) static constexpr auto t = stream_tables();
    const __m512i lo = _mm512_permutexvar_epi32(_mm512_load_si512(t.word[j]), w);
    const __m512i hi = _mm512_permutexvar_epi32(_mm512_load_si512(t.next[j]), w);
    const __m512i sh = _mm512_load_si512(t.shift[j]);
    // vpsllvd by 32 yields 0 (defined for the instruction), covering codes that start a word.
    const __m512i code = _mm512_or_si512(_mm512_srlv_epi32(lo, sh),
                                         _mm512_sllv_epi32(hi, _mm512_sub_epi32(_mm512_set1_epi32(32), sh)));
    return (f32x16)_mm512_cvtepi32_ps(_mm512_and_si512(code, _mm512_set1_epi32((1 << BITS) - 1)));
  }
  struct StreamTables {
    alignas(64) int32_t word[2][16];
    alignas(64) int32_t next[2][16];
    alignas(64) int32_t shift[2][16];
  };
  static constexpr StreamTables stream_tables() {
    StreamTables t{};
    for (int j = 0; j < 2; ++j)
      for (int l = 0; l < 16; ++l) {
        const int bit = (16 * j + l) * BITS;
        t.word[j][l] = bit / 32;
        t.next[j][l] = bit / 32 + 1 < BITS ? bit / 32 + 1 : BITS - 1;  // unused when the code fits
        t.shift[j][l] = bit % 32;
      }
    return t;
  }
#endif

  // Index within the block of the code in vector j (0/1), lane l. Must match decode().
  static constexpr int natural(int j, int l) {
    return BITS == 4 ? 2 * l + j : 16 * j + l;
  }
};

// Codec position -> natural index along the quantized axis, for `count` (a multiple of 32) codes.
inline int64_t codec_to_natural(int bits, int64_t pos) {
  const int64_t block = pos / 32;
  const int j = int(pos % 32) / 16, l = int(pos % 16);
  return block * 32 + (bits == 4 ? Block32<4>::natural(j, l) : 16 * j + l);
}
inline bool codec_is_identity(int bits) { return bits != 4; }

}  // namespace cpu
}  // namespace torch_qmm
