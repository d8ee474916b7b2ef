// Tiles of a packed matrix decoded to float32 for the GEMM drivers (qmm_gemm.cpp, bf16_gemm.cpp):
// affine (w = s * q + b in float32, columns in codec order: decode.h) and the fp modes
// (fp_tile.h, natural order). A decoder is f(cols, r0, nr, c0, nc, dst): rows [r0, r0+nr) x
// columns [c0, c0+nc) of the packed matrix with `cols` columns to dst [nr, nc] float32.
#pragma once

#include <cstdint>

#include "decode.h"
#include "fp_tile.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

// Decodes rows [r0, r0+nr) x columns [c0, c0+nc) of the packed matrix (c0, nc multiples of 32)
// to dst [nr, nc] float32, columns in codec order.
template <int BITS, typename T>
void decode_tile(const QmmArgs& a, int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* dst) {
  using Blk = Block32<BITS>;
  const int64_t row_bytes = cols / 32 * Blk::kBytes, groups = cols / a.group_size;
  const int gshift = block_to_group_shift(a.group_size);
  const T* S = static_cast<const T*>(a.scales);
  const T* B = static_cast<const T*>(a.biases);
  for (int64_t r = 0; r < nr; ++r) {
    const uint8_t* row = a.wq + (r0 + r) * row_bytes;
    const T* s = S + (r0 + r) * groups;
    const T* b = B + (r0 + r) * groups;
    float* d = dst + r * nc;
    for (int64_t kb = c0 / 32; kb < (c0 + nc) / 32; ++kb, d += 32) {
      f32x16 v0, v1;
      Blk::decode(row + kb * Blk::kBytes, v0, v1);
      const f32x16 sv = splat16(static_cast<float>(s[kb >> gshift]));
      const f32x16 bv = splat16(static_cast<float>(b[kb >> gshift]));
      store16(d, v0 * sv + bv);
      store16(d + 16, v1 * sv + bv);
    }
  }
}

// decode_tile as a tile decoder: f(cols, r0, nr, c0, nc, dst) (the GEMM drivers' interface).
template <int BITS, typename T>
auto affine_decoder(const QmmArgs& a) {
  return [&a](int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* dst) {
    decode_tile<BITS, T>(a, cols, r0, nr, c0, nc, dst);
  };
}

// The fp-mode tile decoder (fp_tile.h): natural column order.
inline auto fp_decoder(const QmmArgs& a) {
  return [&a](int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* dst) {
    decode_fp_tile(a, cols, r0, nr, c0, nc, dst);
  };
}

}  // namespace cpu
}  // namespace torch_qmm
