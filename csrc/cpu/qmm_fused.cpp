// Fused decode-and-multiply kernels for small M (both transpose modes). See qmm_kernels.h.
//
// transpose=True  (W [N, K], rows packed along K), one task = a range of W rows:
//
//     for block of 16 W rows:  for K chunk (1024 codes; all of K when M <= 2):
//       for m-block of MB <= 4 rows of x:  for pair of W rows (n, n+1):
//         for 32-code block kb:   decode -> w[r][0..1] (16 lanes each) = s*q + b
//           acc[m][r][*] += w[r][*] * x[m, kb*32 ..]     (x columns in codec order)
//         y[m, n+r] += sum of the lanes of acc[m][r][*]
//
//   The x chunk of an m-block (16 KB) and the W chunk of the row block (8 KB at 4 bits) stay in
//   L1; each x load feeds two W rows. The bias is folded into w (one FMA per 16 codes, shared by
//   the MB rows of x); for a single row it is hoisted: y += s*sum(q*x) + b*sum(x) per group.
//
// transpose=False (W [K, N], rows packed along N), one task = a span of 64 (or 32) columns:
//
//     for m-block:  for k:  for block in span:   w = s[k,g]*q + b[k,g]
//                                                acc[m][*] += x[m, k] * w
//     y[m, span] = acc in natural order
//
//   Accumulators stay in registers for the whole K loop; each span reads 2 * 4*BITS bytes of
//   every packed row (strided; the hardware prefetcher follows it).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "decode.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"
#include "work_split.h"

namespace torch_qmm {
namespace cpu {
namespace {

// Pointers to the packed words, scales and biases of W rows [n, n+R).
template <int BITS, typename T, int R>
struct TileRows {
  const uint8_t* packed[R];
  const T* scales[R];
  const T* biases[R];
  TileRows(const QmmArgs& a, int64_t n) {
    const int64_t row_bytes = a.K / 32 * Block32<BITS>::kBytes, groups = a.K / a.group_size;
    for (int r = 0; r < R; ++r) {
      packed[r] = a.wq + (n + r) * row_bytes;
      scales[r] = static_cast<const T*>(a.scales) + (n + r) * groups;
      biases[r] = static_cast<const T*>(a.biases) + (n + r) * groups;
    }
  }
};

// Rows [n, n+R) of W times rows [m0, m0+MB) of x over blocks [kb0, kb1) (whole groups); adds
// into y. MB > 1: w = s*q + b is formed once per block and shared by the MB rows of x.
template <int BITS, typename T, int MB, int R>
struct TTile {
  using Blk = Block32<BITS>;

  static void run(const QmmArgs& a, int64_t n, int64_t m0, int64_t kb0, int64_t kb1, const float*, float* y) {
    const int gshift = block_to_group_shift(a.group_size);
    const TileRows<BITS, T, R> rows(a, n);
    const uint8_t* const* row = rows.packed;
    const T* const* s = rows.scales;
    const T* const* b = rows.biases;
    // Two chains per (m, r): v0 and v1 of a block go to different accumulators.
    f32x16 acc[MB][R][2] = {};
    for (int64_t g = kb0 >> gshift; g < kb1 >> gshift; ++g) {
      f32x16 sv[R], bv[R];
      for (int r = 0; r < R; ++r) {
        sv[r] = splat16(static_cast<float>(s[r][g]));
        bv[r] = splat16(static_cast<float>(b[r][g]));
      }
      for (int64_t kb = g << gshift; kb < (g + 1) << gshift; ++kb) {
        f32x16 w[R][2];
        for (int r = 0; r < R; ++r) {
          f32x16 v0, v1;
          Blk::decode(row[r] + kb * Blk::kBytes, v0, v1);
          w[r][0] = v0 * sv[r] + bv[r];
          w[r][1] = v1 * sv[r] + bv[r];
        }
        for (int m = 0; m < MB; ++m) {
          const float* xk = a.x + (m0 + m) * a.K + kb * 32;
          const f32x16 x0 = load16(xk), x1 = load16(xk + 16);
          for (int r = 0; r < R; ++r) {
            acc[m][r][0] += w[r][0] * x0;
            acc[m][r][1] += w[r][1] * x1;
          }
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) y[(m0 + m) * a.N + n + r] += hsum16(acc[m][r][0] + acc[m][r][1]);
  }
};

// MB = 1 (decode, M=1): the bias is hoisted, y += s * sum(q*x) + b * sum(x) per group, with
// sum(x) per group precomputed (xsum): one FMA per 16 codes instead of two.
template <int BITS, typename T, int R, int BPG>  // BPG: blocks per group (compile-time: no inner loop)
struct TTileHoisted {
  using Blk = Block32<BITS>;

  static void run(const QmmArgs& a, int64_t n, int64_t m0, int64_t kb0, int64_t kb1, const float* xsum,
                  float* y) {
    const int64_t groups = a.K / a.group_size;
    constexpr int gshift = BPG == 1 ? 0 : BPG == 2 ? 1 : 2;
    const float* x = a.x + m0 * a.K;
    xsum += m0 * groups;
    const TileRows<BITS, T, R> rows(a, n);
    const uint8_t* const* row = rows.packed;
    const T* const* s = rows.scales;
    const T* const* b = rows.biases;
    f32x16 acc[R] = {};
    float bias_acc[R] = {};
    for (int64_t g = kb0 >> gshift; g < kb1 >> gshift; ++g) {
      // One core alone does not reach the memory bandwidth on these streams: ask 1 KB ahead.
      for (int r = 0; r < R; ++r) __builtin_prefetch(row[r] + (g << gshift) * Blk::kBytes + 1024);
      f32x16 p[R][2] = {};
      for (int64_t kb = g << gshift; kb < (g + 1) << gshift; ++kb) {
        const f32x16 x0 = load16(x + kb * 32), x1 = load16(x + kb * 32 + 16);
        for (int r = 0; r < R; ++r) {
          f32x16 v0, v1;
          Blk::decode(row[r] + kb * Blk::kBytes, v0, v1);
          p[r][0] += v0 * x0;
          p[r][1] += v1 * x1;
        }
      }
      for (int r = 0; r < R; ++r) {
        acc[r] += (p[r][0] + p[r][1]) * splat16(static_cast<float>(s[r][g]));
        bias_acc[r] += static_cast<float>(b[r][g]) * xsum[g];
      }
    }
    for (int r = 0; r < R; ++r) y[m0 * a.N + n + r] += hsum16(acc[r]) + bias_acc[r];
  }
};

template <int BITS, typename T, int MB>
void t_rows(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t kb0, int64_t kb1, const float* xsum,
            float* y) {
  int64_t n = n0;
  if constexpr (MB == 1) {  // hoisted bias: one FMA per 16 codes instead of two (TTileHoisted)
    auto rows = [&](auto bpg) {
      constexpr int G = decltype(bpg)::value;
      for (; n + 2 <= n1; n += 2) TTileHoisted<BITS, T, 2, G>::run(a, n, m0, kb0, kb1, xsum, y);
      if (n < n1) TTileHoisted<BITS, T, 1, G>::run(a, n, m0, kb0, kb1, xsum, y);
    };
    switch (a.group_size) {
      case 32: rows(std::integral_constant<int, 1>{}); break;
      case 64: rows(std::integral_constant<int, 2>{}); break;
      default: rows(std::integral_constant<int, 4>{}); break;
    }
    return;
  }
  for (; n + 2 <= n1; n += 2) TTile<BITS, T, MB, 2>::run(a, n, m0, kb0, kb1, xsum, y);
  if (n < n1) TTile<BITS, T, MB, 1>::run(a, n, m0, kb0, kb1, xsum, y);
}

template <int BITS, typename T>
void t_fused(const QmmArgs& a, float* y) {
  // K is walked in chunks whose slice of x (4 rows) stays in L1 (16 KB); for M <= 2 the x rows
  // fit in L2 anyway and whole rows keep W a sequential stream. Within a chunk, pairs of W rows
  // share each x load; kRowBlock rows' chunks (8 KB at 4 bits) stay in L1 across m-blocks.
  constexpr int64_t kRowBlock = 16;
  const int64_t blocks = a.K / 32;
  const int64_t chunk = a.M <= 2 ? blocks : 32;
  std::fill(y, y + a.M * a.N, 0.0f);
  // Per-group sums of x for the hoisted bias of the single-row tiles (the last M % 4 rows).
  const int64_t groups = a.K / a.group_size;
  std::vector<float> xsum(a.M * groups);
  for (int64_t i = 0; i < a.M * groups; ++i) {
    float t = 0.0f;
    for (int j = 0; j < a.group_size; ++j) t += a.x[i * a.group_size + j];
    xsum[i] = t;
  }
  // ~64 KB of packed weights per task at 4 bits and K=4096: enough work to amortize scheduling.
  const int64_t grain = grain_for_work(a.N, std::max<int64_t>(kRowBlock, (int64_t(1) << 17) / std::max<int64_t>(a.K, 1)),
                                       a.M, a.N, a.K);
  at::parallel_for(0, a.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += kRowBlock) {
      const int64_t ne = std::min(n1, nb + kRowBlock);
      for (int64_t kb = 0; kb < blocks; kb += chunk) {
        const int64_t ke = std::min(blocks, kb + chunk);
        int64_t m0 = 0;
        for (; m0 + 4 <= a.M; m0 += 4) t_rows<BITS, T, 4>(a, nb, ne, m0, kb, ke, xsum.data(), y);
        switch (a.M - m0) {
          case 3: t_rows<BITS, T, 3>(a, nb, ne, m0, kb, ke, xsum.data(), y); break;
          case 2: t_rows<BITS, T, 2>(a, nb, ne, m0, kb, ke, xsum.data(), y); break;
          case 1: t_rows<BITS, T, 1>(a, nb, ne, m0, kb, ke, xsum.data(), y); break;
          default: break;
        }
      }
    }
  });
}

template <int BITS, typename T, int MB, int NBLK>
struct NSpan {
  using Blk = Block32<BITS>;

  // Columns [c0, c0 + 32*NBLK) of rows m0 .. m0+MB of y.
  static void run(const QmmArgs& a, int64_t c0, int64_t m0, float* y) {
    const int64_t row_bytes = a.N / 32 * Blk::kBytes, groups = a.N / a.group_size;
    const T* S = static_cast<const T*>(a.scales);
    const T* B = static_cast<const T*>(a.biases);
    f32x16 acc[MB][2 * NBLK] = {};
    const uint8_t* p = a.wq + (c0 / 32) * Blk::kBytes;
    for (int64_t k = 0; k < a.K; ++k, p += row_bytes) {
      f32x16 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = splat16(a.x[(m0 + m) * a.K + k]);
      for (int j = 0; j < NBLK; ++j) {
        const int64_t g = k * groups + (c0 + 32 * j) / a.group_size;
        f32x16 v0, v1;
        Blk::decode(p + j * Blk::kBytes, v0, v1);
        const f32x16 sv = splat16(static_cast<float>(S[g])), bv = splat16(static_cast<float>(B[g]));
        const f32x16 w0 = v0 * sv + bv, w1 = v1 * sv + bv;
        for (int m = 0; m < MB; ++m) {
          acc[m][2 * j] += xv[m] * w0;
          acc[m][2 * j + 1] += xv[m] * w1;
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      float* yr = y + (m0 + m) * a.N + c0;
      for (int j = 0; j < NBLK; ++j) {
        float lanes[2][kLanes];
        store16(lanes[0], acc[m][2 * j]);
        store16(lanes[1], acc[m][2 * j + 1]);
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < kLanes; ++l) yr[32 * j + Blk::natural(h, l)] = lanes[h][l];
      }
    }
  }
};

template <int BITS, typename T, int NBLK>
void n_span_all_rows(const QmmArgs& a, int64_t c0, float* y) {
  int64_t m0 = 0;
  for (; m0 + 4 <= a.M; m0 += 4) NSpan<BITS, T, 4, NBLK>::run(a, c0, m0, y);
  switch (a.M - m0) {
    case 3: NSpan<BITS, T, 3, NBLK>::run(a, c0, m0, y); break;
    case 2: NSpan<BITS, T, 2, NBLK>::run(a, c0, m0, y); break;
    case 1: NSpan<BITS, T, 1, NBLK>::run(a, c0, m0, y); break;
    default: break;
  }
}

template <int BITS, typename T>
void n_fused(const QmmArgs& a, float* y) {
  // Spans of 64 columns (a full cache line of 4-bit codes per packed row); N is a multiple of
  // the group size, so at most one trailing span of 32.
  const int64_t spans = (a.N + 63) / 64;
  at::parallel_for(0, spans, grain_for_work(spans, 1, a.M, a.N, a.K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c0 = i * 64;
      if (c0 + 64 <= a.N)
        n_span_all_rows<BITS, T, 2>(a, c0, y);
      else
        n_span_all_rows<BITS, T, 1>(a, c0, y);
    }
  });
}

}  // namespace

void qmm_t_fused(const QmmArgs& a, float* y) {
  dispatch_bits_dtype(a.bits, a.dtype, [&](auto bits_c, auto t) { t_fused<decltype(bits_c)::value, decltype(t)>(a, y); });
}

void qmm_n_fused(const QmmArgs& a, float* y) {
  dispatch_bits_dtype(a.bits, a.dtype, [&](auto bits_c, auto t) { n_fused<decltype(bits_c)::value, decltype(t)>(a, y); });
}

}  // namespace cpu
}  // namespace torch_qmm
