// Scalar fields of GGUF super-blocks that every CPU GGUF kernel reads (gguf_chunked.cpp,
// gguf_avx2.cpp, gguf_f32.cpp, actq_gguf.cpp): f16 values at a byte address, and Q4_K's 8 six-bit
// scales and mins unpacked 4 bytes at a time (gguf::q4k_scale_min for all j at once); on AVX-512,
// all of a Q4_K block's scales and mins as one vector.
#pragma once

#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace torch_qmm {
namespace cpu {
namespace gguf_fields {

// The float16 stored at p (blocks are byte-aligned inside a row).
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return float(c10::Half(h, c10::Half::from_bits()));
}

// Q4_K's sub-block scales and mins as bytes: byte j of scale[0..1] is the scale of sub-block j
// (j < 4 in scale[0], 4..7 in scale[1]), and the same for min.
struct Q4kScaleBytes {
  uint32_t scale[2], min[2];
};

// scales12: the 12 packed bytes (block offset 4).
inline Q4kScaleBytes q4k_scale_bytes(const uint8_t* scales12) {
  uint32_t s0, s1, s2;
  std::memcpy(&s0, scales12, 4);
  std::memcpy(&s1, scales12 + 4, 4);
  std::memcpy(&s2, scales12 + 8, 4);
  Q4kScaleBytes r;
  r.scale[0] = s0 & 0x3F3F3F3Fu;
  r.min[0] = s1 & 0x3F3F3F3Fu;
  r.scale[1] = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);  // low 4 bits, then (q[j-4] >> 6) << 4
  r.min[1] = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
  return r;
}

#if defined(__AVX512F__)
// [d*sc[0..7], dmin*m[0..7]] of the Q4_K block at blk (products exact: 11 by 6 bits), unpacked in
// vector registers as q4k_scale_bytes does in scalar ones: the 12 packed bytes as dwords
// [s0, s1, s2], scale[0] = s0 & 0x3F.., scale[1] = (s2 & 0x0F..) | ((s0 >> 2) & 0x30..), min[0] = s1
// & 0x3F.., min[1] = ((s2 >> 4) & 0x0F..) | ((s1 >> 2) & 0x30..).
inline __m512 q4k_scale_vector(const uint8_t* blk) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));  // d, dmin, s0, s1, s2
  const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1)), 2);
  // (low & [3F, 0F, 3F, 0F]) | (top & [0, 30, 0, 30]), in the order [scale0, scale1, min0, min1].
  const __m128i bytes = _mm_or_si128(_mm_and_si128(low, _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F)),
                                     _mm_and_si128(top, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  // d for lanes 0-7, dmin for 8-15.
  const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(v));
  return _mm512_mul_ps(f, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), dd));
}
#endif

}  // namespace gguf_fields
}  // namespace cpu
}  // namespace torch_qmm
