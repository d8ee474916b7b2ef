// The activation quantizer of the int8-activation qmm: x cut into blocks along K, each block
// stored as int8 codes and one float32 scale: blocks of 32 for the affine formats (actq_qmm.cpp),
// as llama.cpp's Q8_0 activations, and of one GGUF super-block, 256, for Q4_K / Q6_K
// (actq_gguf.cpp), as its Q8_K ones.
// Portable C++ (no intrinsics): every ISA variant of the kernels quantizes x the same way, so they
// differ only in how the integer dot products are formed, never in the codes. The loops are
// `omp simd` (vectorized where the build targets a vector ISA); every step is an IEEE operation
// rounded once (|x|, max, x / d, round to nearest even, the clamp), so a vector lane computes the
// code the scalar loop would. std::max / std::min rather than std::fmax / std::fmin, which the
// compiler leaves as library calls: x is finite here, where the two agree.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace torch_qmm {
namespace cpu {
namespace actq {

constexpr int kBlock = 32;  // x values per scale (affine)

// q[i] = x[i] / d rounded to nearest (ties to even; the default rounding mode), d = max|x| / 127,
// both computed in float32, so |x[i] - q[i] * d| <= d / 2 + |x[i]| * 2^-24, for the n values of a
// block. Returns d; a block whose d is 0 (all zeros, or max|x| below 127 * 2^-149, where d
// underflows) gets q = 0 and d = 0. x must be finite (the op sends other x to the exact kernels).
inline float quantize_block(const float* x, int8_t* q, int n = kBlock) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  if (!(d > 0.0f)) {
    for (int i = 0; i < n; ++i) q[i] = 0;
    return 0.0f;
  }
#pragma omp simd
  for (int i = 0; i < n; ++i) q[i] = int8_t(std::min(std::max(std::nearbyint(x[i] / d), -127.0f), 127.0f));
  return d;
}

// The sum of n codes (|sum| <= n * 127: exact in int32, and in float32 for n <= 2^17).
inline int32_t block_sum(const int8_t* q, int n = kBlock) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += q[i];
  return s;
}

}  // namespace actq
}  // namespace cpu
}  // namespace torch_qmm
