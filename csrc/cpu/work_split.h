// How many threads a CPU call runs on: at most torch's intra-op thread count, and one thread per
// kMinMacsPerThread multiply-adds of the call, so that a call of tens of microseconds runs on the
// calling thread alone, with no parallel region.
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

}  // namespace cpu
}  // namespace torch_qmm
