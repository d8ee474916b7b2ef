// The chunk driver: how every CPU chunk kernel (affine, GGUF, the fp modes; any ISA) walks W and x.
// Glossary (csrc/cpu/):
//   block     32 codes of one packed row (decode.h), or a GGUF super-block of 256 weights
//   chunk     what one load of a packed row brings into a register: 64 bytes on AVX-512 (32
//             bytes on AVX2), or a GGUF super-block; the unit a multiplier decodes and multiplies
//   plane     a field of every lane of a chunk (chunk.h: bits [F*j, F*j + F) of each u16 word)
//   tile      R rows of W x MB rows of x, accumulated in registers over all whole chunks of K
//   span      up to kSpanRows rows of W (work_split.h: SpanSchedule): one work item, taken by threads from a
//             shared counter
//   multiplier how the codes of a chunk meet x (chunk.h: F32Multiplier, Bf16Multiplier;
//             chunk_avx2.h): the name a route reports ("chunked/<multiplier>")
//   kernel    a format's policy for this driver (`Kern` below): a multiplier, the format's
//             scales and its offset terms
//
// A kernel `Kern` (an object built per call, holding the operands) provides:
//   using X, Acc;                  prepared-x element type; accumulator (a SIMD vector)
//   kXPerChunk, kSidePerChunk      per x row and chunk: X values, and floats of side data (e.g.
//                                  GGUF sub-block sums of x that the chunk's own offsets need)
//   kMaxXBlock                     the largest block of x rows (4, 2 or 1) a tile takes
//   kThreeRowBlocks (optional)     true: 3 rows of x left take one block of 3 (one decode of W)
//                                  rather than 2 + 1 (two), for kernels whose decode of a chunk
//                                  costs more than its FMAs (the lattice i-quants)
//   tile_rows(mb)                  W rows per tile for mb x rows (registers)
//   slab_bytes(mb)                 the budget of a K slab at mb x rows (kSlabBytes), or 0: the
//                                  whole K in one pass (see Work)
//   chunks, rest_floats            whole chunks per W row; floats per x row kept for rest()
//   part_chunks                    where a part of a row of x may start: at multiples of this
//                                  many chunks (whole groups of the format's side sums)
//   row(n)                         the packed bytes of W row n
//   prepare_part(x, c0, c1, xc, side, rest)  chunks [c0, c1) of one row of x (natural order, K
//                                  floats; xc, side, rest: that row's prepared storage) into
//                                  their prepared forms, with the entries of rest that the K
//                                  range of those chunks owns; the part ending at `chunks` owns
//                                  the K tail too. Parts write disjoint storage (see Work).
//   start_tile<R>(n, c0, c1)       before chunks [c0, c1) of tile n (prefetches)
//   chunk<R, MB>(n, row, c, xc, side, acc)   acc[r][m] += chunk c of W rows n+r times x row m,
//                                  scaled (always inlined: a call sends registers through memory)
//   zero(), reduce(acc)            a zero accumulator; its lanes summed
//   rest(n, rest)                  what the whole chunks leave out of y[m, n] for x row m: the K
//                                  tail past the last whole chunk and hoisted offset terms
//                                  (affine biases: sum_g b[g] * sum of x over g); 0 where none
// so that y[m, n] = reduce(sum over chunks) + rest(n, ...). Accumulation is float32 everywhere.
//
// Work, all in one parallel region (run): first x is prepared, each row in parts along K
// (x_parts_for: at small M a row is cut into as many parts as the team has threads, so that no
// thread prepares a whole row while the others wait; one row of K = 14336 takes 8-18 us on one
// thread where x is rearranged value by value, as the affine and bfloat16 kernels do), the parts taken by the threads from a shared counter; once every part is done, W rows go
// out in spans (SpanSchedule) from a second counter, so a thread that loses its core to another
// process leaves its share to the others. Within a span, the rows of x go in blocks of 4/2/1; each
// block runs over the whole span, so each chunk is decoded once per block of x rows. A block may
// walk K in slabs (slab_chunks): every tile of the span takes the slab's chunks, then the next
// slab, so the slab's prepared x (a few KB per row of x) stays in L1 for all the span's rows, where
// a pass over the whole K per tile reads x from L2 again for every tile (at K = 14336, 57 KB of
// float32 x per row: at 4 rows of x, 4 such loads per W load). The accumulators of every tile carry
// over from slab to slab (`partial`), so each y[m, n] is summed over the chunks in the same order,
// and rounded the same, as in one pass. The price is W read in short runs of each row (the next
// tile's run prefetched while this one is multiplied), which only pays where x traffic is the
// bound: measured on Zen 3 (4096 x 14336, 2 threads), the AVX2 Q4_K / Q6_K kernels at 4 rows of x
// gain 15-20% (Q4_K float32 M=4: 6.6 -> 5.3 ms, M=8: 12.8 -> 10.3), and the AVX-512 bfloat16 ones
// (Zen 4) 25-30%; at 1-2 rows of x, and for the affine, the AVX-512 float32 and the int8 kernels at
// any rows, slabs lose 0-40%: those take the whole K in one pass (their slab_bytes).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "work_split.h"

namespace torch_qmm {
namespace cpu {
namespace chunk {

// Whether the affine chunk kernels may take x: finite, and every nonzero |x| in [2^-98, 2^100].
// Below, the float32 multipliers' x * 2^-28 (chunk.h; 2^-24 in chunk_avx2.h) and the bfloat16
// terms (flushed by vdpbf16ps under 2^-126) would lose bits; above, the unscaled sums of q * x (up to 128 * 255 * |x| per group) could overflow
// where s * q * x does not. Other x take the fused kernel, which scales before multiplying.
// Whether the bits of every nonzero |x| lie in [lo, end) (integer compares vectorize; NaN and
// Inf lie above any finite end).
inline bool abs_bits_within(const float* x, int64_t n, uint32_t lo, uint32_t end) {
  uint32_t bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    std::memcpy(&u, x + k, 4);
    u &= 0x7FFFFFFFu;
    bad |= uint32_t(u - lo >= end - lo) & uint32_t(u != 0);  // u - lo wraps below lo
  }
  return bad == 0;
}

// On the bits of |x|: 0, or [2^-98, 2^100] (0x0E800000 and 0x71800000).
inline bool x_in_range(const float* x, int64_t n) { return abs_bits_within(x, n, 0x0E800000u, 0x71800000u + 1); }

// 2^e, exactly (e within float32's normal exponents).
constexpr float pow2(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}

// The kernels whose code fields are the bits of subnormal floats (gguf_avx2.cpp, Fields<true>)
// take x times 2^(kSubnormalX - s) for a field at bit s <= 16, and sum products
// q * x * 2^(kSubnormalX - 149). Those sums round as the unscaled ones do, and x times the factor
// stays finite, for every nonzero |x| in [2^(23 - kSubnormalX), 2^(128 - kSubnormalX)): the
// smallest step of a sum, ulp(x) for the smallest |x|, times 2^(kSubnormalX - 149), is at least
// the subnormal step 2^-149. With 80: [2^-57, 2^48).
constexpr int kSubnormalX = 80;

// Whether x suits those kernels: finite, and every nonzero |x| in [2^-57, 2^48) (on the bits of
// |x|, as x_in_range; that range lies inside x_in_range's).
inline bool x_in_subnormal_range(const float* x, int64_t n) {
  constexpr uint32_t lo = uint32_t(127 + 23 - kSubnormalX) << 23;
  constexpr uint32_t end = uint32_t(127 + 128 - kSubnormalX) << 23;
  return abs_bits_within(x, n, lo, end);
}

// Storage that starts on a cache line (64 bytes). The multipliers read prepared x in 32-byte
// vectors at multiples of 32 bytes from the start of a row; from an address malloc gives (16 bytes
// past a multiple of 32, often) every other such load would span two cache lines.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using CacheLineVector = std::vector<T, CacheLineAllocator<T>>;

// Rows of x (and what rest() needs), prepared once per call. A row's stride is a whole number of
// chunks; rows start on 32-byte boundaries where kXPerChunk * sizeof(X) is a multiple of 32.
template <typename Kern>
struct PreparedX {
  CacheLineVector<typename Kern::X> x;  // per row: chunks * kXPerChunk
  CacheLineVector<float> side;          // per row: chunks * kSidePerChunk
  std::vector<float> rest;              // per row: rest_floats
  int64_t x_stride = 0, side_stride = 0, rest_stride = 0;

  PreparedX(const Kern& kern, int64_t M)
      : x_stride(kern.chunks * Kern::kXPerChunk), side_stride(kern.chunks * Kern::kSidePerChunk),
        rest_stride(kern.rest_floats) {
    x.resize(M * x_stride);
    side.resize(M * side_stride);
    rest.resize(M * rest_stride);
  }
};

// The part_chunks of a kernel whose chunks hold `codes` codes and whose side sums run over groups
// of G codes: parts start on group boundaries (codes and G are powers of two).
constexpr int64_t chunks_per_group(int64_t G, int64_t codes) { return G > codes ? G / codes : 1; }

// sums[g] = x[g*G] + ... + x[g*G + G-1] (in that order) for the groups [g0, g1) of one row of x:
// the hoisted bias terms of the affine kernels.
inline void group_sums(const float* x, int G, int64_t g0, int64_t g1, float* sums) {
  for (int64_t g = g0; g < g1; ++g) {
    float t = 0.0f;
    for (int i = 0; i < G; ++i) t += x[g * G + i];
    sums[g] = t;
  }
}

// The whole number in the environment variable `name`, read at each call: -1 where unset or
// empty; a value that is not a whole number in [lo, hi] is an error (ValueError) naming the
// variable and `what` it must be, never silently the default.
inline int64_t env_count(const char* name, long long lo, long long hi, const char* what) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return -1;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end != v && *end == '\0' && errno == 0 && n >= lo && n <= hi, "environment variable ", name,
                    " must be ", what, ", got '", v, "'");
  return int64_t(n);
}

// TORCH_QMM_CPU_X_PARTS=P: every row of x prepared in P parts (at most one per part_chunks
// chunks); -1 where unset. The results are the same for any P (the tests compare them).
inline int64_t x_parts_override() {
  return env_count("TORCH_QMM_CPU_X_PARTS", 1, 1 << 20, "a count of parts from 1 to 1048576");
}

// Parts per row of x for M rows on `threads` threads: enough that every thread has one (a whole
// row each where M >= threads), at most one per unit of part_chunks chunks (at least one part).
inline int64_t x_parts_for(int64_t M, int64_t threads, int64_t units, int64_t override_parts) {
  const int64_t want = override_parts > 0 ? override_parts : (threads + M - 1) / std::max<int64_t>(M, 1);
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(units, 1));
}

// Part i of `parts` of every row of x (i = row * parts + part) prepared: chunks [c0, c1), c0 and
// c1 on multiples of part_chunks, the last part ending at `chunks` (and owning the K tail).
template <typename Kern>
void prepare_part(const Kern& kern, const float* x, int64_t K, int64_t parts, int64_t i, PreparedX<Kern>& px) {
  const int64_t m = i / parts, p = i % parts, units = kern.chunks / kern.part_chunks;
  const int64_t c0 = p * units / parts * kern.part_chunks;
  const int64_t c1 = p + 1 == parts ? kern.chunks : (p + 1) * units / parts * kern.part_chunks;
  kern.prepare_part(x + m * K, c0, c1, px.x.data() + m * px.x_stride, px.side.data() + m * px.side_stride,
                    px.rest.data() + m * px.rest_stride);
}

// Bytes of prepared x and side data that one slab holds for the block's rows of x: half an L1 data
// cache (32 KB on Zen 3, 48 KB on recent Intel cores), leaving the rest to W's lines and the tile's
// parameters. TORCH_QMM_CPU_SLAB_BYTES=B sets the budget of every kernel (0: the whole K in one
// pass), read at each call: the results are the same for any budget (the tests compare them),
// only the speed differs.
constexpr int64_t kSlabBytes = 16 * 1024;

// TORCH_QMM_CPU_SLAB_BYTES, or -1 where unset (each kernel's own slab_bytes).
inline int64_t slab_bytes_override() {
  return env_count("TORCH_QMM_CPU_SLAB_BYTES", 0, std::numeric_limits<long long>::max(),
                   "a byte count (0: one pass over K)");
}

// Whole chunks per slab at MB rows of x (at least one; all of them for a budget of 0).
template <typename Kern, int MB>
int64_t slab_chunks(const Kern& kern, int64_t override_bytes) {
  const int64_t bytes = override_bytes >= 0 ? override_bytes : Kern::slab_bytes(MB);
  constexpr int64_t per_chunk = MB * (Kern::kXPerChunk * int64_t(sizeof(typename Kern::X)) +
                                      Kern::kSidePerChunk * int64_t(sizeof(float)));
  return bytes == 0 ? std::max<int64_t>(1, kern.chunks) : std::max<int64_t>(1, bytes / per_chunk);
}

// Chunks [c0, c1) of W rows [n, n+R) times MB rows of x (xr[m], sr[m]: that row's prepared x and
// side data), added to acc[r][m] (R x MB accumulators, kept in registers for the slab).
template <typename Kern, int R, int MB>
void tile(const Kern& kern, int64_t n, int64_t c0, int64_t c1, const typename Kern::X* const (&xr)[MB],
          const float* const (&sr)[MB], typename Kern::Acc* partial) {
  kern.template start_tile<R>(n, c0, c1);
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = kern.row(n + r);
  typename Kern::Acc acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = partial[r * MB + m];
  for (int64_t c = c0; c < c1; ++c) {
    const typename Kern::X* xc[MB];
    const float* sc[MB];
    for (int m = 0; m < MB; ++m) {
      xc[m] = xr[m] + c * Kern::kXPerChunk;
      sc[m] = sr[m] + c * Kern::kSidePerChunk;
    }
    kern.template chunk<R, MB>(n, row, c, xc, sc, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) partial[r * MB + m] = acc[r][m];
}

// W rows [n0, n1) times x rows [m0, m0 + MB) into y [M, N], slab by slab.
template <typename Kern, int MB>
void run_block(const Kern& kern, const PreparedX<Kern>& px, int64_t N, int64_t n0, int64_t n1, int64_t m0,
               int64_t slab_override, float* y) {
  constexpr int R = Kern::tile_rows(MB);
  const int64_t slab = slab_chunks<Kern, MB>(kern, slab_override);
  const typename Kern::X* xr[MB];
  const float* sr[MB];
  for (int m = 0; m < MB; ++m) {
    xr[m] = px.x.data() + (m0 + m) * px.x_stride;
    sr[m] = px.side.data() + (m0 + m) * px.side_stride;
  }
  // partial[(n - n0) * MB + m]: the accumulator of W row n and x row m0 + m.
  CacheLineVector<typename Kern::Acc> partial((n1 - n0) * MB, Kern::zero());
  for (int64_t c0 = 0; c0 < kern.chunks; c0 += slab) {
    const int64_t c1 = std::min(kern.chunks, c0 + slab);
    int64_t n = n0;
    for (; n + R <= n1; n += R) tile<Kern, R, MB>(kern, n, c0, c1, xr, sr, partial.data() + (n - n0) * MB);
    for (; n < n1; ++n) tile<Kern, 1, MB>(kern, n, c0, c1, xr, sr, partial.data() + (n - n0) * MB);
  }
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < MB; ++m)
      y[(m0 + m) * N + n] = Kern::reduce(partial[(n - n0) * MB + m]) +
                            kern.rest(n, px.rest.data() + (m0 + m) * px.rest_stride);
}

// v, rounded to float as it stands: a scalar kernel's term, kept from being fused into an FMA with
// the add that follows (the compiler may fuse in one block size of x and not in another, and the
// sums must not depend on it: TORCH_QMM_CPU_X_BLOCK). Portable; the scalar kernels only.
inline float rounded(float v) {
  volatile float t = v;
  return t;
}

// The largest block of x rows (4, 2, 1; at most max_rows) that fits in `left`; 3 where exactly 3
// are left and the kernel takes blocks of 3 (`three`).
inline int x_block_rows(int64_t left, int max_rows, bool three) {
  if (left == 3 && max_rows >= 3 && three) return 3;
  return left >= 4 && max_rows >= 4 ? 4 : left >= 2 && max_rows >= 2 ? 2 : 1;
}

// Kern::kThreeRowBlocks, false where a kernel does not declare it.
template <typename Kern, typename = void>
struct ThreeRowBlocks : std::false_type {};
template <typename Kern>
struct ThreeRowBlocks<Kern, std::void_t<decltype(Kern::kThreeRowBlocks)>>
    : std::integral_constant<bool, Kern::kThreeRowBlocks> {};

// TORCH_QMM_CPU_X_BLOCK=B: blocks of at most B rows of x (1 to 4; a kernel's own kMaxXBlock
// still bounds it, and 3 is 2 for kernels without blocks of 3); -1 where unset. The results are
// the same for any B (each y[m, n] is summed over the same chunks in the same order), only the
// speed differs.
inline int64_t x_block_override() {
  return env_count("TORCH_QMM_CPU_X_BLOCK", 1, 4, "a count of rows of x from 1 to 4");
}

// W rows [n0, n1) times every row of x.
template <typename Kern>
void run_span(const Kern& kern, const PreparedX<Kern>& px, int64_t M, int64_t N, int64_t n0, int64_t n1,
              int64_t slab_override, int max_x_block, float* y) {
  for (int64_t m0 = 0; m0 < M;) {
    const int mb = x_block_rows(M - m0, max_x_block, ThreeRowBlocks<Kern>::value);
    if constexpr (Kern::kMaxXBlock >= 4)
      if (mb == 4) run_block<Kern, 4>(kern, px, N, n0, n1, m0, slab_override, y);
    if constexpr (Kern::kMaxXBlock >= 3 && ThreeRowBlocks<Kern>::value)
      if (mb == 3) run_block<Kern, 3>(kern, px, N, n0, n1, m0, slab_override, y);
    if constexpr (Kern::kMaxXBlock >= 2)
      if (mb == 2) run_block<Kern, 2>(kern, px, N, n0, n1, m0, slab_override, y);
    if (mb == 1) run_block<Kern, 1>(kern, px, N, n0, n1, m0, slab_override, y);
    m0 += mb;
  }
}

// Kern::kSubnormalOperands, false where a kernel does not declare it: whether its operands
// include subnormal floats that must be taken as they are.
template <typename Kern, typename = void>
struct SubnormalOperands : std::false_type {};
template <typename Kern>
struct SubnormalOperands<Kern, std::void_t<decltype(Kern::kSubnormalOperands)>>
    : std::integral_constant<bool, Kern::kSubnormalOperands> {};

// For its lifetime on this thread, subnormal operands are taken as they are: MXCSR's DAZ bit
// (set by torch.set_flush_denormal(True), for example, per thread) cleared, and restored after.
// Only DAZ: results that underflow are flushed as the caller's FTZ says.
class KeepSubnormalOperands {
 public:
  explicit KeepSubnormalOperands(bool on) {
#if defined(__SSE__)
    if (on && ((saved_ = _mm_getcsr()) & kDaz) != 0) {
      _mm_setcsr(saved_ & ~kDaz);
      restore_ = true;
    }
#else
    (void)on;
#endif
  }
  ~KeepSubnormalOperands() {
#if defined(__SSE__)
    if (restore_) _mm_setcsr(saved_);
#endif
  }
  KeepSubnormalOperands(const KeepSubnormalOperands&) = delete;
  KeepSubnormalOperands& operator=(const KeepSubnormalOperands&) = delete;

 private:
  static constexpr unsigned kDaz = 1u << 6;
  unsigned saved_ = 0;
  bool restore_ = false;
};

// y [M, N] float32 = x [M, K] (float32, natural order) times W, by the kernel `kern`, in one
// parallel region: the threads of torch's intra-op pool (at::parallel_for, OpenMP) take parts of
// x from one counter until none is left, wait until every part is done (a part is taken only by
// a thread that runs, so the wait ends), then take spans of W from a second counter. That pool is
// the one every torch op runs on: after an op its threads spin for a while waiting for the next
// region, so this region starts on them at once (a thread of another pool would share a core with
// a spinning one for as long as the spin lasts). The region ends when every thread of the team
// has arrived: one the scheduler starts late finds no work left, but the call waits for its start.
template <typename Kern>
void run(const Kern& kern, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  PreparedX<Kern> px(kern, M);
  const int64_t threads = threads_for_work(M, N, K);
  const SpanSchedule spans(N, threads);
  // The team the spans need (a call of one span runs inline, with no region); x is cut for it.
  const int64_t team = std::min(threads, spans.count);
  const int64_t parts = x_parts_for(M, team, kern.chunks / kern.part_chunks, x_parts_override());
  const int64_t items = M * parts;
  const int64_t slab_override = slab_bytes_override();
  const int64_t x_block = x_block_override();
  const int max_x_block = x_block > 0 ? std::min<int>(int(x_block), Kern::kMaxXBlock) : Kern::kMaxXBlock;
  std::atomic<int64_t> next_item{0}, items_done{0}, next{0};
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    const KeepSubnormalOperands keep(SubnormalOperands<Kern>::value);
    for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
      prepare_part(kern, x, K, parts, i, px);
      items_done.fetch_add(1, std::memory_order_release);
    }
    while (items_done.load(std::memory_order_acquire) < items) std::this_thread::yield();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < spans.count;) {
      const auto [n0, n1] = spans.rows(i);
      run_span(kern, px, M, N, n0, n1, slab_override, max_x_block, y);
    }
  });
}

}  // namespace chunk
}  // namespace cpu
}  // namespace torch_qmm
