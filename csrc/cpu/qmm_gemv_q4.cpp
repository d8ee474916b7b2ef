// 4-bit, transpose=True, M=1 (token decode): y[n] = sum_k x[k] * (s*q + b), AVX-512 only.
//
// This shape is bound by how fast one core turns packed nibbles into products (~8 GB/s with the
// 32-code blocks of decode.h: widen (a cross-lane shuffle), and, shift, two converts, two FMAs).
// Here a 64-byte load is one *chunk* of 128 codes, and x is rearranged once per call so that
// every code meets its x in-lane, with no shuffle of W. Two ways to multiply a chunk:
//
// bfloat16 tile (AVX512_BF16: vdpbf16ps, 32 products per instruction summed in float32). The
// chunk is 32 u16 words of 4 nibbles; for nibble j (0..3) one vpermw maps each word's low 5 bits
// through a 32-entry table to the bfloat16 of q (exact: 4 significant bits), after a 4j shift:
//   vector j, u16 lane i = bf16(q[128c + 4i + j]);  float32 lane l sums u16 lanes 2l, 2l+1,
//   i.e. codes 8l .. 8l+7
// and x enters as P bfloat16 terms (xb[c][j][t], u16 lane i = term t of x[128c + 4i + j]).
// Each product q * term is exact in float32, and P = 3 / 2 / 1 terms hold float32 / float16 /
// bfloat16 x exactly: the result is a float32 sum of the exact products q * x. For float32 x,
// torch.set_float32_matmul_precision("high" / "medium") allows P = 2 / 1 (x kept to ~16 / 8
// significant bits, relative error <= 2^-16 / 2^-8 per element): the trade PyTorch makes for
// its own float32 matmuls at those settings (QmmArgs::x_bf16_terms).
//
// float32 tile (AVX-512 without BF16). The chunk is 16 dwords of 8 nibbles:
//   vector j (0..7), lane l:  w & (15 << 4j)  =  q[128c + 8l + j] * 16^j     (no shift)
//   converted unsigned (exact: 4 significant bits), times xw[c][j][l] = x[128c + 8l + j] * 2^-4j
// so every 16 codes cost one and, one convert and one FMA; scaling x by a power of two makes
// each product exactly q * x.
//
// Both tiles leave lane l with codes 8l .. 8l+7, in group 8l / group_size, so the scale is a
// per-lane vector (one broadcast + one in-lane byte shuffle), and the bias is hoisted:
//   y[n] = sum_c hsum(s_c * p_c) + sum_g b[g] * xsum[g]        (xsum[g] = sum of x over group g)
// with the bias dot done 16 groups per FMA after the row. x outside [2^-98, 2^100] in magnitude
// (or not finite) goes to the fused kernel instead (x_in_range).
//
// Tiles of 4 W rows share each x load; while a tile runs, the next tile (4 rows further on) is
// prefetched into L2, the one thing that let a core stream ~16 GB/s instead of ~11 (the hardware
// prefetcher alone does not run far enough ahead of 4 interleaved streams). Work is handed out
// in spans of rows from a shared counter (see gemv).
// K % 128 (at most 3 blocks of 32 codes) is done with the blocks of decode.h, x in codec order.
//
// Measured on a 2-core Zen 4 (14336x5120, benchmarks/README.md): float32 x takes 1.66 ms with
// the bfloat16 tile (P = 3) against 1.75 ms with the float32 tile; bfloat16 x (P = 1) 1.34 ms.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "decode.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

constexpr int kTileRows = 4;      // W rows sharing each x load (8 was slower: register spills)
constexpr int64_t kSpanRows = 128;  // rows per work item (320 KB at K=5120)

// Per-lane scales of chunk c: lane l gets float(s[(8l) / G]), s pointing at the chunk's first
// group. Reads exactly the 128/G values of the chunk.
template <typename T, int G>
inline __m512 chunk_lanes(const T* s) {
  constexpr int E = 128 / G;  // groups per chunk: 4, 2, 1
  constexpr int kBytes = E * int(sizeof(T));
  // Broadcast the chunk's values to every 128-bit lane (vpshufb indexes within one).
  __m512i v;
  if constexpr (kBytes == 16) {
    v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  } else if constexpr (kBytes == 8) {  // float broadcasts load straight from memory (no GPR hop)
    double d;
    std::memcpy(&d, s, 8);
    v = _mm512_castpd_si512(_mm512_set1_pd(d));
  } else if constexpr (kBytes == 4) {
    float f;
    std::memcpy(&f, s, 4);
    v = _mm512_castps_si512(_mm512_set1_ps(f));
  } else {
    uint16_t h;
    std::memcpy(&h, s, 2);
    v = _mm512_set1_epi32(h);
  }
  alignas(64) static constexpr auto ctl = [] {
    struct { int8_t b[64]; } t{};
    for (int l = 0; l < 16; ++l) {
      const int g = 8 * l / G;  // group of lane l within the chunk
      for (int i = 0; i < 4; ++i) {
        int8_t src;
        if constexpr (sizeof(T) == 4) src = int8_t(4 * g + i);
        else if constexpr (std::is_same_v<T, c10::BFloat16>) src = i < 2 ? -1 : int8_t(2 * g + i - 2);  // bits << 16
        else src = i < 2 ? int8_t(2 * g + i) : -1;  // half: low 16 bits, converted below
        t.b[4 * l + i] = src;
      }
    }
    return t;
  }();
    const __m512i d = _mm512_shuffle_epi8(v, _mm512_load_si512(ctl.b));
    if constexpr (std::is_same_v<T, c10::Half>)
      return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
    else
      return _mm512_castsi512_ps(d);
}

// The next tile's scales and biases (rows [n+R, n+2R)): 2*R more streams than the hardware
// prefetcher follows well (float32 scales: ~10-15% faster with this, 2 threads).
template <typename T, int R>
inline void prefetch_params(const QmmArgs& a, int64_t n, int64_t groups) {
  const T* scale = static_cast<const T*>(a.scales) + (n + R) * groups;
  const T* bias = static_cast<const T*>(a.biases) + (n + R) * groups;
  for (int64_t off = 0; off < R * groups * int64_t(sizeof(T)); off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(scale) + off, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(bias) + off, _MM_HINT_T1);
  }
}

// How the codes of one chunk meet x, for R rows at once: p[r] += (q of row r) * x, lane l
// holding the products of codes 8l .. 8l+7 (so chunk_lanes applies to either). Always inlined:
// a call would send w and p through memory (GCC did not inline it: ~50% slower).
//
// float32: x as xw (vector j lane l = x[128c + 8l + j] * 2^-4j), 8 and + convert + FMA.
struct F32Chunk {
  using X = float;
  static constexpr int64_t kXPerChunk = 128;
  template <int R>
  __attribute__((always_inline)) static inline void dot(const __m512i (&w)[R], const float* xc, __m512 (&p)[R]) {
    // One chain per row: 8 FMAs per chunk at 4 cycles each hide under the other rows' work.
    auto step = [&](auto jc) {
      constexpr int j = decltype(jc)::value;
      const __m512 xj = _mm512_loadu_ps(xc + 16 * j);
      const __m512i mask = _mm512_set1_epi32(int(15u << (4 * j)));
      for (int r = 0; r < R; ++r)
        p[r] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(_mm512_and_si512(w[r], mask)), xj, p[r]);
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    step(std::integral_constant<int, 4>{});
    step(std::integral_constant<int, 5>{});
    step(std::integral_constant<int, 6>{});
    step(std::integral_constant<int, 7>{});
  }
};

#if defined(__AVX512BF16__)
// bfloat16: x as P bfloat16 terms (xb[c][j][term], u16 lane i = term of x[128c + 4i + j]).
// u16 entry e of kCodeToBf16 = bfloat16 bits of float(e & 15): vpermw indexes by 5 bits.
alignas(64) constexpr uint16_t kCodeToBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

template <int P>
struct Bf16Chunk {
  using X = uint16_t;
  static constexpr int64_t kXPerChunk = 128 * P;
  template <int R>
  __attribute__((always_inline)) static inline void dot(const __m512i (&w)[R], const uint16_t* xc, __m512 (&p)[R]) {
    const __m512i table = _mm512_load_si512(kCodeToBf16);
    // Two chains per row (vdpbf16ps latency ~6 cycles).
    __m512 q[R];
    for (int r = 0; r < R; ++r) q[r] = _mm512_setzero_ps();
    auto step = [&](auto jc) {
      constexpr int j = decltype(jc)::value;
      __m512i v[R];
      for (int r = 0; r < R; ++r)
        v[r] = _mm512_permutexvar_epi16(j == 0 ? w[r] : _mm512_srli_epi16(w[r], 4 * j), table);
      for (int t = 0; t < P; ++t) {
        const __m512i xv = _mm512_loadu_si512(xc + (j * P + t) * 32);
        for (int r = 0; r < R; ++r) {
          __m512& chain = (j * P + t) % 2 ? q[r] : p[r];
          chain = _mm512_dpbf16_ps(chain, (__m512bh)v[r], (__m512bh)xv);
        }
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    for (int r = 0; r < R; ++r) p[r] = _mm512_add_ps(p[r], q[r]);
  }
};
#endif

// Rows [n, n+R): y[n+r] = sum over chunks of s*q*x (the part of K that is whole chunks).
template <typename T, int R, int G, typename C>
void tile(const QmmArgs& a, int64_t n, const typename C::X* x, float* acc_out) {
  const int64_t chunks = a.K / 128, row_bytes = a.K / 2, groups = a.K / G;
  const uint8_t* row[R];
  const T* s[R];
  for (int r = 0; r < R; ++r) {
    row[r] = a.wq + (n + r) * row_bytes;
    s[r] = static_cast<const T*>(a.scales) + (n + r) * groups;
  }
  prefetch_params<T, R>(a, n, groups);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      // The same chunk of the next tile's row r: the rows are contiguous.
      _mm_prefetch(reinterpret_cast<const char*>(row[r] + R * row_bytes + c * 64), _MM_HINT_T1);
      w[r] = _mm512_loadu_si512(row[r] + c * 64);
    }
    __m512 p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_ps();
    C::dot(w, x + c * C::kXPerChunk, p);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(p[r], chunk_lanes<T, G>(s[r] + c * (128 / G)), acc[r]);
  }
  for (int r = 0; r < R; ++r) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}

// The K % 128 tail (whole blocks of 32, x in codec order) and the hoisted bias of row n.
template <typename T, int G>
float row_rest(const QmmArgs& a, int64_t n, const float* xtail, const float* xsum) {
  using Blk = Block32<4>;
  const int64_t groups = a.K / G, kb0 = a.K / 128 * 4, blocks = a.K / 32;
  const T* s = static_cast<const T*>(a.scales) + n * groups;
  const T* b = static_cast<const T*>(a.biases) + n * groups;
  const uint8_t* row = a.wq + n * (a.K / 2);
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

// Work sharing: rows go out in spans from a shared counter, so a thread that loses its core to
// another process mid-call leaves its share to the others (the OpenMP barrier at the end still
// waits for it to get a core back). Tried: helpers via at::launch with no barrier at all (the
// caller waits only for claimed spans): better medians when the machine is loaded, but the
// inter-op helper then competes with OpenMP threads still spinning after the previous op (as in
// a model, or interleaved with F.linear): 3.6-3.9 ms instead of ~2.3 ms median.
template <typename T, int G, typename C>
void run_span(const QmmArgs& a, int64_t i, const typename C::X* x, const float* xtail, const float* xsum, float* y) {
  const int64_t n1 = std::min(a.N, (i + 1) * kSpanRows);
  float part[kTileRows];
  int64_t n = i * kSpanRows;
  for (; n + kTileRows <= n1; n += kTileRows) {
    tile<T, kTileRows, G, C>(a, n, x, part);
    for (int r = 0; r < kTileRows; ++r) y[n + r] = part[r] + row_rest<T, G>(a, n + r, xtail, xsum);
  }
  for (; n < n1; ++n) {
    tile<T, 1, G, C>(a, n, x, part);
    y[n] = part[0] + row_rest<T, G>(a, n, xtail, xsum);
  }
}

template <typename C>
void gemv(const QmmArgs& a, const typename C::X* x, const float* xtail, const float* xsum, float* y) {
  const int64_t spans = (a.N + kSpanRows - 1) / kSpanRows;
  dispatch_bits_dtype(4, a.dtype, [&](auto, auto t) {
    using T = decltype(t);
    auto run = [&](auto gc) {
      constexpr int G = decltype(gc)::value;
      std::atomic<int64_t> next{0};
      at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), spans), 1, [&](int64_t, int64_t) {
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < spans;)
          run_span<T, G, C>(a, i, x, xtail, xsum, y);
      });
    };
    if (a.group_size == 32) run(std::integral_constant<int, 32>{});
    else if (a.group_size == 64) run(std::integral_constant<int, 64>{});
    else run(std::integral_constant<int, 128>{});
  });
}

// Whether this kernel may take x: finite, and every nonzero |x| in [2^-98, 2^100]. Below, the
// float32 tile's x * 2^-28 and the bfloat16 terms (flushed by vdpbf16ps under 2^-126) would
// lose bits; above, the unscaled sums of q * x (up to 128 * 15 * |x| per group) could overflow
// where s * q * x does not. Other x take the fused kernel, which scales before multiplying.
bool x_in_range(const float* x, int64_t K) {
  bool ok = true;
  for (int64_t k = 0; k < K; ++k) {
    const float m = std::fabs(x[k]);
    ok &= (m >= 0x1p-98f && m <= 0x1p100f) || m == 0.0f;  // false for NaN
  }
  return ok;
}

// x of the whole chunks -> xw for F32Chunk (lanes of vector j times 2^-4j: exact in range).
void prepare_f32(const float* x, int64_t chunks, float* xw) {
  static constexpr float kPow[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f};
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l) xw[128 * c + 16 * j + l] = x[128 * c + 8 * l + j] * kPow[j];
}

#if defined(__AVX512BF16__)
// x of the whole chunks -> P bfloat16 terms per element for Bf16Chunk<P>: term t = what terms
// 0..t-1 left, rounded to nearest even. Every float32 is the exact sum of its 3 terms (8
// significant bits each); float16 of its first 2.
template <int P>
void prepare_bf16(const float* x, int64_t chunks, uint16_t* xb) {
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 32; ++i) {
        float rest = x[128 * c + 4 * i + j];
        for (int t = 0; t < P; ++t) {
          const c10::BFloat16 term(rest);
          xb[c * 128 * P + (j * P + t) * 32 + i] = term.x;
          rest -= static_cast<float>(term);
        }
      }
}

template <int P>
void gemv_bf16(const QmmArgs& a, int64_t chunks, const float* xtail, const float* xsum, float* y) {
  std::vector<uint16_t> xb(chunks * 128 * P);
  prepare_bf16<P>(a.x, chunks, xb.data());
  gemv<Bf16Chunk<P>>(a, xb.data(), xtail, xsum, y);
}
#endif

}  // namespace

const char* qmm_t_gemv_q4_tile(const QmmArgs& a) {
  if (a.bits != 4 || a.M != 1 || a.K < 128) return nullptr;
  if (a.group_size != 32 && a.group_size != 64 && a.group_size != 128) return nullptr;
  if (!x_in_range(a.x, a.K)) return nullptr;
#if defined(__AVX512BF16__)
  if (!a.avoid_bf16) return a.x_bf16_terms == 1 ? "bf16x1" : a.x_bf16_terms == 2 ? "bf16x2" : "bf16x3";
#endif
  return "f32";
}

void qmm_t_gemv_q4(const QmmArgs& a, float* y) {
  const int64_t K = a.K, chunks = K / 128, kw = chunks * 128, groups = K / a.group_size;
  // The K % 128 tail in codec order, and group sums for the hoisted bias.
  std::vector<float> buf(K - kw + groups);
  float* xtail = buf.data();
  float* xsum = xtail + (K - kw);
  for (int64_t p = kw; p < K; ++p) xtail[p - kw] = a.x[kw + codec_to_natural(4, p - kw)];
  for (int64_t g = 0; g < groups; ++g) {
    float t = 0.0f;
    for (int i = 0; i < a.group_size; ++i) t += a.x[g * a.group_size + i];
    xsum[g] = t;
  }
#if defined(__AVX512BF16__)
  if (!a.avoid_bf16) {
    switch (a.x_bf16_terms) {
      case 1: return gemv_bf16<1>(a, chunks, xtail, xsum, y);
      case 2: return gemv_bf16<2>(a, chunks, xtail, xsum, y);
      default: return gemv_bf16<3>(a, chunks, xtail, xsum, y);
    }
  }
#endif
  std::vector<float> xw(kw);
  prepare_f32(a.x, chunks, xw.data());
  gemv<F32Chunk>(a, xw.data(), xtail, xsum, y);
}

#else  // no AVX-512: the blocks of qmm_fused.cpp serve M=1 too.

const char* qmm_t_gemv_q4_tile(const QmmArgs&) { return nullptr; }
void qmm_t_gemv_q4(const QmmArgs&, float*) { TORCH_CHECK(false, "affine_qmm: the 4-bit M=1 kernel needs AVX-512"); }

#endif

}  // namespace cpu
}  // namespace torch_qmm
