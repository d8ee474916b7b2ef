// The chunk driver's kernel (chunk_driver.h) for GGUF super-blocks, shared by the three exact
// families (gguf_f32.cpp, gguf_chunked.cpp, gguf_avx2.cpp): a chunk is one super-block of 256
// weights, which holds its own scales and offsets (Fmt::block applies both); side data:
// Fmt::kSide floats per super-block (sub-block sums of x, for the hoisted offsets). K is whole
// super-blocks, so nothing is left for rest().
//
// Fmt, a format of one family, provides:
//   using X; kXPerBlock, kSide, kBlockBytes   prepared-x type; X values and side floats per
//                                             super-block and x row; bytes per super-block
//   tile_rows(mb)                             W rows per tile at mb rows of x
//   kThreeRowBlocks (optional)                blocks of 3 rows of x (chunk_driver.h)
//   prepare(x, xc, side)                      one super-block of an x row (256 floats)
//   block<R, MB>(blk, xc, side, acc)          acc[r][m] += super-block blk[r] times x row m
// Vec, the family's vector width: using Acc; zero(), reduce(acc); slab_bytes(mb) (chunk_driver.h);
// and
//   prefetch<R>(row, b, row_bytes, block_bytes)   the next tile's blocks, ahead of their use
#pragma once

#include <cstdint>

#include "chunk_driver.h"
#include "gguf_chunked.h"
#include "hsum.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "chunk.h"
#endif

namespace torch_qmm {
namespace cpu {

template <typename Fmt, typename Vec>
struct GgufChunkKernel {
  using X = typename Fmt::X;
  using Acc = typename Vec::Acc;
  static constexpr int64_t kXPerChunk = Fmt::kXPerBlock, kSidePerChunk = Fmt::kSide;
  static constexpr int kMaxXBlock = 4;
  static constexpr bool kSubnormalOperands = chunk::SubnormalOperands<Fmt>::value;
  static constexpr bool kThreeRowBlocks = chunk::ThreeRowBlocks<Fmt>::value;
  static constexpr int64_t slab_bytes(int mb) { return Vec::slab_bytes(mb); }
  static constexpr int tile_rows(int mb) { return Fmt::tile_rows(mb); }

  const GgufArgs& a;
  int64_t chunks, row_bytes, rest_floats = 0, part_chunks = 1;
  explicit GgufChunkKernel(const GgufArgs& args) : a(args), chunks(a.K / 256), row_bytes(chunks * Fmt::kBlockBytes) {}

  const uint8_t* row(int64_t n) const { return a.blocks + n * row_bytes; }
  void prepare_part(const float* x, int64_t c0, int64_t c1, X* xc, float* side, float*) const {
    for (int64_t b = c0; b < c1; ++b) Fmt::prepare(x + 256 * b, xc + b * kXPerChunk, side + kSidePerChunk * b);
  }
  template <int R>
  void start_tile(int64_t, int64_t, int64_t) const {}

  template <int R, int MB>
  __attribute__((always_inline)) inline void chunk(int64_t, const uint8_t* const (&row)[R], int64_t b,
                                                   const X* const (&xc)[MB], const float* const (&side)[MB],
                                                   Acc (&acc)[R][MB]) const {
    Vec::template prefetch<R>(row, b, row_bytes, Fmt::kBlockBytes);
    const uint8_t* blk[R];
    for (int r = 0; r < R; ++r) blk[r] = row[r] + b * Fmt::kBlockBytes;
    Fmt::template block<R, MB>(blk, xc, side, acc);
  }

  static Acc zero() { return Vec::zero(); }
  static float reduce(Acc v) { return hsum(v); }
  float rest(int64_t, const float*) const { return 0.0f; }
};

// y = x @ W.T through the kernel of the first of Fmts whose kType is ggml_type (false: none is).
template <typename Vec, typename... Fmts>
bool run_gguf_chunks(const GgufArgs& a, int64_t ggml_type, float* y) {
  return ((ggml_type == Fmts::kType ? (chunk::run(GgufChunkKernel<Fmts, Vec>(a), a.x, a.M, a.N, a.K, y), true) : false) || ...);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 float32 lanes; each row's block of the next tile (R rows on) prefetched into L2.
struct GgufZmm {
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static constexpr int64_t slab_bytes(int) { return 0; }  // one pass over K (chunk_driver.h)
  template <int R>
  __attribute__((always_inline)) static inline void prefetch(const uint8_t* const (&row)[R], int64_t b, int64_t row_bytes,
                                                             int64_t block_bytes) {
    for (int r = 0; r < R; ++r)
      for (int64_t off = 0; off < block_bytes; off += 64) chunk::prefetch_l2(row[r], R * row_bytes + b * block_bytes + off);
  }
};

// GgufZmm walking K in slabs at 4 rows of x (chunk_driver.h), for the bfloat16 dot-product
// kernels (gguf_chunked.cpp): their x per super-block and row of x (512 bytes per bfloat16 term)
// is read once per W row of the tile, from L2 in one pass. On a 2-core Zen 4, 4096 x 14336,
// Q4_K bfloat16 x: M=4 3.8 -> 2.8 ms, M=8 6.6 -> 4.9; float16 x M=8 10.8 -> 7.6. The float32
// kernels (gguf_f32.cpp) lost 0-40% with slabs there and keep one pass.
struct GgufZmmSlabs : GgufZmm {
  static constexpr int64_t slab_bytes(int mb) { return mb >= 4 ? chunk::kSlabBytes : 0; }
};
#endif

}  // namespace cpu
}  // namespace torch_qmm
