// Per-row affine parameters on AVX2 (the int8 kernels of actq_qmm.cpp, the exact ones of
// avx2_chunked.cpp): 8 scales or biases as float32, and the hoisted offset sum of a W row.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "hsum.h"

namespace torch_qmm {
namespace cpu {

// 8 scales or biases from p as float32.
template <typename T>
__attribute__((always_inline)) inline __m256 params8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#if defined(__F16C__)
    else return _mm256_cvtph_ps(h);
#else
    else {
      alignas(32) float f[8];
      for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
      return _mm256_load_ps(f);
    }
#endif
  }
}

// The hoisted offsets of one row of W: sum over g < n of (b[g] - SHIFT * s[g]) * xs[g], in 8 lanes
// of two accumulators (groups g = 16j + l and 16j + 8 + l), then the remainder in order.
template <int SHIFT, typename T>
float offset_sum(const T* b, const T* s, const float* xs, int64_t n) {
  auto coef = [&](int64_t g) __attribute__((always_inline)) {
    const __m256 bv = params8(b + g);
    if constexpr (SHIFT == 0) return bv;
    else return _mm256_fnmadd_ps(_mm256_set1_ps(float(SHIFT)), params8(s + g), bv);
  };
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= n; g += 16) {
    a0 = _mm256_fmadd_ps(coef(g), _mm256_loadu_ps(xs + g), a0);
    a1 = _mm256_fmadd_ps(coef(g + 8), _mm256_loadu_ps(xs + g + 8), a1);
  }
  if (g + 8 <= n) {
    a0 = _mm256_fmadd_ps(coef(g), _mm256_loadu_ps(xs + g), a0);
    g += 8;
  }
  float t = hsum(_mm256_add_ps(a0, a1));
  for (; g < n; ++g) t += (static_cast<float>(b[g]) - float(SHIFT) * static_cast<float>(s[g])) * xs[g];
  return t;
}

}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX2 + FMA
