// How many threads a CPU call runs on: at most torch's intra-op thread count, and one thread per
// kMinMacsPerThread multiply-adds of the call, so that a call of tens of microseconds runs on the
// calling thread alone, with no parallel region. And the spans of W rows those threads take
// (SpanSchedule).
//
// Why: a parallel region (at::parallel_for, OpenMP) ends only when every thread of its team has
// started, even one that finds the work already taken. Where other processes use the cores, a
// team thread can wait for its core up to a scheduler time slice (milliseconds), and a small call
// pays that wait whole. Measured on the 2-core Zen 4 of benchmarks/README.md, QuantLinear
// 576 -> 1536 affine 4-bit, M = 1, next to two busy processes: 16.0 ms a call split over two
// threads, 73 us on one (F.linear: 74-97 us); with no other process, two threads took 51-60 us.
// A call with work for several threads still pays the wait (4096 x 4096 4-bit, M = 1: 8.0 ms on
// two threads next to a busy process, 0.66-0.74 ms on one).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace torch_qmm {
namespace cpu {

constexpr int64_t kMinMacsPerThread = int64_t(1) << 20;

// Threads for a call of M x N x K multiply-adds (1 inside a parallel region).
inline int64_t threads_for_work(int64_t M, int64_t N, int64_t K) {
  if (at::in_parallel_region()) return 1;
  const int64_t macs = std::max<int64_t>(M, 1) * std::max<int64_t>(N, 1) * std::max<int64_t>(K, 1);
  return std::clamp<int64_t>(macs / kMinMacsPerThread, 1, std::max<int64_t>(at::get_num_threads(), 1));
}

// A grain for at::parallel_for over `range` items that keeps the call to threads_for_work's
// threads (at::parallel_for makes at most range / grain tasks), and at least `grain`.
inline int64_t grain_for_work(int64_t range, int64_t grain, int64_t M, int64_t N, int64_t K) {
  const int64_t threads = threads_for_work(M, N, K);
  return std::max<int64_t>(grain, (range + threads - 1) / threads);
}

constexpr int64_t kSpanRows = 128;  // W rows per work item at most (320 KB of 4-bit W at K=5120)
constexpr int64_t kMinSpanRows = 16;

// W rows per work item for N rows on `threads` threads: kSpanRows, or fewer so that every thread
// has at least 4 spans to take (many cores: a thread that starts late still finds work), in
// multiples of 8 (whole tiles), not below kMinSpanRows.
inline int64_t span_rows_for(int64_t N, int64_t threads) {
  const int64_t even = (N / (4 * std::max<int64_t>(threads, 1))) / 8 * 8;
  return std::clamp<int64_t>(even, kMinSpanRows, kSpanRows);
}

// The work items of a call over N rows of W on `threads` threads: spans of span_rows_for's rows,
// and, with more than one thread, the last rows (one such span per thread, or all N if fewer) in
// spans of kMinSpanRows. The threads take items in order from one counter, so they run out of
// work within one short span of each other, where a long span taken last would keep the others
// waiting for up to its length at the end of the call.
struct SpanSchedule {
  int64_t N, span, long_spans, count;
  SpanSchedule(int64_t n, int64_t threads) : N(n), span(span_rows_for(n, threads)) {
    const int64_t short_rows = threads > 1 ? std::min(N, threads * span) : 0;
    long_spans = (N - short_rows + span - 1) / span;
    const int64_t rest = std::max<int64_t>(N - long_spans * span, 0);
    count = long_spans + (rest + kMinSpanRows - 1) / kMinSpanRows;
  }
  // Rows [first, second) of item i < count.
  std::pair<int64_t, int64_t> rows(int64_t i) const {
    const int64_t n0 = i < long_spans ? i * span : long_spans * span + (i - long_spans) * kMinSpanRows;
    return {n0, std::min(N, n0 + (i < long_spans ? span : kMinSpanRows))};
  }
};

}  // namespace cpu
}  // namespace torch_qmm
