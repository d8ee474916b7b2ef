// Affine bits 2-8, transpose=True, small to medium M: the chunk kernels, AVX-512 only (the
// multipliers of chunk.h on the driver of chunk_driver.h). This file defines the affine kernel:
// x prepared for the multiplier, per-lane scales per chunk, the bias hoisted out of the chunk
// loop, and the K % (codes per chunk) tail done with the 32-code blocks of decode.h (x in codec
// order). Tiles: R W rows x MB x rows (tile_rows; M=1: 4 W rows share each x load; while a tile
// runs the next tile's rows, scales and biases are prefetched into L2).
//
// x outside [2^-98, 2^100] in magnitude, or not finite, goes to the fused kernel instead
// (x_in_range). Measurements: benchmarks/README.md.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "chunk.h"
#include "chunk_driver.h"
#include "decode.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

bool f32_chunks_avoided() {
  const char* v = std::getenv("TORCH_QMM_CPU_NO_F32_CHUNKS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

using namespace chunk;

// One row of x, whole chunks [c0, c1) -> xw for F32Multiplier (lanes of vector j times
// 2^-(BITS j): exact in range).
template <int BITS>
void prepare_chunks(const float* x, int64_t c0, int64_t c1, float* xw, F32Multiplier<BITS>) {
  using C = F32Multiplier<BITS>;
  constexpr int kCodes = kCodesPerChunk<BITS>;
  for (int64_t c = c0; c < c1; ++c)
    for (int j = 0; j < C::kVectors; ++j)
      for (int l = 0; l < 16; ++l) xw[C::kXPerChunk * c + 16 * j + l] = x[kCodes * c + C::code(j, l)] * C::x_factor(j);
}

#if defined(__AVX512BF16__)
// One row of x, whole chunks [c0, c1) -> P bfloat16 terms per element for Bf16Multiplier<P, BITS>, in plane
// order (xb[c][plane j][term t][lane i] for code Planes::code(j, i), times 2^x_shift(j)): term t
// = what terms 0..t-1 left, rounded to nearest even. Every float32 is the exact sum of its 3
// terms (8 significant bits each); float16 of its first 2. Scaling by 2^x_shift is exact.
template <int P, int BITS>
void prepare_chunks(const float* x, int64_t c0, int64_t c1, uint16_t* xb, Bf16Multiplier<P, BITS>) {
  using Geo = Planes<BITS>;
  constexpr int kCodes = kCodesPerChunk<BITS>;
  for (int64_t c = c0; c < c1; ++c)
    for (int j = 0; j < Geo::kCount; ++j)
      for (int i = 0; i < 32; ++i) {
        float rest = x[kCodes * c + Geo::code(j, i)] * float(1 << Geo::x_shift(j));  // exact: in range
        for (int t = 0; t < P; ++t) {
          const c10::BFloat16 term(rest);
          xb[c * Bf16Multiplier<P, BITS>::kXPerChunk + (j * P + t) * 32 + i] = term.x;
          rest -= static_cast<float>(term);
        }
      }
}
#endif

// The affine kernel (chunk_driver.h) for scales / biases of type T, group size G, multiplier C.
template <typename T, int G, typename C>
struct AffineKernel {
  using X = typename C::X;
  using Acc = __m512;
  static constexpr int kBits = C::kBits, kCodes = kCodesPerChunk<kBits>;
  static constexpr int64_t kXPerChunk = C::kXPerChunk, kSidePerChunk = 0;
  static constexpr int kMaxXBlock = C::kMaxXBlock;
  static constexpr int64_t slab_bytes(int) { return 0; }  // one pass over K (chunk_driver.h)
  // W rows per tile for MB rows of x (registers: 2 * R * MB accumulators).
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 4 : 2; }

  const QmmArgs& a;
  int64_t chunks, row_bytes, groups, tail, rest_floats, part_chunks = chunks_per_group(G, kCodes);
  explicit AffineKernel(const QmmArgs& args)
      : a(args), chunks(a.K / kCodes), row_bytes(a.K * kBits / 8), groups(a.K / G),
        tail(a.K - chunks * kCodes), rest_floats(tail + groups) {}

  const uint8_t* row(int64_t n) const { return a.wq + n * row_bytes; }

  // rest: the K tail in codec order (tail floats), then the sum of x over each group.
  void prepare_part(const float* x, int64_t c0, int64_t c1, X* xc, float*, float* rest) const {
    prepare_chunks(x, c0, c1, xc, C{});
    const int64_t kw = chunks * kCodes;
    const bool last = c1 == chunks;
    if (last)
      for (int64_t p = 0; p < tail; ++p) rest[p] = x[kw + codec_to_natural(kBits, p)];
    group_sums(x, G, c0 * kCodes / G, last ? groups : c1 * kCodes / G, rest + tail);
  }

  template <int R>
  void start_tile(int64_t n, int64_t c0, int64_t c1) const {
    prefetch_params<T, R>(a, n, groups, c0 * kCodes / G, std::min(groups, (c1 * kCodes + G - 1) / G));
  }

  template <int R, int MB>
  __attribute__((always_inline)) inline void chunk(int64_t n, const uint8_t* const (&row)[R], int64_t c,
                                                   const X* const (&xc)[MB], const float* const (&)[MB],
                                                   __m512 (&acc)[R][MB]) const {
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      // The same chunk of the next tile's row r: the rows are contiguous.
      prefetch_l2(row[r], R * row_bytes + c * kChunkBytes<kBits>);
      w[r] = load_chunk<kBits>(row[r] + c * kChunkBytes<kBits>);
    }
    __m512 p[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) p[r][m] = _mm512_setzero_ps();
    C::template dot<R, MB>(w, xc, p);
    for (int r = 0; r < R; ++r) {
      const T* s = static_cast<const T*>(a.scales) + (n + r) * groups;
      const __m512 sl = chunk_lanes<T, G, kBits>(s + c * kCodes / G);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(p[r][m], sl, acc[r][m]);
    }
  }

  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

  // The K tail (whole blocks of 32, x in codec order) and the hoisted bias of W row n, in one
  // vector of partial sums (masked loads for the groups past whole vectors of 16) reduced once:
  // per W row and x row, so at small layers a horizontal sum per block would cost as much as a
  // chunk (benchmarks/k_tails.py: K = 576 and 960, SmolLM2's widths, at the ns per weight of
  // whole-chunk K).
  float rest(int64_t n, const float* xrest) const {
    using Blk = Block32<kBits>;
    const int64_t kb0 = chunks * kCodes / 32, blocks = a.K / 32;
    const T* s = static_cast<const T*>(a.scales) + n * groups;
    const T* b = static_cast<const T*>(a.biases) + n * groups;
    const uint8_t* wrow = row(n);
    const float* xsum = xrest + tail;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t kb = kb0; kb < blocks; ++kb) {
      f32x16 v0, v1;
      Blk::decode(wrow + kb * Blk::kBytes, v0, v1);
      const float* xk = xrest + (kb - kb0) * 32;
      const __m512 dot = _mm512_fmadd_ps((__m512)v1, _mm512_loadu_ps(xk + 16), _mm512_mul_ps((__m512)v0, _mm512_loadu_ps(xk)));
      acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(static_cast<float>(s[kb * 32 / G])), acc);
    }
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 k = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      __m512 bv;
      if constexpr (std::is_same_v<T, float>)
        bv = _mm512_maskz_loadu_ps(k, b + g);
      else {
        const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(__mmask32(k), b + g));
        if constexpr (std::is_same_v<T, c10::Half>)
          bv = _mm512_cvtph_ps(h);
        else
          bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      acc = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(k, xsum + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
};

template <typename C>
void run_multiplier(const QmmArgs& a, float* y) {
  dispatch_bits_dtype(C::kBits, a.dtype, [&](auto, auto t) {
    using T = decltype(t);
    auto with_group = [&](auto gc) {
      constexpr int G = decltype(gc)::value;
      chunk::run(AffineKernel<T, G, C>(a), a.x, a.M, a.N, a.K, y);
    };
    if (a.group_size == 32) with_group(std::integral_constant<int, 32>{});
    else if (a.group_size == 64) with_group(std::integral_constant<int, 64>{});
    else with_group(std::integral_constant<int, 128>{});
  });
}

#if defined(__AVX512BF16__)
template <int BITS>
void run_bf16(const QmmArgs& a, float* y) {
  switch (a.x_bf16_terms) {
    case 1: return run_multiplier<Bf16Multiplier<1, BITS>>(a, y);
    case 2: return run_multiplier<Bf16Multiplier<2, BITS>>(a, y);
    default: return run_multiplier<Bf16Multiplier<3, BITS>>(a, y);
  }
}
#endif

// Whether the float32 multiplier is there for `a`'s format (4-bit and 8-bit), unless
// TORCH_QMM_CPU_NO_F32_CHUNKS=1 steps it aside (then the AVX2 kernels serve, as on CPUs without
// AVX-512); and whether it takes `a`'s rows, up to f32_affine_max_rows.
bool f32_format(const QmmArgs& a) { return (a.bits == 4 || a.bits == 8) && !f32_chunks_avoided(); }
bool f32_serves(const QmmArgs& a) { return f32_format(a) && a.M >= 1 && a.M <= f32_affine_max_rows(a.bits); }

#if defined(__AVX512BF16__)
// Whether the float32 kernels go first for `a`: float32 x (three bfloat16 terms) on every CPU,
// where the float32 multiplier or the AVX2 kernels serve (three vdpbf16ps per chunk lose to
// their FMAs by 1.6-2.4x at M = 1-8 on the AVX-512 + AMX Xeon measured); bfloat16 and float16 x
// (one and two terms) where float32_fma_first() says so (benchmarks/README.md, "Routes on an
// AVX-512 Xeon").
bool float32_first(const QmmArgs& a) {
  if (a.x_bf16_terms >= 3) return f32_serves(a) || avx2_chunked_multiplier(a) != nullptr;
  return f32_serves(a) && float32_fma_first();
}

// Whether the bfloat16 multipliers are in play for `a`: not where float32_fma_first() and the
// float32 multiplier is there for the format, at any M: on the Xeon measured they lose to it,
// and past its rows to the GEMM route (1.4-2.7x at M = 16-64: benchmarks/README.md, "Float32
// kernels past 15 rows").
bool bf16_chunks(const QmmArgs& a) {
  return !a.avoid_bf16 && !float32_first(a) && !(float32_fma_first() && f32_format(a));
}
#endif

// The AVX-512 affine multiplier that serves `a`, or null.
const char* affine_multiplier(const QmmArgs& a) {
  if (a.bits < 2 || a.bits > 8 || a.bits == 7) return nullptr;
  const bool stream = a.bits == 3 || a.bits == 5 || a.bits == 6;
  if (stream && !kHaveStreamChunks) return nullptr;
  const int64_t chunk_codes = stream ? 32 : 512 / a.bits;  // kCodesPerChunk
  if (a.M < 1 || a.K < chunk_codes) return nullptr;  // at least one chunk
  if (a.group_size != 32 && a.group_size != 64 && a.group_size != 128) return nullptr;
  const char* name = nullptr;
#if defined(__AVX512BF16__)
  const bool bf16 = bf16_chunks(a);
  if (bf16 && a.M <= chunked_max_rows(a.bits, a.x_bf16_terms))
    name = a.x_bf16_terms == 1 ? Bf16Multiplier<1, 4>::kName
           : a.x_bf16_terms == 2 ? Bf16Multiplier<2, 4>::kName : Bf16Multiplier<3, 4>::kName;
  if (bf16 && name == nullptr) return nullptr;
#endif
  if (name == nullptr && f32_serves(a)) name = F32Multiplier<4>::kName;
  return name != nullptr && a.x_in_range ? name : nullptr;
}

void run_affine(const QmmArgs& a, float* y) {
#if defined(__AVX512BF16__)
  if (bf16_chunks(a)) {
    switch (a.bits) {
      case 2: return run_bf16<2>(a, y);
      case 4: return run_bf16<4>(a, y);
      case 8: return run_bf16<8>(a, y);
#if defined(__AVX512VBMI__)
      case 3: return run_bf16<3>(a, y);
      case 5: return run_bf16<5>(a, y);
      case 6: return run_bf16<6>(a, y);
#endif
      default: TORCH_CHECK(false, "qmm: no affine chunk kernel for bits ", a.bits, " (qmm_t_chunked_multiplier)");
    }
  }
#endif
  if (a.bits == 8) return run_multiplier<F32Multiplier<8>>(a, y);
  run_multiplier<F32Multiplier<4>>(a, y);
}

}  // namespace

#else  // no AVX-512: the fused kernel serves affine.

namespace {
const char* affine_multiplier(const QmmArgs&) { return nullptr; }
void run_affine(const QmmArgs&, float*) { TORCH_CHECK(false, "qmm: the affine chunk kernels need AVX-512"); }
}  // namespace

#endif

// AVX-512 first (affine), then AVX2 (avx2_chunked.cpp).
const char* qmm_t_chunked_multiplier(const QmmArgs& a) {
  if (a.mode == Mode::kAffine)
    if (const char* name = affine_multiplier(a)) return name;
  return avx2_chunked_multiplier(a);
}

void qmm_t_chunked(const QmmArgs& a, float* y) {
  if (a.mode == Mode::kAffine && affine_multiplier(a) != nullptr) return run_affine(a, y);
  avx2_chunked(a, y);
}

}  // namespace cpu
}  // namespace torch_qmm
