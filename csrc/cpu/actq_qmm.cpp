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
//   Avx2Kernel, 4-bit (U4Codes) and 8-bit (U8Codes), group sizes 32/64/128: one 32-byte load of
//     a row per chunk, integer dot products (actq_dot.h: AVX2 or VNNI), one float FMA per chunk;
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
#include "actq_x.h"
#include "chunk_driver.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {
namespace actq {
namespace {

template <int G>
using Group = std::integral_constant<int, G>;

// The affine scales and biases of W, in their float type T.
template <typename T>
struct Affine {
  const T* scales;
  const T* biases;
  float scale(int64_t i) const { return static_cast<float>(scales[i]); }
  float bias(int64_t i) const { return static_cast<float>(biases[i]); }
};

// One row of x quantized (actq_x.h) into a kernel's layout. place(b, q): block b's codes;
// then rest[0 .. groups) = X_g. Returns nothing; the scales go through side(b, d).
template <typename Place, typename Side>
void quantize_row(const float* x, int64_t K, int G, float* xsum, Place place, Side side) {
  int8_t q[kBlock];
  for (int64_t g = 0; g < K / G; ++g) xsum[g] = 0.0f;
  for (int64_t b = 0; b < K / kBlock; ++b) {
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
  static constexpr int tile_rows(int) { return 1; }

  const QmmArgs& a;
  Affine<T> w;
  int64_t chunks, row_bytes, groups, rest_floats;
  ScalarKernel(const QmmArgs& args, Affine<T> wa)
      : a(args), w(wa), chunks(a.K / kBlock), row_bytes(a.K * a.bits / 8), groups(a.K / G), rest_floats(groups) {}

  const uint8_t* row(int64_t n) const { return a.wq + n * row_bytes; }
  void prepare_row(const float* x, X* xc, float* side, float* rest) const {
    quantize_row(
        x, a.K, G, rest, [&](int64_t b, const int8_t* q) {
          for (int i = 0; i < kBlock; ++i) xc[b * kBlock + i] = q[i];
        },
        [&](int64_t b, float d) { side[b] = d; });
  }
  template <int R>
  void start_tile(int64_t) const {}
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
        acc[r][m] += float(dot) * (s * sc[m][0]);
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

// 4-bit codes: a chunk is 32 bytes, 64 codes (byte i: code 2i in the low nibble, 2i + 1 in the
// high one), two blocks of x: bytes 0-15 the first, 16-31 the second, so int32 lanes 0-3 of the
// dot products belong to block 0 and lanes 4-7 to block 1. x is laid out as the nibbles come:
// xc[0 .. 32) the codes of the low nibbles (x[2i]), xc[32 .. 64) of the high ones (x[2i + 1]).
// Pairs: |15 * 127 * 2| * 2 < 2^15 (dot4x2's bound).
struct U4Codes {
  static constexpr const char* kName = "u4";
  static constexpr int kBits = 4, kCodes = 64, kBytes = 32;
  static constexpr float kOffset = 0.0f;  // w = s * (code + kOffset) + b in the dot products
  static void place(int64_t b, const int8_t* q, int8_t* xc) {
    int8_t* chunk = xc + (b / 2) * kCodes;
    const int half = int(b % 2) * 16;
    for (int i = 0; i < 16; ++i) {
      chunk[half + i] = q[2 * i];
      chunk[32 + half + i] = q[2 * i + 1];
    }
  }
  // The x scale of each int32 lane of a chunk: [d(2c) x4, d(2c+1) x4].
  static void side(int64_t b, float d, float* side) {
    float* lanes = side + (b / 2) * 8 + (b % 2) * 4;
    for (int l = 0; l < 4; ++l) lanes[l] = d;
  }
  template <int G, typename S>
  __attribute__((always_inline)) static inline __m256 scale_lanes(const S& w, int64_t g0) {
    if constexpr (G == 32) return _mm256_set_m128(_mm_set1_ps(w.scale(g0 + 1)), _mm_set1_ps(w.scale(g0)));
    return _mm256_set1_ps(w.scale(g0));
  }
  template <int MB>
  __attribute__((always_inline)) static inline void dot(__m256i wv, const int8_t* const (&xc)[MB],
                                                        __m256i (&out)[MB]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(wv, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nibble);
    for (int m = 0; m < MB; ++m)
      out[m] = dot4x2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m])), hi,
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m] + 32)));
  }
};

// 8-bit codes: a chunk is 32 codes, one block of x in natural order. The codes q (0..255) enter
// the products as q - 128 (signed) through |q - 128| and x with the sign of q - 128 (vpsignb), so
// each pair stays below 2 * 128 * 127 < 2^15; the 128 * X_g this leaves out goes to the bias.
struct U8Codes {
  static constexpr const char* kName = "u8";
  static constexpr int kBits = 8, kCodes = 32, kBytes = 32;
  static constexpr float kOffset = -128.0f;
  static void place(int64_t b, const int8_t* q, int8_t* xc) {
    for (int i = 0; i < kBlock; ++i) xc[b * kBlock + i] = q[i];
  }
  static void side(int64_t b, float d, float* side) {
    for (int l = 0; l < 8; ++l) side[b * 8 + l] = d;
  }
  template <int G, typename S>
  __attribute__((always_inline)) static inline __m256 scale_lanes(const S& w, int64_t g0) {
    return _mm256_set1_ps(w.scale(g0));
  }
  template <int MB>
  __attribute__((always_inline)) static inline void dot(__m256i wv, const int8_t* const (&xc)[MB],
                                                        __m256i (&out)[MB]) {
    const __m256i centered = _mm256_xor_si256(wv, _mm256_set1_epi8(char(0x80)));  // q - 128 as int8
    const __m256i magnitude = _mm256_abs_epi8(centered);  // |q - 128| <= 128, read unsigned
    for (int m = 0; m < MB; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m]));
      out[m] = dot4(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(x, centered));
    }
  }
};

// The AVX2 kernel for codes C, group size G, scales in T: per chunk and row of W, the int32 dot
// products with each row of x, converted and multiplied by (weight scale * x scale) per lane.
// rest(): the K tail past the last whole chunk (4-bit, K = 32 mod 64: one block, in integers) and
// the bias, sum_g (b_g - kOffset * s_g) * X_g.
template <typename C, int G, typename T>
struct Avx2Kernel {
  using X = int8_t;
  using Acc = __m256;
  static constexpr int64_t kXPerChunk = C::kCodes, kSidePerChunk = 8;
  static constexpr int kMaxXBlock = 4;
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 4 : 2; }

  const QmmArgs& a;
  Affine<T> w;
  int64_t chunks, row_bytes, groups, tail, rest_floats;
  Avx2Kernel(const QmmArgs& args, Affine<T> wa)
      : a(args), w(wa), chunks(a.K / C::kCodes), row_bytes(a.K * C::kBits / 8), groups(a.K / G),
        tail(a.K - chunks * C::kCodes), rest_floats(groups + (tail ? kBlock + 1 : 0)) {}

  const uint8_t* row(int64_t n) const { return a.wq + n * row_bytes; }

  // rest: X_g by group, then (with a tail) the tail block's codes as floats and its scale.
  void prepare_row(const float* x, X* xc, float* side, float* rest) const {
    const int64_t whole = chunks * C::kCodes / kBlock;
    quantize_row(
        x, a.K, G, rest,
        [&](int64_t b, const int8_t* q) {
          if (b < whole) return C::place(b, q, xc);
          for (int i = 0; i < kBlock; ++i) rest[groups + i] = float(q[i]);
        },
        [&](int64_t b, float d) {
          if (b < whole) return C::side(b, d, side);
          rest[groups + kBlock] = d;
        });
  }
  template <int R>
  void start_tile(int64_t) const {}

  template <int R, int MB>
  __attribute__((always_inline)) inline void chunk(int64_t n, const uint8_t* const (&row)[R], int64_t c,
                                                   const X* const (&xc)[MB], const float* const (&sc)[MB],
                                                   Acc (&acc)[R][MB]) const {
    __m256 dx[MB];
    for (int m = 0; m < MB; ++m) dx[m] = _mm256_loadu_ps(sc[m]);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = row[r] + c * C::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256 sw = C::template scale_lanes<G>(w, (n + r) * groups + c * C::kCodes / G);
      __m256i dots[MB];
      C::template dot<MB>(wv, xc, dots);
      for (int m = 0; m < MB; ++m)
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), _mm256_mul_ps(sw, dx[m]), acc[r][m]);
    }
  }
  static Acc zero() { return _mm256_setzero_ps(); }
  static float reduce(Acc v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
  float rest(int64_t n, const float* rest) const {
    static_assert(C::kOffset == 0.0f || C::kCodes == kBlock, "a K tail only for codes that enter unshifted");
    float t = 0.0f;
    if (tail) {
      const float* q = rest + groups;
      const int64_t k0 = chunks * C::kCodes;
      int32_t dot = 0;
      for (int i = 0; i < kBlock; ++i) dot += int32_t(unpack_element(row(n), k0 + i, C::kBits)) * int32_t(q[i]);
      t += float(dot) * (w.scale(n * groups + k0 / G) * q[kBlock]);
    }
    for (int64_t g = 0; g < groups; ++g) t += (w.bias(n * groups + g) - C::kOffset * w.scale(n * groups + g)) * rest[g];
    return t;
  }
};

#endif  // AVX2 + FMA

bool avx2_avoided() {
  const char* v = std::getenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS");
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

bool avx2_serves(const QmmArgs& a) {
#if defined(__AVX2__) && defined(__FMA__)
  return !avx2_avoided() && ((a.bits == 4 && a.K >= 64) || a.bits == 8);
#else
  (void)a;
  return false;
#endif
}

}  // namespace

// The kernel qmm_int8_activations runs for `a` (x finite): "<isa>-<codes>" or "scalar".
std::string int8x_kernel(const QmmArgs& a) {
#if defined(__AVX2__) && defined(__FMA__)
  if (avx2_serves(a)) return std::string(kDotIsa) + (a.bits == 4 ? "-u4" : "-u8");
#endif
  return "scalar";
}

void qmm_t_int8x(const QmmArgs& a, float* y) {
  with_scale_type(a.dtype, [&](auto t) {
    using T = decltype(t);
    const Affine<T> w{static_cast<const T*>(a.scales), static_cast<const T*>(a.biases)};
    with_group(a.group_size, [&](auto g) {
      constexpr int G = decltype(g)::value;
#if defined(__AVX2__) && defined(__FMA__)
      if (avx2_serves(a)) {
        if (a.bits == 4) return chunk::run(Avx2Kernel<U4Codes, G, T>(a, w), a.x, a.M, a.N, a.K, y);
        return chunk::run(Avx2Kernel<U8Codes, G, T>(a, w), a.x, a.M, a.N, a.K, y);
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
  const FormatSpec& f = check_mode(kOp, mode);
  TORCH_CHECK_VALUE(f.mode == Mode::kAffine, kOp, ": argument 'mode' must be 'affine' (int8 activations are ",
                    "implemented for the affine format), got '", mode, "'");
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
  c.xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  c.x_finite = cpu::all_finite(c.xf.data_ptr<float>(), c.xf.numel());
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
