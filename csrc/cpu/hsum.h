// The sum of a float vector's lanes (the chunk kernels' reduce()).
#pragma once

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace torch_qmm {
namespace cpu {

#if defined(__AVX__)
// Halves, then pairs, then the last two lanes.
__attribute__((always_inline)) inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

#if defined(__AVX512F__)
__attribute__((always_inline)) inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

}  // namespace cpu
}  // namespace torch_qmm
