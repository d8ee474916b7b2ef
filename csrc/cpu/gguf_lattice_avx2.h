// The lattice i-quants' groups on AVX2 (IQ1_S .. IQ3_S; metal/gguf_format.h): each group of 8
// weights is one codebook entry (IQ3: two of 4 values), read by gguf::Lattice<type>::code in scalar
// code (its index, sign bits, offset and scale take bit fields from several places of the block).
// The codebook is kept as float32 (FloatGrid, built once: 4 to 64 KB) and the signs as masks of 8
// sign bits (kSignMasks), so a group's 8 weights are one or two loads, an XOR with its sign mask
// (IQ1: an add of its offset), times its scale: exact, the values of gguf::group8 times the scale,
// as the scalar decoder (gguf_qmm.cpp) gives them. Used by the AVX2 chunk kernel (gguf_avx2.cpp,
// LatticeGroups) and by the decode of whole rows for the GEMM route (gguf_qmm.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/Half.h>

#include "../gguf_format.h"

namespace torch_qmm {
namespace cpu {
namespace lattice {

template <int type>
struct FloatGrid {
  using L = gguf::Lattice<type>;
  static const float* values() {
    static const std::vector<float> table = [] {
      std::vector<float> t(size_t(L::kEntries) * L::kWidth);
      for (uint32_t i = 0; i < uint32_t(L::kEntries); ++i)
        for (int v = 0; v < L::kWidth; ++v) t[i * L::kWidth + v] = float(int8_t(uint8_t(L::grid(i) >> (8 * v))));
      return t;
    }();
    return table.data();
  }
};

// The float32 codebook of a type (IQ1_M takes IQ1_S's: the same codebook).
template <int type>
const float* grid() {
  return FloatGrid<type == gguf::kTypeIQ1_M ? gguf::kTypeIQ1_S : type>::values();
}

// Mask s: the float sign bit in lane i where bit i of s is set (s < 256); then, at 256 + s for a 7-bit
// s, the mask of its sign byte with the parity bit (gguf::even_sign_byte), so that the 7-bit types
// skip that arithmetic.
alignas(32) inline constexpr std::array<uint32_t, 384 * 8> kSignMasks = [] {
  std::array<uint32_t, 384 * 8> t{};
  for (int s = 0; s < 384; ++s) {
    const uint32_t bits = s < 256 ? uint32_t(s) : gguf::even_sign_byte(uint32_t(s - 256));
    for (int i = 0; i < 8; ++i) t[8 * s + i] = (bits >> i) & 1 ? 0x80000000u : 0u;
  }
  return t;
}();

// The 8 weights of group c (grid: grid<type>()).
template <int type>
__attribute__((always_inline)) inline __m256 weights(const float* grid, gguf::Code8 c) {
  using L = gguf::Lattice<type>;
  __m256 v;
  if (L::kWidth == 8) {
    v = _mm256_loadu_ps(grid + 8 * c.index[0]);
  } else {
    v = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(grid + 4 * c.index[0])), _mm_loadu_ps(grid + 4 * c.index[1]), 1);
  }
  if (type == gguf::kTypeIQ1_S || type == gguf::kTypeIQ1_M) {  // an offset, no signs
    v = _mm256_add_ps(v, _mm256_set1_ps(c.offset));
  } else {
    const uint32_t mask = c.seven_signs ? 256 + c.signs : c.signs;
    v = _mm256_xor_ps(v, _mm256_load_ps(reinterpret_cast<const float*>(kSignMasks.data() + 8 * mask)));
  }
  return _mm256_mul_ps(v, _mm256_set1_ps(c.scale));
}

// The 256 weights of the super-block at raw into y (the GEMM route's decode of W rows).
template <int type>
void decode_block(const uint8_t* raw, float* y) {
  using L = gguf::Lattice<type>;
  typename L::Block b;
  std::memcpy(&b, raw, sizeof b);  // blocks are byte-aligned inside a row
  const float d = c10::Half(uint16_t(L::d_bits(&b)), c10::Half::from_bits());
  const float* g = grid<type>();
#pragma GCC unroll 8
  for (int r = 0; r < 32; ++r) _mm256_storeu_ps(y + 8 * r, weights<type>(g, L::code(&b, r, d)));
}

}  // namespace lattice
}  // namespace cpu
}  // namespace torch_qmm

#endif  // AVX2 + FMA
