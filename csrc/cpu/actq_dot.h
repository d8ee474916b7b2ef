// Integer dot products of the int8-activation qmm (actq_qmm.cpp): unsigned 8-bit weight codes
// times signed 8-bit x codes, 4 adjacent bytes summed into each int32 lane. One instruction where
// the CPU has VNNI (vpdpbusd: AVX512_VNNI with AVX512VL, or AVX-VNNI), else AVX2's vpmaddubsw
// (pairs into saturating int16) and vpmaddwd (pairs of int16 into int32). The callers keep every
// pair u0*s0 + u1*s1 below 2^15 in magnitude (|u| <= 128, |s| <= 127), so vpmaddubsw never
// saturates and all variants give the same integers. Built with -march=native, the CPU here picks
// the variant; tests/test_cpu_actq_compiles.py compiles the VNNI ones on any x86 machine.
#pragma once

#if defined(__AVX2__)

#include <immintrin.h>

namespace torch_qmm {
namespace cpu {
namespace actq {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kDotIsa = "avx512vnni";
#elif defined(__AVXVNNI__)
constexpr const char* kDotIsa = "avxvnni";
#else
constexpr const char* kDotIsa = "avx2";
#endif

// acc[l] + p[2l] * c[2l] + p[2l + 1] * c[2l + 1] (signed int16 pairs into int32): vpdpwssd where
// the CPU has VNNI, else vpmaddwd and an add (the same integers while no sum passes 2^31).
__attribute__((always_inline)) inline __m256i dot2_16(__m256i acc, __m256i p, __m256i c) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, c);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, p, c);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, c));
#endif
}

// acc[l] + sum over i < 4 of u[4l + i] * s[4l + i] (u unsigned, s signed).
__attribute__((always_inline)) inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return dot2_16(acc, _mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// dot4 of two operand pairs, (u0, s0) and (u1, s1), from zero. AVX2 adds the int16 pair sums
// before widening (|sum| <= 4 * 15 * 127 for 4-bit codes: the callers' bound).
__attribute__((always_inline)) inline __m256i dot4x2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
  return dot4(dot4(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
// dot2_16 on 512 bits (vpdpwssd zmm with AVX512_VNNI).
__attribute__((always_inline)) inline __m512i dot2_16_512(__m512i acc, __m512i p, __m512i c) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, p, c);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, c));
#endif
}

// sum over i < 4 of u[4l + i] * s[4l + i] (u unsigned, s signed), 16 lanes: vpdpbusd from zero
// with AVX512_VNNI, else vpmaddubsw and vpmaddwd by ones (the same integers while every pair
// u0*s0 + u1*s1 stays below 2^15 in magnitude, as for codes of up to 6 bits and |s| <= 127).
__attribute__((always_inline)) inline __m512i dot4_512_from_zero(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
#endif

// The 512-bit kernels (actq_qmm.cpp: "int8x/avx512vnni-512-*"): vpdpbusd on zmm, 64 bytes per
// instruction, where the CPU has AVX512_VNNI and AVX512BW (the latter for the byte operations
// around it). TORCH_QMM_CPU_NO_INT8_512=1 keeps the 256-bit kernels above.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHaveDot512 = true;
constexpr const char* kDot512Isa = "avx512vnni";

// acc[l] + sum over i < 4 of u[4l + i] * s[4l + i] (u unsigned, s signed), 16 lanes; exact in
// int32 for the callers' operands (|u| <= 255, |s| <= 127: no saturation, vpdpbusd wraps only
// past 2^31).
__attribute__((always_inline)) inline __m512i dot4_512(__m512i acc, __m512i u, __m512i s) {
  return _mm512_dpbusd_epi32(acc, u, s);
}
#else
constexpr bool kHaveDot512 = false;
#endif

}  // namespace actq
}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX2
