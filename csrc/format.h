// The packed bit stream every format of csrc/format_spec.h shares: one place for the facts every
// backend (CPU, planner, Metal) relies on (torch_qmm/formats.py describes it for Python).
//
// W [N, K] (transpose=True) is stored as
//   wq      uint32 [N, K * bits / 32]   row n is one little-endian bit stream along K:
//                                        element k occupies bits [k*bits, (k+1)*bits).
//                                        For bits 2/4/8 this is "least-significant bits first
//                                        within each uint32 word"; for 3/5/6 a value may cross
//                                        a byte (never more than a 32-bit window).
//   scales  [N, K / group_size]          affine: w[n, k] ~= scales[n, k/G] * q[n, k] + biases[n, k/G]
//   biases  [N, K / group_size]          (affine only; the fp modes decode q and scale: fp_codec.h)
#pragma once

#include <cstdint>

namespace torch_qmm {

// Number of uint32 words that hold `k` elements of `bits` bits (k * bits is a multiple of 32
// whenever k is a multiple of an allowed group size).
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
