// Scalar fields of GGUF super-blocks that every CPU GGUF kernel reads (gguf_chunked.cpp,
// gguf_avx2.cpp, actq_gguf.cpp): f16 values at a byte address, and Q4_K's 8 six-bit scales and
// mins unpacked 4 bytes at a time (gguf::q4k_scale_min for all j at once).
#pragma once

#include <c10/util/Half.h>

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

}  // namespace gguf_fields
}  // namespace cpu
}  // namespace torch_qmm
