// The AVX2 chunk kernels, transpose=True, small M, on any x86 CPU with AVX2 and FMA (AVX-512 ones
// included): the multipliers of chunk_avx2.h on the driver of chunk_driver.h, for affine 4-bit
// and 8-bit (U4Multiplier, U8Multiplier), 3, 5 and 6-bit (StreamMultiplier) and the fp modes of csrc/format_spec.h: e2m1 elements (E2m1Multiplier: mxfp4,
// nvfp4) and e4m3 elements (E4m3Multiplier: mxfp8). This file defines the one AVX2 kernel they share: x rearranged into the
// multiplier's vector order, the per-lane scales of each chunk (fp: uint8 codes through a
// 256-entry table, the multiplier's unit folded in; affine: the scales' float dtype), the affine
// bias hoisted out of the chunk loop, and the K tail past the last whole chunk, code by code.
// Measurements: benchmarks/README.md.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "../format.h"
#include "../fp_codec.h"
#include "chunk_avx2.h"
#include "chunk_driver.h"
#include "hsum.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"
#include "row_params_avx2.h"

namespace torch_qmm {
namespace cpu {

bool avx2_chunks_avoided() {
  const char* v = std::getenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

bool subnormal_fields_enabled() {
  const int64_t v = chunk::env_count("TORCH_QMM_CPU_SUBNORMAL_FIELDS", 0, 1, "0 or 1");
  if (v >= 0) return v == 1;
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace chunk;

template <int G>
using Group = std::integral_constant<int, G>;

// The fp formats' scales: uint8 codes. scale(i) is the value of code i over the multiplier's unit
// (exact: a power-of-two factor, and every result, subnormal ones included, is representable);
// element(c): the value of element code c; no biases.
struct FpScales {
  static constexpr bool kBiases = false;
  const uint8_t* codes;
  const float* over_unit;  // by code
  const float* element_of;
  ScaleKind kind;
  float scale(int64_t i) const { return over_unit[codes[i]]; }
  float tail_scale(int64_t i) const { return fp::scale_value(kind, codes[i]); }
  float element(uint32_t c) const { return element_of[c]; }
  float bias(int64_t) const { return 0.0f; }
  void prefetch(int64_t i0, int64_t count) const { prefetch_range(codes, i0, count); }
};

// The affine format's scales and biases, in the float type T; element(c) = c.
template <typename T>
struct AffineScales {
  static constexpr bool kBiases = true;
  const T* scales;
  const T* biases;
  float scale(int64_t i) const { return static_cast<float>(scales[i]); }
  float tail_scale(int64_t i) const { return static_cast<float>(scales[i]); }
  float element(uint32_t c) const { return float(c); }
  float bias(int64_t i) const { return static_cast<float>(biases[i]); }
  void prefetch(int64_t i0, int64_t count) const {
    prefetch_range(scales, i0 * int64_t(sizeof(T)), count * int64_t(sizeof(T)));
    prefetch_range(biases, i0 * int64_t(sizeof(T)), count * int64_t(sizeof(T)));
  }
};

// The AVX2 kernel (chunk_driver.h) for group size G, multiplier C and scales S: C's vectors times
// x, summed per chain h (C::kHalves), then times the chain's per-lane scales (the chains added
// first where they share them); rest(): the K tail and (affine) the hoisted bias, sum_g b[g] *
// (sum of x over group g), by offset_sum (row_params_avx2.h): one 8-lane FMA per 8 groups, where
// a product and an add per group would cost as much FMA-pipe work as 8 of the group's codes.
template <int G, typename C, typename S>
struct Avx2Kernel {
  using X = float;
  // C::kNanCodes: codes that decode to NaN are not decoded as such; the accumulator also ORs the
  // chunks' NaN-code masks, and a row that met one sums to NaN (as any product with it would).
  struct NanAcc {
    __m256 sum;
    __m256i nan;
  };
  using Acc = std::conditional_t<C::kNanCodes, NanAcc, __m256>;
  static constexpr int kCodes = C::kCodes, kHalves = C::kHalves;
  static constexpr bool kHalvesShareScales = C::template halves_share_scales<G>();
  static constexpr int64_t kXPerChunk = C::kXPerChunk, kSidePerChunk = 0;
  // Affine: blocks of at most 2 rows of x, which tiles of 2 W rows take together. At 4 rows (one W
  // row per tile) each W row reads 4 rows of prepared x from L2 (57 KB each at K = 14336: no slab
  // keeps them in L1 here, below), twice the x traffic per product. In-process A/B on a Zen 3
  // (TORCH_QMM_CPU_X_BLOCK, 4096 x 14336, 2 threads, float32 scales, median of 25): 4-bit M=8
  // 13.58 -> 11.33 ms and 15.29 -> 13.14, 8-bit M=8 15.50 -> 13.87 and 14.57 -> 12.57; M=4 4-14%.
  static constexpr int kMaxXBlock = S::kBiases ? 2 : 4;
  static constexpr int64_t slab_bytes(int) { return 0; }  // one pass over K (chunk_driver.h)
  // W rows per tile for MB rows of x (registers: kHalves * R * MB partial sums, R * MB
  // accumulators and the chunk's vectors).
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 2 : 1; }

  const QmmArgs& a;
  S sc;
  int64_t chunks, row_bytes, groups, tail, rest_floats, part_chunks = chunk::chunks_per_group(G, kCodes);
  Avx2Kernel(const QmmArgs& args, S scales)
      : a(args), sc(scales), chunks(a.K / kCodes), row_bytes(a.K * C::kBits / 8), groups(a.K / G),
        tail(a.K - chunks * kCodes), rest_floats(tail + (S::kBiases ? groups : 0)) {}

  const uint8_t* row(int64_t n) const { return a.wq + n * row_bytes; }

  // xc[c][j][l] = x[kCodes * c + C::code(j, l)] * C::x_factor(j, l) (exact in range); rest: the K
  // tail in natural order, then (affine) the sum of x over each group.
  void prepare_part(const float* x, int64_t c0, int64_t c1, X* xc, float*, float* rest) const {
    for (int64_t c = c0; c < c1; ++c)
      for (int j = 0; j < C::kVectors; ++j)
        for (int l = 0; l < 8; ++l) xc[kCodes * c + 8 * j + l] = x[kCodes * c + C::code(j, l)] * C::x_factor(j, l);
    const bool last = c1 == chunks;
    if (last)
      for (int64_t k = 0; k < tail; ++k) rest[k] = x[chunks * kCodes + k];
    if constexpr (S::kBiases) {
      const int64_t g0 = c0 * kCodes / G, g1 = last ? groups : c1 * kCodes / G;
      chunk::group_sums(x, G, g0, g1, rest + tail);
    }
  }

  // W streams from memory a tile ahead of its use: chunk() prefetches chunk c of the next tile's
  // rows [n+R, n+2R) while it multiplies chunk c here (the next tile takes the same slab of
  // chunks next); the scales (and biases) of the slab's groups in those rows are prefetched here.
  template <int R>
  void start_tile(int64_t n, int64_t c0, int64_t c1) const {
    const int64_t g0 = c0 * kCodes / G, g1 = std::min(groups, (c1 * kCodes + G - 1) / G);
    for (int r = 0; r < R; ++r) sc.prefetch((n + R + r) * groups + g0, g1 - g0);
  }

  template <int R, int MB>
  __attribute__((always_inline)) inline void chunk(int64_t n, const uint8_t* const (&row)[R], int64_t c,
                                                   const X* const (&xc)[MB], const float* const (&)[MB],
                                                   Acc (&acc)[R][MB]) const {
    for (int r = 0; r < R; ++r) prefetch_range(row[r], R * row_bytes + c * C::kBytes, C::kBytes);
    const uint8_t* w[R];
    for (int r = 0; r < R; ++r) w[r] = row[r] + c * C::kBytes;
    __m256 p[R][MB][kHalves];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        for (int h = 0; h < kHalves; ++h) p[r][m][h] = _mm256_setzero_ps();
    C::template dot<R, MB>(w, xc, p);
    for (int r = 0; r < R; ++r) {
      const int64_t g0 = (n + r) * groups + c * kCodes / G;
      __m256 sv[kHalves];
      C::template scale_lanes<G>([&](int i) __attribute__((always_inline)) { return sc.scale(g0 + i); }, sv);
      for (int m = 0; m < MB; ++m) {
        if constexpr (kHalvesShareScales) {
          sum_of(acc[r][m]) = _mm256_fmadd_ps(_mm256_add_ps(p[r][m][0], p[r][m][1]), sv[0], sum_of(acc[r][m]));
        } else {
          for (int h = 0; h < kHalves; ++h) sum_of(acc[r][m]) = _mm256_fmadd_ps(p[r][m][h], sv[h], sum_of(acc[r][m]));
        }
      }
      if constexpr (C::kNanCodes) {
        const __m256i nan = C::nan_codes(w[r]);
        for (int m = 0; m < MB; ++m) acc[r][m].nan = _mm256_or_si256(acc[r][m].nan, nan);
      }
    }
  }

  __attribute__((always_inline)) static inline __m256& sum_of(Acc& acc) {
    if constexpr (C::kNanCodes)
      return acc.sum;
    else
      return acc;
  }
  static Acc zero() {
    if constexpr (C::kNanCodes)
      return NanAcc{_mm256_setzero_ps(), _mm256_setzero_si256()};
    else
      return _mm256_setzero_ps();
  }
  // The lanes' sum.
  static float reduce(Acc acc) {
    if constexpr (C::kNanCodes)
      if (!_mm256_testz_si256(acc.nan, acc.nan)) return std::numeric_limits<float>::quiet_NaN();
    return hsum(sum_of(acc));
  }

  // The K tail of W row n (whole groups, code by code), then the hoisted bias.
  float rest(int64_t n, const float* xrest) const {
    const uint8_t* wrow = row(n);
    const int64_t k0 = chunks * kCodes;
    float t = 0.0f;
    for (int64_t g = k0 / G; g < groups; ++g) {
      float p = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) p += sc.element(unpack_element(wrow, k, C::kBits)) * xrest[k - k0];
      t += p * sc.tail_scale(n * groups + g);
    }
    if constexpr (S::kBiases) t += offset_sum<0>(sc.biases + n * groups, sc.scales + n * groups, xrest + tail, groups);
    return t;
  }
};

// Element values by code (e2m1: the first 16 entries).
const float* element_table(Element e) {
  struct Table {
    float v[256];
    explicit Table(Element e) {
      for (uint32_t c = 0; c < 256; ++c) v[c] = fp::element_value(e, c);
    }
  };
  static const Table e2m1(Element::kE2M1), e4m3(Element::kE4M3);
  return e == Element::kE4M3 ? e4m3.v : e2m1.v;
}

// Scale values by code over a multiplier's unit.
template <typename C>
const float* scale_table(ScaleKind kind) {
  struct Table {
    float v[256];
    explicit Table(ScaleKind kind) {
      for (uint32_t c = 0; c < 256; ++c) v[c] = fp::scale_value(kind, c) / C::kUnit;
    }
  };
  static const Table e8m0(ScaleKind::kE8M0), e4m3(ScaleKind::kE4M3);
  return kind == ScaleKind::kE8M0 ? e8m0.v : e4m3.v;
}

// f(Group<G>, multiplier) for the kernel that serves `a`'s format, bits and group size; false
// where none does.
template <typename F>
bool with_multiplier(const QmmArgs& a, F&& f) {
  const FormatSpec& spec = format_spec(a.mode);
  if (spec.element == Element::kUint) {
    auto with_group = [&](auto c) {
      if (a.group_size == 32) return f(Group<32>{}, c), true;
      if (a.group_size == 64) return f(Group<64>{}, c), true;
      if (a.group_size == 128) return f(Group<128>{}, c), true;
      return false;
    };
    if (a.bits == 3) return with_group(StreamMultiplier<3>{});
    if (a.bits == 4) return with_group(U4Multiplier{});
    if (a.bits == 5) return with_group(StreamMultiplier<5>{});
    if (a.bits == 6) return with_group(StreamMultiplier<6>{});
    if (a.bits == 8) return with_group(U8Multiplier{});
    return false;
  }
  if (spec.element == Element::kE2M1 && a.bits == 4 && a.group_size == 32) return f(Group<32>{}, E2m1Multiplier{}), true;
  if (spec.element == Element::kE2M1 && a.bits == 4 && a.group_size == 16) return f(Group<16>{}, E2m1Multiplier{}), true;
  if (spec.element == Element::kE4M3 && a.bits == 8 && a.group_size == 32) return f(Group<32>{}, E4m3Multiplier{}), true;
  return false;
}

template <int G, typename C>
void run_avx2(const QmmArgs& a, float* y) {
  const FormatSpec& spec = format_spec(a.mode);
  if constexpr (C::kAffine) {
    dispatch_bits_dtype(C::kBits, a.dtype, [&](auto, auto t) {
      using T = decltype(t);
      const AffineScales<T> s{static_cast<const T*>(a.scales), static_cast<const T*>(a.biases)};
      chunk::run(Avx2Kernel<G, C, AffineScales<T>>(a, s), a.x, a.M, a.N, a.K, y);
    });
  } else {
    const FpScales s{static_cast<const uint8_t*>(a.scales), scale_table<C>(spec.scale), element_table(spec.element),
                     spec.scale};
    chunk::run(Avx2Kernel<G, C, FpScales>(a, s), a.x, a.M, a.N, a.K, y);
  }
}

}  // namespace

const char* avx2_chunked_multiplier(const QmmArgs& a) {
  if (avx2_chunks_avoided()) return nullptr;
  const int64_t max_rows = a.mode == Mode::kAffine ? avx2_affine_max_rows : fp_chunked_max_rows;
  if (a.M < 1 || a.M > max_rows) return nullptr;
  const char* name = nullptr;
  with_multiplier(a, [&](auto, auto c) {
    if (a.K >= decltype(c)::kCodes) name = decltype(c)::kName;
  });
  // The affine multiplier scales x by powers of two down to 2^-24 (x_in_range).
  if (name != nullptr && a.mode == Mode::kAffine && !a.x_in_range) return nullptr;
  return name;
}

void avx2_chunked(const QmmArgs& a, float* y) {
  const bool served = with_multiplier(a, [&](auto g, auto c) { run_avx2<decltype(g)::value, decltype(c)>(a, y); });
  TORCH_CHECK(served, "qmm: no AVX2 chunk kernel for mode ", format_spec(a.mode).name, ", bits ", a.bits,
              " (avx2_chunked_multiplier)");
}

#else  // no AVX2: the fused kernels (affine) and the generic path (fp modes) serve these calls.

const char* avx2_chunked_multiplier(const QmmArgs&) { return nullptr; }
void avx2_chunked(const QmmArgs&, float*) { TORCH_CHECK(false, "qmm: the AVX2 chunk kernels need AVX2 and FMA"); }

#endif

}  // namespace cpu
}  // namespace torch_qmm
