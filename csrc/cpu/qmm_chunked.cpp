// Bits 2-8, transpose=True, small to medium M: the chunk kernels of chunk.h, AVX-512 only.
// This file prepares x, walks W and picks the tiles.
//
// Work: W rows go out in spans of kSpanRows from a shared counter, so a thread that loses its
// core to another process mid-call leaves its share to the others (the OpenMP barrier at the
// end still waits for it to get a core back). Tried: helpers via at::launch with no barrier at
// all: better medians when the machine is loaded, but the inter-op helper then competes with
// OpenMP threads still spinning after the previous op: 3.6-3.9 ms instead of ~2.3 ms (M=1).
// Within a span, the rows of x go in blocks of 4/2/1 (x_block_rows); each block runs over the
// whole span, which is still in L2 for the next block (320 KB for 4-bit at K=5120), so W comes
// from memory once and each chunk is decoded once per block. A tile is R W rows x MB x rows
// (tile_rows; M=1: 4 W rows share each x load; while a tile runs the next tile's rows are
// prefetched into L2, which let a core stream ~16 GB/s instead of ~11).
// The K % (codes per chunk) tail is done with the 32-code blocks of decode.h, x in codec order.
//
// x outside [2^-98, 2^100] in magnitude, or not finite, goes to the fused kernel instead
// (x_in_range).
//
// Measured on a 2-core Zen 4 (14336x5120 4-bit, benchmarks/README.md): M=1 float32 x takes
// 1.66 ms with 3 bfloat16 terms against 1.75 ms with the float32 chunk; bfloat16 x 1.34 ms.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "decode.h"
#include "chunk.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

using namespace chunk;

constexpr int64_t kSpanRows = 128;  // W rows per work item (320 KB at K=5120)

// W rows per tile for MB rows of x (registers: 2 * R * MB accumulators). M=1: 8 W rows was
// slower than 4 (spills). Blocks of 8 x rows (R = 1) were slower than two blocks of 4: each W
// chunk then meets 2 KB of x, which no longer stays in L1 (M=8: 7.4 ms against ~6).
constexpr int tile_rows(int mb) { return mb == 1 ? 4 : mb == 2 ? 4 : 2; }

// The largest block of x rows (4, 2, 1) that fits in `left`.
inline int x_block_rows(int64_t left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }

// The K % (codes per chunk) tail (whole blocks of 32, x in codec order) and the hoisted bias,
// for W row n and one row of x (its xtail, xsum).
template <typename T, int G, int BITS>
float row_rest(const QmmArgs& a, int64_t n, const float* xtail, const float* xsum) {
  using Blk = Block32<BITS>;
  const int64_t groups = a.K / G, kb0 = a.K / kCodesPerChunk<BITS> * kCodesPerChunk<BITS> / 32, blocks = a.K / 32;
  const T* s = static_cast<const T*>(a.scales) + n * groups;
  const T* b = static_cast<const T*>(a.biases) + n * groups;
  const uint8_t* row = a.wq + n * (a.K * BITS / 8);
  float t = 0.0f;
  for (int64_t kb = kb0; kb < blocks; ++kb) {
    f32x16 v0, v1;
    Blk::decode(row + kb * Blk::kBytes, v0, v1);
    const float* xk = xtail + (kb - kb0) * 32;
    t += static_cast<float>(s[kb * 32 / G]) * hsum16(v0 * load16(xk) + v1 * load16(xk + 16));
  }
  __m512 bacc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16) {
    __m512 bv;
    if constexpr (std::is_same_v<T, float>)
      bv = _mm512_loadu_ps(b + g);
    else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + g));
      if constexpr (std::is_same_v<T, c10::Half>)
        bv = _mm512_cvtph_ps(h);
      else
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    bacc = _mm512_fmadd_ps(bv, _mm512_loadu_ps(xsum + g), bacc);
  }
  t += _mm512_reduce_add_ps(bacc);
  for (; g < groups; ++g) t += static_cast<float>(b[g]) * xsum[g];
  return t;
}

// Prepared x: per row of x, C::kXPerChunk values per chunk (x), the K % (codes per chunk) tail in
// codec order (tail),
// and the sum over each group (sum).
template <typename C>
struct PreparedX {
  std::vector<typename C::X> x;
  std::vector<float> tail, sum;
  int64_t x_stride, tail_stride, sum_stride;
};

// W rows [n0, n1) times x rows [m0, m0 + MB).
template <typename T, int G, typename C, int MB>
void run_block(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, const PreparedX<C>& px, float* y) {
  constexpr int R = tile_rows(MB);
  const typename C::X* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = px.x.data() + (m0 + m) * px.x_stride;
  auto finish = [&](int64_t n, int r, int m, float part) {
    const int64_t row = m0 + m;
    y[row * a.N + n + r] = part + row_rest<T, G, C::kBits>(a, n + r, px.tail.data() + row * px.tail_stride,
                                                 px.sum.data() + row * px.sum_stride);
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    float out[R][MB];
    tile<T, R, MB, G, C>(a, n, xr, out);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) finish(n, r, m, out[r][m]);
  }
  for (; n < n1; ++n) {
    float out[1][MB];
    tile<T, 1, MB, G, C>(a, n, xr, out);
    for (int m = 0; m < MB; ++m) finish(n, 0, m, out[0][m]);
  }
}

template <typename T, int G, typename C>
void run_span(const QmmArgs& a, int64_t i, const PreparedX<C>& px, float* y) {
  const int64_t n0 = i * kSpanRows, n1 = std::min(a.N, n0 + kSpanRows);
  for (int64_t m0 = 0; m0 < a.M;) {
    const int mb = std::is_same_v<C, F32Chunk> ? 1 : x_block_rows(a.M - m0);
    if constexpr (std::is_same_v<C, F32Chunk>) {  // one row at a time (routed at M = 1 only)
      run_block<T, G, C, 1>(a, n0, n1, m0, px, y);
    } else {
      switch (mb) {
        case 4: run_block<T, G, C, 4>(a, n0, n1, m0, px, y); break;
        case 2: run_block<T, G, C, 2>(a, n0, n1, m0, px, y); break;
        default: run_block<T, G, C, 1>(a, n0, n1, m0, px, y); break;
      }
    }
    m0 += mb;
  }
}

template <typename C>
void run(const QmmArgs& a, const PreparedX<C>& px, float* y) {
  const int64_t spans = (a.N + kSpanRows - 1) / kSpanRows;
  dispatch_bits_dtype(C::kBits, a.dtype, [&](auto, auto t) {
    using T = decltype(t);
    auto with_group = [&](auto gc) {
      constexpr int G = decltype(gc)::value;
      std::atomic<int64_t> next{0};
      at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), spans), 1, [&](int64_t, int64_t) {
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < spans;) run_span<T, G, C>(a, i, px, y);
      });
    };
    if (a.group_size == 32) with_group(std::integral_constant<int, 32>{});
    else if (a.group_size == 64) with_group(std::integral_constant<int, 64>{});
    else with_group(std::integral_constant<int, 128>{});
  });
}

// One row of x, whole chunks -> xw for F32Chunk (lanes of vector j times 2^-4j: exact in range).
void prepare_row(const float* x, int64_t chunks, float* xw, F32Chunk) {
  static constexpr float kPow[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f};
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l) xw[128 * c + 16 * j + l] = x[128 * c + 8 * l + j] * kPow[j];
}

#if defined(__AVX512BF16__)
// One row of x, whole chunks -> P bfloat16 terms per element for Bf16Chunk<P, BITS>, in plane
// order (xb[c][plane j][term t][lane i] for code Planes::code(j, i), times 2^x_shift(j)): term t
// = what terms 0..t-1 left, rounded to nearest even. Every float32 is the exact sum of its 3
// terms (8 significant bits each); float16 of its first 2. Scaling by 2^x_shift is exact.
template <int P, int BITS>
void prepare_row(const float* x, int64_t chunks, uint16_t* xb, Bf16Chunk<P, BITS>) {
  using Geo = Planes<BITS>;
  constexpr int kCodes = kCodesPerChunk<BITS>;
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < Geo::kCount; ++j)
      for (int i = 0; i < 32; ++i) {
        float rest = x[kCodes * c + Geo::code(j, i)] * float(1 << Geo::x_shift(j));  // exact: in range
        for (int t = 0; t < P; ++t) {
          const c10::BFloat16 term(rest);
          xb[c * Bf16Chunk<P, BITS>::kXPerChunk + (j * P + t) * 32 + i] = term.x;
          rest -= static_cast<float>(term);
        }
      }
}
#endif

template <typename C>
void prepare_and_run(const QmmArgs& a, float* y) {
  constexpr int kCodes = kCodesPerChunk<C::kBits>;
  const int64_t K = a.K, chunks = K / kCodes, kw = chunks * kCodes, groups = K / a.group_size;
  PreparedX<C> px;
  px.x_stride = chunks * C::kXPerChunk;
  px.tail_stride = K - kw;
  px.sum_stride = groups;
  px.x.resize(a.M * px.x_stride);
  px.tail.resize(a.M * px.tail_stride);
  px.sum.resize(a.M * groups);
  for (int64_t m = 0; m < a.M; ++m) {
    const float* xm = a.x + m * K;
    prepare_row(xm, chunks, px.x.data() + m * px.x_stride, C{});
    for (int64_t p = kw; p < K; ++p)
      px.tail[m * px.tail_stride + p - kw] = xm[kw + codec_to_natural(C::kBits, p - kw)];
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.0f;
      for (int i = 0; i < a.group_size; ++i) t += xm[g * a.group_size + i];
      px.sum[m * groups + g] = t;
    }
  }
  run<C>(a, px, y);
}

#if defined(__AVX512BF16__)
template <int BITS>
void run_bf16(const QmmArgs& a, float* y) {
  switch (a.x_bf16_terms) {
    case 1: return prepare_and_run<Bf16Chunk<1, BITS>>(a, y);
    case 2: return prepare_and_run<Bf16Chunk<2, BITS>>(a, y);
    default: return prepare_and_run<Bf16Chunk<3, BITS>>(a, y);
  }
}
#endif

}  // namespace

const char* qmm_t_chunked_tile(const QmmArgs& a) {
  if (a.mode != Mode::kAffine) return nullptr;
  if (a.bits < 2 || a.bits > 8 || a.bits == 7) return nullptr;
  const bool stream = a.bits == 3 || a.bits == 5 || a.bits == 6;
  if (stream && !kHaveStreamChunks) return nullptr;
  const int64_t chunk_codes = stream ? 32 : 512 / a.bits;  // kCodesPerChunk
  if (a.M < 1 || a.K < chunk_codes) return nullptr;  // at least one chunk
  if (a.group_size != 32 && a.group_size != 64 && a.group_size != 128) return nullptr;
  const char* tile = nullptr;
#if defined(__AVX512BF16__)
  if (!a.avoid_bf16 && a.M <= chunked_max_rows(a.bits, a.x_bf16_terms))
    tile = a.x_bf16_terms == 1 ? "bf16x1" : a.x_bf16_terms == 2 ? "bf16x2" : "bf16x3";
  if (!a.avoid_bf16 && tile == nullptr) return nullptr;
#endif
  if (tile == nullptr && a.M == 1 && a.bits == 4) tile = "f32";  // the float32 chunk: 4-bit, M = 1
  return tile != nullptr && x_in_range(a.x, a.M * a.K) ? tile : nullptr;
}

void qmm_t_chunked(const QmmArgs& a, float* y) {
#if defined(__AVX512BF16__)
  if (!a.avoid_bf16) {
    switch (a.bits) {
      case 2: return run_bf16<2>(a, y);
      case 4: return run_bf16<4>(a, y);
      case 8: return run_bf16<8>(a, y);
#if defined(__AVX512VBMI__)
      case 3: return run_bf16<3>(a, y);
      case 5: return run_bf16<5>(a, y);
      case 6: return run_bf16<6>(a, y);
#endif
      default: TORCH_CHECK(false, "affine_qmm: no chunk kernel for bits ", a.bits, " (qmm_t_chunked_tile)");
    }
  }
#endif
  prepare_and_run<F32Chunk>(a, y);
}

#else  // no AVX-512: the fused kernel serves these shapes.

const char* qmm_t_chunked_tile(const QmmArgs&) { return nullptr; }
void qmm_t_chunked(const QmmArgs&, float*) {
  TORCH_CHECK(false, "affine_qmm: the chunk kernels need AVX-512");
}

#endif

}  // namespace cpu
}  // namespace torch_qmm
