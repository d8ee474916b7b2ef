// The affine format: one place for the facts every backend (CPU, planner, Metal) shares.
//
// MLX's affine format, bit for bit (see torch_qmm/formats.py for the Python mirror):
//   W [N, K] (transpose=True) is stored as
//     wq      uint32 [N, K * bits / 32]   row n is one little-endian bit stream along K:
//                                          element k occupies bits [k*bits, (k+1)*bits).
//                                          For bits 2/4/8 this is "least-significant bits first
//                                          within each uint32 word"; for 3/5/6 a value may cross
//                                          a byte (never more than a 32-bit window).
//     scales  [N, K / group_size]          w[n, k] ~= scales[n, k/G] * q[n, k] + biases[n, k/G]
//     biases  [N, K / group_size]
#pragma once

#include <cstdint>

namespace torch_qmm {

// Must match SUPPORTED_BITS / SUPPORTED_GROUP_SIZES in torch_qmm/formats.py.
inline bool is_supported_bits(int64_t bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}
inline bool is_supported_group_size(int64_t g) { return g == 32 || g == 64 || g == 128; }

// Number of uint32 words that hold `k` elements of `bits` bits (k * bits is a multiple of 32
// whenever k is a multiple of a supported group size).
inline int64_t packed_words(int64_t k, int64_t bits) { return k * bits / 32; }

// Reads element `k` of a packed row (little-endian bit stream). Safe for every supported width:
// the value lies inside the 64-bit window starting at its byte.
inline uint32_t unpack_element(const uint8_t* row, int64_t k, int bits) {
  const int64_t bit = k * bits;
  const uint8_t* p = row + (bit >> 3);
  uint32_t window = p[0];
  if (bits + (bit & 7) > 8) window |= uint32_t(p[1]) << 8;
  if (bits + (bit & 7) > 16) window |= uint32_t(p[2]) << 16;
  return (window >> (bit & 7)) & ((1u << bits) - 1u);
}

}  // namespace torch_qmm
