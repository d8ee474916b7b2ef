// x of one GGUF super-block (256 floats) put in the forms the AVX-512 GGUF kernels read
// (gguf_f32.cpp, gguf_chunked.cpp), vector by vector: the sums of x over its sub-blocks (for the
// hoisted offsets) and the gathers of x into the kernels' lane layouts.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <cstdint>

namespace torch_qmm {
namespace cpu {
namespace gguf_x {

// Lane s: the sum of the 16 lanes of v[s]. Pairs of lanes, then pairs of those, ..., in one
// fixed tree: the same bits for every call, thread count and split of x into parts.
__attribute__((always_inline)) inline __m512 lane_sums(const __m512 (&v)[16]) {
  // a[i], each 128-bit lane: [v[2i] e0+e2, v[2i+1] e0+e2, v[2i] e1+e3, v[2i+1] e1+e3]
  __m512 a[8];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // b[i], each 128-bit lane: the sums of that lane of v[4i .. 4i+3], in that order
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // The four 128-bit lanes of each b summed: pairs (0+1, 2+3), then those pairs.
  auto pair_lanes = [](__m512 p, __m512 q) __attribute__((always_inline)) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return pair_lanes(pair_lanes(b[0], b[1]), pair_lanes(b[2], b[3]));
}

// Q4_K: lanes 8 + s = the sum of x over sub-block s (32 values, s = 0..7), lanes 0-7 zero.
__attribute__((always_inline)) inline __m512 q4k_sums(const float* x) {
  __m512 v[16];
  for (int s = 0; s < 8; ++s) v[s] = _mm512_add_ps(_mm512_loadu_ps(x + 32 * s), _mm512_loadu_ps(x + 32 * s + 16));
  for (int s = 8; s < 16; ++s) v[s] = _mm512_setzero_ps();
  const __m512 r = lane_sums(v);  // lanes 0-7
  return _mm512_maskz_shuffle_f32x4(__mmask16(0xFF00), r, r, _MM_SHUFFLE(1, 0, 1, 0));
}

// Q6_K: lane s = 32 times the sum of x over sub-block s (16 values, s = 0..15).
__attribute__((always_inline)) inline __m512 q6k_sums(const float* x) {
  __m512 v[16];
  for (int s = 0; s < 16; ++s) v[s] = _mm512_loadu_ps(x + 16 * s);
  return _mm512_mul_ps(lane_sums(v), _mm512_set1_ps(32.0f));
}

// out[i], lane l = v[l / 4][4 * (l % 4) + i] (i = 0..3): the 64 floats of v taken as 16 runs of
// 4, each out[i] holding element i of every run in the order of the runs.
__attribute__((always_inline)) inline void every_fourth(const __m512 (&v)[4], __m512 (&out)[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28), _mm512_set1_epi32(i));
    out[i] = _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_permutex2var_ps(v[0], idx, v[1]),
                                  _mm512_permutex2var_ps(v[2], idx, v[3]));
  }
}

// every_fourth of the 64 floats at base, base + 16, base + at, base + at + 16 (two runs of 32).
__attribute__((always_inline)) inline void every_fourth_at(const float* base, int at, __m512 (&out)[4]) {
  const __m512 v[4] = {_mm512_loadu_ps(base), _mm512_loadu_ps(base + 16), _mm512_loadu_ps(base + at),
                       _mm512_loadu_ps(base + at + 16)};
  every_fourth(v, out);
}

}  // namespace gguf_x
}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX-512
