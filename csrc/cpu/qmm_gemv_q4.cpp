// 4-bit, transpose=True, M=1 (token decode): y[n] = sum_k x[k] * (s*q + b), AVX-512 only.
//
// This shape is bound by how fast one core turns packed nibbles into FMAs (~8 GB/s with the
// 32-code blocks of decode.h: widen (a cross-lane shuffle), and, shift, two converts, two FMAs).
// Here a 64-byte load is one *chunk* of 128 codes, seen as 16 dwords of 8 nibbles each:
//
//   chunk c of a packed row (little-endian words, code i at bits 4i of word i/8)
//     dword l (lane l) = codes 128c + 8l + 0 .. 8l + 7
//   vector j (0..7), lane l:  w & (15 << 4j)  =  q[128c + 8l + j] * 16^j     (no shift, no shuffle)
//   converted unsigned (exact: 4 significant bits), times xw[c][j][l] = x[128c + 8l + j] * 2^-4j
//
// so every 16 codes cost one and, one convert and one FMA, all in-lane. Scaling x by a power of
// two (once per call) makes each product exactly q*x: the result is what q*x would give in the
// same order, unless x*2^-28 would be subnormal (|x| < 2^-98), where we fall back (returns false).
// Lane l of a chunk lies in group (8l) / group_size, so the scale is a per-lane vector built with
// one broadcast + one in-lane byte shuffle; the bias is hoisted out of the loop entirely:
//   y[n] = sum_c hsum(s_c * p_c) + sum_g b[g] * xsum[g]        (xsum[g] = sum of x over group g)
// with the bias dot done 16 groups per FMA after the row.
//
// Tiles of 4 W rows share each x load; while a tile runs, the next tile (4 rows further on) is
// prefetched into L2, the one thing that let a core stream ~16 GB/s instead of ~11 (the hardware
// prefetcher alone does not run far enough ahead of 4 interleaved streams). Work is handed out
// in spans of rows from a shared counter (see gemv).
// K % 128 (at most 3 blocks of 32 codes) is done with the blocks of decode.h, x in codec order.
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

// Rows [n, n+R): y[n+r] = sum over chunks of s*q*x (the part of K that is whole chunks).
template <typename T, int R, int G>
void tile(const QmmArgs& a, int64_t n, const float* xw, float* acc_out) {
  const int64_t chunks = a.K / 128, row_bytes = a.K / 2, groups = a.K / G;
  const uint8_t* row[R];
  const T* s[R];
  for (int r = 0; r < R; ++r) {
    row[r] = a.wq + (n + r) * row_bytes;
    s[r] = static_cast<const T*>(a.scales) + (n + r) * groups;
  }
  // The next tile's scales and biases too: 2*R more streams than the hardware prefetcher
  // follows well (float32 scales: ~10-15% faster with this, 2 threads).
  {
    const T* bias = static_cast<const T*>(a.biases) + (n + R) * groups;
    for (int64_t off = 0; off < R * groups * int64_t(sizeof(T)); off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(s[0] + R * groups) + off, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(bias) + off, _MM_HINT_T1);
    }
  }
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      // The same chunk of the next tile's row r: the rows are contiguous.
      _mm_prefetch(reinterpret_cast<const char*>(row[r] + R * row_bytes + c * 64), _MM_HINT_T1);
      w[r] = _mm512_loadu_si512(row[r] + c * 64);
    }
    // One chain per row: 8 FMAs per chunk at 4 cycles each hide under the other rows' work.
    __m512 p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_ps();
    const float* xc = xw + c * 128;
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
template <typename T, int G>
void run_span(const QmmArgs& a, int64_t i, const float* xw, const float* xtail, const float* xsum, float* y) {
  const int64_t n1 = std::min(a.N, (i + 1) * kSpanRows);
  float part[kTileRows];
  int64_t n = i * kSpanRows;
  for (; n + kTileRows <= n1; n += kTileRows) {
    tile<T, kTileRows, G>(a, n, xw, part);
    for (int r = 0; r < kTileRows; ++r) y[n + r] = part[r] + row_rest<T, G>(a, n + r, xtail, xsum);
  }
  for (; n < n1; ++n) {
    tile<T, 1, G>(a, n, xw, part);
    y[n] = part[0] + row_rest<T, G>(a, n, xtail, xsum);
  }
}

template <typename T, int G>
void gemv(const QmmArgs& a, const float* xw, const float* xtail, const float* xsum, float* y) {
  const int64_t spans = (a.N + kSpanRows - 1) / kSpanRows;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), spans), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < spans;) run_span<T, G>(a, i, xw, xtail, xsum, y);
  });
}

}  // namespace

bool qmm_t_gemv_q4(const QmmArgs& a, float* y) {
  if (a.bits != 4 || a.M != 1 || a.K < 128) return false;
  const int64_t K = a.K, kw = K / 128 * 128, groups = K / a.group_size;
  // x -> xw (chunk order, lanes of vector j scaled by 2^-4j), tail in codec order, group sums.
  std::vector<float> buf(K + groups);
  float* xw = buf.data();
  float* xsum = xw + K;
  // Multiplying by 2^-4j is exact for |v| >= 2^-98 (a libm ldexp per element cost ~2% of the call).
  static constexpr float kPow[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f};
  bool tiny = false;
  for (int64_t c = 0; c < kw / 128; ++c)
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l) {
        const float v = a.x[128 * c + 8 * l + j];
        tiny |= v != 0.0f && std::fabs(v) < 0x1p-98f;  // v * 2^-28 would lose bits
        xw[128 * c + 16 * j + l] = v * kPow[j];
      }
  if (tiny) return false;
  for (int64_t p = kw; p < K; ++p) xw[p] = a.x[kw + codec_to_natural(4, p - kw)];
  for (int64_t g = 0; g < groups; ++g) {
    float t = 0.0f;
    for (int i = 0; i < a.group_size; ++i) t += a.x[g * a.group_size + i];
    xsum[g] = t;
  }
  bool done = true;
  dispatch_bits_dtype(4, a.dtype, [&](auto, auto t) {
    using T = decltype(t);
    switch (a.group_size) {
      case 32: gemv<T, 32>(a, xw, xw + kw, xsum, y); break;
      case 64: gemv<T, 64>(a, xw, xw + kw, xsum, y); break;
      case 128: gemv<T, 128>(a, xw, xw + kw, xsum, y); break;
      default: done = false;
    }
  });
  return done;
}

#else  // no AVX-512: the blocks of qmm_fused.cpp serve M=1 too.

bool qmm_t_gemv_q4(const QmmArgs&, float*) { return false; }

#endif

}  // namespace cpu
}  // namespace torch_qmm
