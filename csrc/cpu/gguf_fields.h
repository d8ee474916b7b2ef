// Scalar fields of GGUF super-blocks that every CPU GGUF kernel reads (gguf_chunked.cpp,
// gguf_avx2.cpp, gguf_f32.cpp, actq_gguf.cpp): f16 values at a byte address, and Q4_K's 8 six-bit
// scales and mins unpacked 4 bytes at a time (gguf::q4k_scale_min for all j at once); on AVX2,
// the same bytes in one vector; on AVX-512, all of a Q4_K block's scales and mins as floats, and
// Q6_K's codes and scales.
#pragma once

#include <c10/util/Half.h>

#if defined(__AVX2__)
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

#if defined(__AVX2__)
// The first 16 bytes of a Q4_K block (d, dmin f16, then the 12 packed bytes), in both 128-bit lanes
// (one broadcast load).
inline __m256i q4k_head(const uint8_t* blk) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
}

// q4k_scale_bytes in vector registers, in each 128-bit lane of head = q4k_head(blk): dwords
// [scale[0], scale[1], min[0], min[1]], so bytes 0-7 are the scales of sub-blocks 0..7 and bytes
// 8-15 their mins. With the 12 packed bytes as dwords [s0, s1, s2] (dwords 1-3 of a lane):
// scale[0] = s0 & 0x3F.., scale[1] = (s2 & 0x0F..) | ((s0 >> 2) & 0x30..), min[0] = s1 & 0x3F..,
// min[1] = ((s2 >> 4) & 0x0F..) | ((s1 >> 2) & 0x30..).
inline __m256i q4k_scale_min_bytes(__m256i head) {
  const __m256i low = _mm256_srlv_epi32(_mm256_shuffle_epi32(head, _MM_SHUFFLE(3, 2, 3, 1)), _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4));
  const __m256i top = _mm256_srli_epi32(_mm256_shuffle_epi32(head, _MM_SHUFFLE(2, 2, 1, 1)), 2);
  const __m256i k6 = _mm256_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F);
  const __m256i k2 = _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030, 0, 0x30303030, 0, 0x30303030);
  return _mm256_or_si256(_mm256_and_si256(low, k6), _mm256_and_si256(top, k2));
}
#endif

#if defined(__AVX512F__)
// The 16 six-bit fields [sc[0..7], m[0..7]] of a Q4_K block as int32 lanes, from its first 16
// bytes (head; q4k_scale_bytes' formulas, one lane each).
inline __m512i q4k_scale_min_lanes(__m128i head) {
#if defined(__AVX512VBMI__)
  // With VBMI, one byte permute puts in lane l the byte A (bytes 4-15: the 12 packed ones) its low
  // bits come from, and, for j >= 4, in byte 1 the byte B whose top 2 bits are its bits 4-5:
  // field = ((lane >> shift) & low) | ((lane >> 10) & 0x30), shift 4 for the high mins (A's high
  // nibble). 6 operations where the path below takes 9 (Xeon, 4096 x 14336, M = 1, float32 x,
  // paired in one process: 0.96-0.985 of the time).
  const __m512i pick = _mm512_setr_epi32(4, 5, 6, 7, 12 | 4 << 8, 13 | 5 << 8, 14 | 6 << 8, 15 | 7 << 8,  // sc
                                         8, 9, 10, 11, 12 | 8 << 8, 13 | 9 << 8, 14 | 10 << 8, 15 | 11 << 8);  // m
  // bytes kept: byte 0 of every lane, byte 1 of lanes 4-7 and 12-15 (4 mask bits per lane)
  const __m512i ab = _mm512_maskz_permutexvar_epi8(0x3333111133331111ull, pick, _mm512_castsi128_si512(head));
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i low = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m512i a = _mm512_and_si512(_mm512_srlv_epi32(ab, shift), low);
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(ab, 10), _mm512_set1_epi32(0x30), a, 0xEA);  // (x & y) | z
#else
  return _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q4k_scale_min_bytes(_mm256_broadcastsi128_si256(head))));
#endif
}

// [d*sc[0..7], dmin*m[0..7]] of the Q4_K block at blk (products exact: 11 by 6 bits).
inline __m512 q4k_scale_vector(const uint8_t* blk) {
  const __m128i head = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m512 f = _mm512_cvtepi32_ps(q4k_scale_min_lanes(head));
  // d for lanes 0-7, dmin for 8-15.
  const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(head));
  return _mm512_mul_ps(f, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), dd));
}

// Q4_K's 128 nibble bytes (at blk + 16) dealt by 16-byte quarters into vector h (0 or 1): its
// quarter J is bytes 16h .. 16h + 15 of run J (the 32 bytes of weights 64J .. 64J + 63), so dword
// lane l holds bytes 32J + 16h + 4(l % 4) + t (t = 0..3) of run J = l / 4 in both vectors. Low
// nibbles are weights of sub-block 2J, high ones of 2J + 1, the same in every field of a lane:
// the float32 and bfloat16 kernels sum a whole super-block per lane before scaling it once.
template <int H>
__attribute__((always_inline)) inline __m512i q4k_dealt_nibbles(const uint8_t* blk) {
  const __m512i lo = _mm512_loadu_si512(blk + 16), hi = _mm512_loadu_si512(blk + 80);
  return _mm512_shuffle_i64x2(lo, hi, H == 0 ? _MM_SHUFFLE(2, 0, 2, 0) : _MM_SHUFFLE(3, 1, 3, 1));
}

// Lane l: the scale of sub-block 2(l / 4) + P (P = 0: low nibbles, 1: high) of the dealt vectors,
// from sv = q4k_scale_vector(blk).
template <int P>
__attribute__((always_inline)) inline __m512 q4k_dealt_scales(__m512 sv) {
  const __m512i idx = _mm512_setr_epi32(P, P, P, P, 2 + P, 2 + P, 2 + P, 2 + P, 4 + P, 4 + P, 4 + P, 4 + P,
                                        6 + P, 6 + P, 6 + P, 6 + P);
  return _mm512_permutexvar_ps(idx, sv);
}

// Q6_K (210 bytes: ql[128], qh[64], 16 int8 scales, d f16; llama.cpp's dequantize_row_q6_K
// order): weight 128h + 64p + c (c = 0..63) has q = (nibble p of ql[64h + c]) | (field 2p + c / 32
// of qh[32h + c % 32]) << 4. Byte c of the result: that q, in bits 0-5 (bits 6-7 are left over
// from qh: mask them where they matter). The qh half is broadcast to both 32-byte halves and
// shifted per half so that its field sits at bits 4-5, then merged under the nibble mask.
template <int P>
__attribute__((always_inline)) inline __m512i q6k_q_bytes(const uint8_t* blk, int h) {
  const __m512i l = _mm512_loadu_si512(blk + 64 * h);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
  const __m512i lo = P == 0 ? l : _mm512_srli_epi32(l, 4);
  // Lanes 0-7 hold c < 32 (field 2P at bits 4P), lanes 8-15 c >= 32 (field 2P + 1, bits 4P + 2).
  const __m512i hi = P == 0 ? _mm512_sllv_epi32(qh, _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2))
                            : _mm512_srlv_epi32(qh, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2));
  // Bitwise select: nibble bits (mask 0x0F) from lo, the rest from hi.
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x0F), 0xE4);
}

// Q6_K: d*sc[s] for its 16 sub-blocks (exact: 11 by 8 bits).
inline __m512 q6k_scale_vector(const uint8_t* blk) {
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
  return _mm512_mul_ps(sc, _mm512_set1_ps(f16_at(blk + 208)));
}
#endif

}  // namespace gguf_fields
}  // namespace cpu
}  // namespace torch_qmm
