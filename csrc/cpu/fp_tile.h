// Tiles of an fp-mode packed matrix (mxfp4, nvfp4, ...: csrc/format_spec.h) decoded to float32,
// for the GEMM kernels (qmm_gemm.cpp): w = element(q) * scale, exact in float32 (the product of
// two short significands) unless it overflows. Columns stay in natural order.
#pragma once

#include <cstdint>

#include "../format.h"
#include "../fp_codec.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

// Decodes rows [r0, r0+nr) x columns [c0, c0+nc) of the packed matrix with `cols` columns
// (c0 and nc multiples of the group size) to dst [nr, nc].
inline void decode_fp_tile(const QmmArgs& a, int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                           float* dst) {
  const FormatSpec& f = format_spec(a.mode);
  float values[256];
  for (uint32_t c = 0; c < (1u << a.bits); ++c) values[c] = fp::element_value(f.element, c);
  const int64_t row_bytes = cols * a.bits / 8, groups = cols / a.group_size;
  const uint8_t* S = static_cast<const uint8_t*>(a.scales);
  for (int64_t r = 0; r < nr; ++r) {
    const uint8_t* row = a.wq + (r0 + r) * row_bytes;
    const uint8_t* s = S + (r0 + r) * groups;
    float* d = dst + r * nc;
    for (int64_t g0 = c0; g0 < c0 + nc; g0 += a.group_size) {
      const float scale = fp::scale_value(f.scale, s[g0 / a.group_size]);
      for (int64_t c = g0; c < g0 + a.group_size; ++c) d[c - c0] = values[unpack_element(row, c, a.bits)] * scale;
    }
  }
}

}  // namespace cpu
}  // namespace torch_qmm
