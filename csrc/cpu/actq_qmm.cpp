// CPU qmm_int8_activations: y = x @ W.T with x quantized to int8 per block of 32 along K
// (actq_x.h) and multiplied with the affine weight codes in integer arithmetic, after llama.cpp's
// Q4_x / Q8_0 dot products. An opt-in approximation (torch_qmm.activation_quantization, or
// QuantLinear(activations="int8")); the exact kernels (qmm.cpp) stay the default.
//
// With d_b the scale and q_b the codes of x block b, s_g / b_g the scale / bias of group g and q
// the weight codes (w = s_g * q + b_g):
//   y[m, n] = sum_g s_g * sum_{b in g} d_b * (sum_i q_i * q_b,i) + b_g * X_g,
//   X_g = sum_{b in g} d_b * (sum_i q_b,i)                                  (x's hoisted sums)
// The inner sums are int32 (exact); the rest is float32. y is therefore W times the dequantized x
// up to float32 rounding, and |y - W x| <= sum_b (d_b / 2) * sum_{i in b} |w_i| (+ rounding):
// the bound docs/activation-quantization.md states and tests/test_cpu_actq.py checks.
//
// Kernels (both on the chunk driver, chunk_driver.h):
//   DotKernel, 4-bit (U4Codes) and 8-bit (U8Codes), group sizes 32/64/128: one vector load of a
//     row per chunk, integer dot products, one float FMA per chunk; 256-bit (Ymm: actq_dot.h's
//     AVX2 or VNNI dot4) or 512-bit (Zmm: vpdpbusd zmm, where built for AVX512_VNNI + AVX512BW,
//     unless TORCH_QMM_CPU_NO_INT8_512=1);
//   ScalarKernel, every affine bit width, portable: the route of other bit widths, of CPUs
//     without AVX2 and of TORCH_QMM_CPU_NO_AVX2_CHUNKS=1 (as for the exact chunk kernels).
// x with Inf or NaN takes the exact kernels (no int8 code can stand for them).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../format.h"
#include "../validate.h"
#include "actq_dot.h"
#include "actq_qmm.h"
#include "actq_x.h"
#include "chunk.h"
#include "chunk_avx2.h"
#include "chunk_driver.h"
#include "row_params_avx2.h"
#include "hsum.h"
#include "qmm_kernels.h"
#include "x_rows.h"

namespace torch_qmm {
namespace cpu {
namespace actq {
namespace {

template <int G>
using Group = std::integral_constant<int, G>;

// The affine scales and biases of W, in their float type T.
template <typename T>
struct Affine {
  using Type = T;
  const T* scales;
  const T* biases;
  float scale(int64_t i) const { return static_cast<float>(scales[i]); }
  float bias(int64_t i) const { return static_cast<float>(biases[i]); }
};

// Blocks [b0, b1) of one row of x quantized (actq_x.h) into a kernel's layout: place(b, q) takes
// block b's codes, side(b, d) its scale, and xsum[g] = X_g for the groups of those blocks (b0
// and b1 on group boundaries, so a group is summed by one call).
template <typename Place, typename Side>
void quantize_blocks(const float* x, int64_t b0, int64_t b1, int G, float* xsum, Place place, Side side) {
  int8_t q[kBlock];
  for (int64_t g = b0 * kBlock / G; g < b1 * kBlock / G; ++g) xsum[g] = 0.0f;
  for (int64_t b = b0; b < b1; ++b) {
    const float d = quantize_block(x + b * kBlock, q);
    place(b, q);
    side(b, d);
    xsum[b * kBlock / G] += d * float(block_sum(q));
  }
}

// The portable kernel: a chunk is one block of 32 codes of any affine bit width, decoded code
// by code (format.h), side data the block's x scale.
template <int G, typename T>
struct ScalarKernel {
  using X = int8_t;
  using Acc = float;
  static constexpr int64_t kXPerChunk = kBlock, kSidePerChunk = 1;
  static constexpr int kMaxXBlock = 4;
  static constexpr int64_t slab_bytes(int) { return 0; }  // one pass over K (chunk_driver.h)
  static constexpr int tile_rows(int) { return 1; }

  const QmmArgs& a;
  Affine<T> w;
  int64_t chunks, row_bytes, groups, rest_floats, part_chunks = chunk::chunks_per_group(G, kBlock);
  ScalarKernel(const QmmArgs& args, Affine<T> wa)
      : a(args), w(wa), chunks(a.K / kBlock), row_bytes(a.K * a.bits / 8), groups(a.K / G), rest_floats(groups) {}

  const uint8_t* row(int64_t n) const { return a.wq + n * row_bytes; }
  void prepare_part(const float* x, int64_t c0, int64_t c1, X* xc, float* side, float* rest) const {
    quantize_blocks(
        x, c0, c1, G, rest, [&](int64_t b, const int8_t* q) {
          for (int i = 0; i < kBlock; ++i) xc[b * kBlock + i] = q[i];
        },
        [&](int64_t b, float d) { side[b] = d; });
  }
  template <int R>
  void start_tile(int64_t, int64_t, int64_t) const {}
  template <int R, int MB>
  inline void chunk(int64_t n, const uint8_t* const (&row)[R], int64_t c, const X* const (&xc)[MB],
                    const float* const (&sc)[MB], Acc (&acc)[R][MB]) const {
    for (int r = 0; r < R; ++r) {
      int32_t q[kBlock];
      for (int i = 0; i < kBlock; ++i) q[i] = int32_t(unpack_element(row[r], c * kBlock + i, a.bits));
      const float s = w.scale((n + r) * groups + c * kBlock / G);
      for (int m = 0; m < MB; ++m) {
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) dot += q[i] * int32_t(xc[m][i]);
        acc[r][m] += chunk::rounded(float(dot) * (s * sc[m][0]));
      }
    }
  }
  static Acc zero() { return 0.0f; }
  static float reduce(Acc acc) { return acc; }
  float rest(int64_t n, const float* xsum) const {
    float t = 0.0f;
    for (int64_t g = 0; g < groups; ++g) t += w.bias(n * groups + g) * xsum[g];
    return t;
  }
};

#if defined(__AVX2__) && defined(__FMA__)

// The vector width of a kernel: Ymm (AVX2, 32-byte chunks, the dot products of actq_dot.h's
// dot4 / dot4x2) or Zmm (AVX-512 with VNNI, 64-byte chunks, dot4_512).
struct Ymm {
  using I = __m256i;
  using F = __m256;
  static constexpr int kBytes = 32, kLanes = 8;
  __attribute__((always_inline)) static inline I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  __attribute__((always_inline)) static inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
  __attribute__((always_inline)) static inline I nibbles_lo(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  __attribute__((always_inline)) static inline I nibbles_hi(I v) { return nibbles_lo(_mm256_srli_epi16(v, 4)); }
  __attribute__((always_inline)) static inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  __attribute__((always_inline)) static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  __attribute__((always_inline)) static inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static float reduce(F v) { return hsum(v); }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct Zmm {
  using I = __m512i;
  using F = __m512;
  static constexpr int kBytes = 64, kLanes = 16;
  __attribute__((always_inline)) static inline I load(const void* p) { return _mm512_loadu_si512(p); }
  __attribute__((always_inline)) static inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
  __attribute__((always_inline)) static inline I nibbles_lo(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  __attribute__((always_inline)) static inline I nibbles_hi(I v) { return nibbles_lo(_mm512_srli_epi16(v, 4)); }
  __attribute__((always_inline)) static inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  __attribute__((always_inline)) static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  __attribute__((always_inline)) static inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static float reduce(F v) { return _mm512_reduce_add_ps(v); }
};
#endif

// 4-bit codes: a chunk is one vector of V::kBytes bytes, 2 * kBytes codes (byte i: code 2i in the
// low nibble, 2i + 1 in the high one), kBytes / 16 blocks of x: bytes 16j .. 16j + 15 hold block
// j, so int32 lane l of the dot products belongs to block l / 4. x is laid out as the nibbles
// come: xc[0 .. kBytes) the codes of the low nibbles (x[2i]), xc[kBytes .. 2 kBytes) of the high
// ones (x[2i + 1]). Ymm pairs: |15 * 127 * 2| * 2 < 2^15 (dot4x2's bound).
template <typename V>
struct U4Codes {
  static constexpr int kBits = 4, kShift = 0, kBytes = V::kBytes, kCodes = 2 * kBytes;
  static constexpr bool kHasTail = true;  // one block of 32 where K % kCodes == 32
  // A block of 32 codes past the last whole chunk (rest()): x as floats in the nibbles' order
  // (x[2i] at i, x[2i + 1] at 16 + i), and the block's dot product with the 16 bytes at p, in
  // float32 lanes (exact: |sum| <= 32 * 15 * 127 < 2^24).
  static void place_tail(const int8_t* q, float* xt) {
    for (int i = 0; i < 16; ++i) {
      xt[i] = float(q[2 * i]);
      xt[16 + i] = float(q[2 * i + 1]);
    }
  }
  __attribute__((always_inline)) static inline float tail_dot(const uint8_t* p, const float* xt) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    auto eight = [&](__m128i codes, int i, __m256 acc) __attribute__((always_inline)) {
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), _mm256_loadu_ps(xt + i), acc);
    };
    __m256 a = eight(lo, 0, _mm256_setzero_ps()), b = eight(hi, 16, _mm256_setzero_ps());
    a = eight(_mm_srli_si128(lo, 8), 8, a);
    b = eight(_mm_srli_si128(hi, 8), 24, b);
    return hsum(_mm256_add_ps(a, b));
  }
  static void place(int64_t b, const int8_t* q, int8_t* xc) {
    constexpr int kBlocksPerChunk = kBytes / 16;
    int8_t* chunk = xc + (b / kBlocksPerChunk) * kCodes + (b % kBlocksPerChunk) * 16;
    for (int i = 0; i < 16; ++i) {
      chunk[i] = q[2 * i];
      chunk[kBytes + i] = q[2 * i + 1];
    }
  }
  // The x scale of each int32 lane of a chunk: block b's 4 lanes.
  static void side(int64_t b, float d, float* side) {
    for (int l = 0; l < 4; ++l) side[4 * b + l] = d;
  }
  struct W {
    typename V::I lo, hi;
  };
  __attribute__((always_inline)) static inline W decode(typename V::I wv) { return {V::nibbles_lo(wv), V::nibbles_hi(wv)}; }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // Zmm: x of a chunk in registers, loaded once for the tile's rows of W.
  struct XV {
    __m512i lo, hi;
  };
#else
  struct XV {};
#endif
  __attribute__((always_inline)) static inline auto load_x(const int8_t* xc) {
    if constexpr (std::is_same_v<V, Ymm>) return xc;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    else return XV{V::load(xc), V::load(xc + kBytes)};
#endif
  }
  __attribute__((always_inline)) static inline __m256i dot(const W& w, const int8_t* xc) {
    return dot4x2(w.lo, Ymm::load(xc), w.hi, Ymm::load(xc + kBytes));
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __attribute__((always_inline)) static inline __m512i dot(const W& w, const XV& x) {
    return dot4_512(dot4_512(_mm512_setzero_si512(), w.lo, x.lo), w.hi, x.hi);
  }
#endif
  // The weight scale of each lane, for the chunk whose first code is in group g0.
  template <int G, typename S>
  __attribute__((always_inline)) static inline typename V::F scale_lanes(const S& w, int64_t g0) {
    if constexpr (std::is_same_v<V, Ymm>) {
      if constexpr (G == 32) return _mm256_set_m128(_mm_set1_ps(w.scale(g0 + 1)), _mm_set1_ps(w.scale(g0)));
      return _mm256_set1_ps(w.scale(g0));
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    else return chunk::chunk_lanes<typename S::Type, G, kBits>(w.scales + g0);  // lane l: codes 8l .. 8l + 7
#endif
  }
};

// 8-bit codes: a chunk is kBytes codes, kBytes / 32 blocks of x in natural order. The codes q
// (0..255) enter the products as q - 128 (kShift), and the 128 * X_g this leaves out goes to the
// bias. Ymm: through |q - 128| and x with the sign of q - 128 (vpsignb), so that each pair stays
// below 2 * 128 * 127 < 2^15. Zmm (vpdpbusd does not saturate): q times x, from -128 times x's
// sums of 4 (the same integers).
template <typename V>
struct U8Codes {
  static constexpr int kBits = 8, kShift = -128, kBytes = V::kBytes, kCodes = kBytes;
  // No K tail: a chunk is one or two blocks of 32, and vector_width takes 512-bit chunks only for
  // an even number of blocks, so K (whole blocks) leaves nothing past the last chunk.
  static constexpr bool kHasTail = false;
  static void place(int64_t b, const int8_t* q, int8_t* xc) {
    for (int i = 0; i < kBlock; ++i) xc[b * kBlock + i] = q[i];
  }
  static void side(int64_t b, float d, float* side) {
    for (int l = 0; l < 8; ++l) side[b * 8 + l] = d;
  }
  struct W {
    typename V::I q, centered;
  };
  __attribute__((always_inline)) static inline W decode(typename V::I wv) {
    if constexpr (std::is_same_v<V, Ymm>) {
      const __m256i centered = _mm256_xor_si256(wv, _mm256_set1_epi8(char(0x80)));  // q - 128 as int8
      return {_mm256_abs_epi8(centered), centered};  // |q - 128| <= 128, read unsigned
    } else {
      return {wv, wv};
    }
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  struct XV {
    __m512i x, base;  // the codes; -128 * (sum of each lane's 4 codes)
  };
#else
  struct XV {};
#endif
  __attribute__((always_inline)) static inline auto load_x(const int8_t* xc) {
    if constexpr (std::is_same_v<V, Ymm>) return xc;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    else {
      const __m512i x = V::load(xc);
      const __m512i sums = dot4_512(_mm512_setzero_si512(), _mm512_set1_epi8(char(0x80)), x);  // 128 * sum
      return XV{x, _mm512_sub_epi32(_mm512_setzero_si512(), sums)};
    }
#endif
  }
  __attribute__((always_inline)) static inline __m256i dot(const W& w, const int8_t* xc) {
    return dot4(_mm256_setzero_si256(), w.q, _mm256_sign_epi8(Ymm::load(xc), w.centered));
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __attribute__((always_inline)) static inline __m512i dot(const W& w, const XV& x) { return dot4_512(x.base, w.q, x.x); }
#endif
  template <int G, typename S>
  __attribute__((always_inline)) static inline typename V::F scale_lanes(const S& w, int64_t g0) {
    if constexpr (std::is_same_v<V, Ymm>) return _mm256_set1_ps(w.scale(g0));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    else return chunk::chunk_lanes<typename S::Type, G, kBits>(w.scales + g0);  // lane l: codes 4l .. 4l + 3
#endif
  }
};

// The kernel for codes C (4-bit or 8-bit, of one vector width), group size G, scales in T: per
// chunk and row of W, the int32 dot products with each row of x, converted and multiplied by
// (weight scale * x scale) per lane. rest(): the K tail past the last whole chunk (whole blocks of
// 32, C::tail_dot) and the offsets, sum_g (b_g - kShift * s_g) * X_g.
template <typename C, int G, typename T>
struct DotKernel {
  using V = std::conditional_t<C::kBytes == 32, Ymm,
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                               Zmm
#else
                               void
#endif
                               >;
  using X = int8_t;
  using Acc = typename V::F;
  static constexpr int64_t kXPerChunk = C::kCodes, kSidePerChunk = V::kLanes;
  static constexpr int kMaxXBlock = 4;
  static constexpr int64_t slab_bytes(int) { return 0; }  // one pass over K (chunk_driver.h)
  // 8-bit codes at 512 bits and one row of x: 8 W rows per tile (more of W in flight where the
  // call streams it once; Zen 4, 4096 x 14336, medians of 6 alternating processes: 2.25 -> 2.15
  // ms with float32 scales, 2.01 -> 1.89 with bfloat16 ones; 4-bit codes lose 8-10% there and
  // keep 4); else 4 rows at one or two rows of x and 2 above.
  static constexpr int tile_rows(int mb) {
    return C::kBits == 8 && C::kBytes == 64 && mb == 1 ? 8 : mb <= 2 ? 4 : 2;
  }

  const QmmArgs& a;
  Affine<T> w;
  int64_t chunks, row_bytes, groups, tail, rest_floats, part_chunks = chunk::chunks_per_group(G, C::kCodes);
  DotKernel(const QmmArgs& args, Affine<T> wa)
      : a(args), w(wa), chunks(a.K / C::kCodes), row_bytes(a.K * C::kBits / 8), groups(a.K / G),
        tail(a.K - chunks * C::kCodes), rest_floats(groups + tail + tail / kBlock) {}

  const uint8_t* row(int64_t n) const { return a.wq + n * row_bytes; }

  // rest: X_g by group, then the tail blocks' codes as floats and their scales.
  void prepare_part(const float* x, int64_t c0, int64_t c1, X* xc, float* side, float* rest) const {
    const int64_t whole = chunks * C::kCodes / kBlock;
    quantize_blocks(
        x, c0 * C::kCodes / kBlock, c1 == chunks ? a.K / kBlock : c1 * C::kCodes / kBlock, G, rest,
        [&](int64_t b, const int8_t* q) {
          if (b < whole) return C::place(b, q, xc);
          if constexpr (C::kHasTail) C::place_tail(q, rest + groups + (b - whole) * kBlock);
        },
        [&](int64_t b, float d) {
          if (b < whole) return C::side(b, d, side);
          rest[groups + tail + (b - whole)] = d;
        });
  }
  template <int R>
  void start_tile(int64_t, int64_t, int64_t) const {}

  template <int R, int MB>
  __attribute__((always_inline)) inline void chunk(int64_t n, const uint8_t* const (&row)[R], int64_t c,
                                                   const X* const (&xc)[MB], const float* const (&sc)[MB],
                                                   Acc (&acc)[R][MB]) const {
    Acc dx[MB];
    decltype(C::load_x(xc[0])) xv[MB];
    for (int m = 0; m < MB; ++m) {
      dx[m] = V::loadf(sc[m]);
      xv[m] = C::load_x(xc[m]);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = row[r] + c * C::kBytes;
      chunk::prefetch_range(row[r], R * row_bytes + c * C::kBytes, C::kBytes);  // the next tile's chunk c
      const auto wv = C::decode(V::load(p));
      const Acc sw = C::template scale_lanes<G>(w, (n + r) * groups + c * C::kCodes / G);
      for (int m = 0; m < MB; ++m) acc[r][m] = V::fmadd(V::cvt(C::dot(wv, xv[m])), V::mul(sw, dx[m]), acc[r][m]);
    }
  }
  static Acc zero() { return V::zero(); }
  static float reduce(Acc v) { return V::reduce(v); }
  float rest(int64_t n, const float* rest) const {
    float t = 0.0f;
    if constexpr (C::kHasTail) {
      for (int64_t tb = 0; tb < tail / kBlock; ++tb) {
        const int64_t k = chunks * C::kCodes + tb * kBlock;
        const float dot = C::tail_dot(row(n) + k * C::kBits / 8, rest + groups + tb * kBlock);
        t += dot * (w.scale(n * groups + k / G) * rest[groups + tail + tb]);
      }
    }
    return t + offset_sum<C::kShift>(w.biases + n * groups, w.scales + n * groups, rest, groups);
  }
};

#endif  // AVX2 + FMA

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// f(Group<G>{}) for the call's group size.
template <typename F>
void with_group(int group_size, F&& f) {
  switch (group_size) {
    case 32: return f(Group<32>{});
    case 64: return f(Group<64>{});
    case 128: return f(Group<128>{});
    default: TORCH_CHECK(false, "qmm_int8_activations: no kernel for group_size ", group_size);
  }
}

// f(T{}) for the scales' float type.
template <typename F>
void with_scale_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(c10::Half{});
    case at::kBFloat16: return f(c10::BFloat16{});
    default: TORCH_CHECK(false, "qmm_int8_activations: unsupported scales dtype ", dtype);
  }
}

// The vector kernels serve bits 4 and 8 from K of one chunk (the portable kernel the rest):
// 512-bit chunks where built for AVX512_VNNI + AVX512BW, TORCH_QMM_CPU_NO_INT8_512 is unset and
// they leave no longer K tail than 256-bit ones would (an odd number of 256-bit chunks leaves
// half a 512-bit chunk to rest(), code by code: 4-bit K = 576 took 6.5x the 256-bit time at
// M = 8), else 256-bit ones; none with TORCH_QMM_CPU_NO_AVX2_CHUNKS=1.
enum class Width { kNone, k256, k512 };

Width vector_width(const QmmArgs& a) {
#if defined(__AVX2__) && defined(__FMA__)
  if (env_set("TORCH_QMM_CPU_NO_AVX2_CHUNKS") || (a.bits != 4 && a.bits != 8)) return Width::kNone;
  const int64_t codes_per_byte = 8 / a.bits;
  const bool even = (a.K / (32 * codes_per_byte)) % 2 == 0;
  if (kHaveDot512 && !env_set("TORCH_QMM_CPU_NO_INT8_512") && a.K >= 64 * codes_per_byte && even) return Width::k512;
  if (a.K >= 32 * codes_per_byte) return Width::k256;
#endif
  (void)a;
  return Width::kNone;
}

}  // namespace

std::string int8x_kernel(const QmmArgs& a) {
  const Width v = vector_width(a);
  if (v == Width::kNone) return "scalar";
#if defined(__AVX2__) && defined(__FMA__)
  const char* codes = a.bits == 4 ? "-u4" : "-u8";
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (v == Width::k512) return std::string(kDot512Isa) + "-512" + codes;
#endif
  return std::string(kDotIsa) + codes;
#else
  return "scalar";
#endif
}

void qmm_t_int8x(const QmmArgs& a, float* y) {
  with_scale_type(a.dtype, [&](auto t) {
    using T = decltype(t);
    const Affine<T> w{static_cast<const T*>(a.scales), static_cast<const T*>(a.biases)};
    with_group(a.group_size, [&](auto g) {
      constexpr int G = decltype(g)::value;
#if defined(__AVX2__) && defined(__FMA__)
      auto run = [&](auto vec) {
        using V = decltype(vec);
        if (a.bits == 4) return chunk::run(DotKernel<U4Codes<V>, G, T>(a, w), a.x, a.M, a.N, a.K, y);
        chunk::run(DotKernel<U8Codes<V>, G, T>(a, w), a.x, a.M, a.N, a.K, y);
      };
      switch (vector_width(a)) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        case Width::k512: return run(Zmm{});
#endif
        case Width::k256: return run(Ymm{});
        default: break;
      }
#endif
      chunk::run(ScalarKernel<G, T>(a, w), a.x, a.M, a.N, a.K, y);
    });
  });
}

}  // namespace actq
}  // namespace cpu

namespace {

constexpr const char* kOp = "qmm_int8_activations";

// The checked, contiguous operands of one call (transpose=True: W [N, K]).
struct Int8xCall {
  std::vector<int64_t> out_shape;
  at::Tensor xf, wq, scales, biases;
  cpu::QmmArgs a;
  bool empty = false, x_finite = true;
};

Int8xCall prepare(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                  const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size) {
  const FormatSpec& f = check_int8_activations_mode(kOp, mode);
  const auto [N, K] = check_qmm(x, wq, scales, biases, f, bits, group_size, true);
  Int8xCall c;
  c.out_shape = x.sizes().vec();
  c.out_shape.back() = N;
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  c.empty = M == 0 || N == 0;
  if (c.empty) return c;
  c.wq = wq.contiguous();
  c.scales = scales.contiguous();
  c.biases = biases->contiguous();
  cpu::XRows xr = cpu::x_rows(x, M, K);
  c.xf = std::move(xr.xf);
  c.x_finite = xr.finite;
  cpu::QmmArgs& a = c.a;
  a.mode = f.mode;
  a.x = c.xf.data_ptr<float>();
  a.wq = reinterpret_cast<const uint8_t*>(c.wq.data_ptr());
  a.scales = c.scales.data_ptr();
  a.biases = c.biases.data_ptr();
  a.dtype = c.scales.scalar_type();
  a.M = M;
  a.N = N;
  a.K = K;
  a.bits = int(bits);
  a.group_size = int(group_size);
  return c;
}

at::Tensor exact_qmm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                     const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_qmm::qmm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, int64_t, int64_t, bool)>();
  return op.call(x, wq, scales, biases, mode, bits, group_size, true);
}

at::Tensor qmm_int8x_cpu(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                         const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits,
                         int64_t group_size) {
  Int8xCall c = prepare(x, wq, scales, biases, mode, bits, group_size);
  if (c.empty) return at::zeros(c.out_shape, x.options());
  if (!c.x_finite) return exact_qmm(x, wq, scales, biases, mode, bits, group_size);
  at::Tensor yf = at::empty({c.a.M, c.a.N}, c.xf.options());
  cpu::actq::qmm_t_int8x(c.a, yf.data_ptr<float>());
  // The block sums d_b * sum(q) can overflow float32 for large finite x (and meet the biases as
  // Inf); a result that is not finite is redone by the exact kernels, as qmm redoes its hoisted ones.
  if (!cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return exact_qmm(x, wq, scales, biases, mode, bits, group_size);
  return yf.to(x.scalar_type()).reshape(c.out_shape);
}

// "int8x/<kernel>" (actq::int8x_kernel), "exact" (x not finite: the qmm op's kernels) or "empty"
// (for a finite result; a call whose int8 result is not finite is redone by the exact kernels).
std::string qmm_int8x_cpu_route(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits,
                                int64_t group_size) {
  const Int8xCall c = prepare(x, wq, scales, biases, mode, bits, group_size);
  if (c.empty) return "empty";
  if (!c.x_finite) return "exact";
  return "int8x/" + cpu::actq::int8x_kernel(c.a);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("qmm_int8_activations", &qmm_int8x_cpu);
  m.impl("_cpu_route_int8_activations", &qmm_int8x_cpu_route);
}

}  // namespace torch_qmm
