// Fused decode-and-multiply kernels for small M (both transpose modes). See qmm_kernels.h.
//
// transpose=True  (W [N, K], rows packed along K), one task = a range of W rows:
//
//     for n:                          W row n (K*BITS/8 bytes) stays in L1 across m-blocks
//       for m-block of MB <= 4 rows:
//         for 32-code block kb:       decode -> w0, w1 (16 lanes each) = s*q + b
//           acc[m][c] += w * x[m, kb*32 ..]       (x columns in codec order)
//         y[m, n] = sum of the lanes of acc[m][*]
//
//   For MB=1 four independent accumulators (two blocks in flight) hide the FMA latency.
//   The bias is folded into w (one FMA per 16 codes, shared by the MB rows) rather than hoisted
//   as b*sum(x): it costs nothing measurable and keeps one code path for all M.
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

#include "decode.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {
namespace {

template <int BITS, typename T, int MB>
struct TRow {
  using Blk = Block32<BITS>;
  static constexpr int C = MB == 1 ? 4 : 2;  // accumulator chains per row of x

  // One block kb into chains [c, c+1] of every row of the m-block.
  template <int c>
  static inline void step(const uint8_t* row, const T* s, const T* b, int gshift, int64_t kb,
                          const float* const* xr, f32x16 (&acc)[MB][C]) {
    f32x16 v0, v1;
    Blk::decode(row + kb * Blk::kBytes, v0, v1);
    const f32x16 sv = splat16(static_cast<float>(s[kb >> gshift]));
    const f32x16 bv = splat16(static_cast<float>(b[kb >> gshift]));
    const f32x16 w0 = v0 * sv + bv, w1 = v1 * sv + bv;
    for (int m = 0; m < MB; ++m) {
      acc[m][c] += w0 * load16(xr[m] + kb * 32);
      acc[m][c + 1] += w1 * load16(xr[m] + kb * 32 + 16);
    }
  }

  static void run(const QmmArgs& a, int64_t n, int64_t m0, float* y) {
    const int64_t blocks = a.K / 32, groups = a.K / a.group_size;
    const int gshift = block_to_group_shift(a.group_size);
    const uint8_t* row = a.wq + n * blocks * Blk::kBytes;
    const T* s = static_cast<const T*>(a.scales) + n * groups;
    const T* b = static_cast<const T*>(a.biases) + n * groups;
    const float* xr[MB];
    for (int m = 0; m < MB; ++m) xr[m] = a.x + (m0 + m) * a.K;
    f32x16 acc[MB][C] = {};
    int64_t kb = 0;
    if constexpr (C == 4) {
      for (; kb + 2 <= blocks; kb += 2) {
        step<0>(row, s, b, gshift, kb, xr, acc);
        step<2>(row, s, b, gshift, kb + 1, xr, acc);
      }
    }
    for (; kb < blocks; ++kb) step<0>(row, s, b, gshift, kb, xr, acc);
    for (int m = 0; m < MB; ++m) {
      f32x16 t = acc[m][0] + acc[m][1];
      if constexpr (C == 4) t += acc[m][2] + acc[m][3];
      y[(m0 + m) * a.N + n] = hsum16(t);
    }
  }
};

template <int BITS, typename T>
void t_fused(const QmmArgs& a, float* y) {
  // ~64 KB of packed weights per task at 4 bits and K=4096: enough work to amortize scheduling.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(a.K, 1));
  at::parallel_for(0, a.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      int64_t m0 = 0;
      for (; m0 + 4 <= a.M; m0 += 4) TRow<BITS, T, 4>::run(a, n, m0, y);
      switch (a.M - m0) {
        case 3: TRow<BITS, T, 3>::run(a, n, m0, y); break;
        case 2: TRow<BITS, T, 2>::run(a, n, m0, y); break;
        case 1: TRow<BITS, T, 1>::run(a, n, m0, y); break;
        default: break;
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
  at::parallel_for(0, spans, 1, [&](int64_t i0, int64_t i1) {
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
