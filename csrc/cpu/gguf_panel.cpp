// Q4_K and Q6_K x float32 for groups of 16 rows of x (gguf_f32.cpp decides which rows), with
// AVX-512 FMAs whose lanes are rows of x. The chunk kernels (gguf_f32.cpp) put 16 values of K in
// the lanes of a vector, so each FMA reads a vector of x, R * MB of them per 16 weights of a tile
// of R W rows and MB x rows: at 16 rows of x that traffic (x of 16 rows at K = 14336 is 917 KB, in
// L2) bounds them, not the FMAs. Here a lane is a row of x: x is laid out once per call as
// xt[k] = [x[m0][k], ..., x[m0 + 15][k]] per group of 16 rows (missing rows zero), and a tile of
// R W rows decodes one super-block of each row into an L1 scratch of floats, then for each k
// multiplies the broadcast weight w[r][k] by xt[k] into R accumulators: one load of x per k for
// all R rows, one FMA per weight and 16 rows of x (the register-blocked outer product of GEMM
// microkernels). A super-block is decoded once for every group of x.
//
// Exactness: the decoded weights are exact in float32, so each FMA adds w * x rounded once, as
// the chunk kernels' products are. Q6_K: d*sc*(q - 32) has at most 11 + 7 + 5 significant bits.
// Q4_K: d*sc*q (11 + 6 + 4 bits); its offsets -dmin*m[s] (17 bits) are 8 more weights per
// super-block, met by the sums of x over the sub-blocks (gguf_x::q4k_sums, the chunk kernels'
// sums). Each super-block's products are summed in a chain of their own, then added to the row's
// total: the error of sums of 264 terms, then of K / 256 of them, not of one chain over K. A
// row of x gets the same result in any group, lane or thread split.
#include "gguf_chunked.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "../gguf_format.h"
#include "chunk.h"
#include "chunk_driver.h"
#include "gguf_fields.h"
#include "gguf_x.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

bool gguf_panel_avoided() {
  const char* v = std::getenv("TORCH_QMM_CPU_NO_PANEL");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
namespace {

// A vector of 16 float32 lanes holds 16 rows of x.
constexpr int kLanes = 16;

// A format provides: kType, kBlockBytes; kPerBlock, the weights per super-block in the scratch
// (256, then the offsets Q4_K hoists); weight(k), the weight of the super-block that scratch
// entry k < 256 holds (x is laid out in that order); decode(blk, w), the kPerBlock entries of one
// super-block (w aligned to 64 bytes); side(x, out), x's entries past 256 for one super-block.

// Q4_K (144 bytes: d, dmin f16; 12 bytes of scales and mins; 128 bytes of nibbles): the 32 bytes
// at 16 + 32J hold weights 64J + i (low nibbles, sub-block 2J) and 64J + 32 + i (high nibbles,
// 2J + 1). Scratch: d*sc[s]*q in natural order, then -dmin*m[s] for s = 0..7.
struct Q4K {
  static constexpr int64_t kType = gguf::kTypeQ4_K, kBlockBytes = 144, kPerBlock = 256 + 8;
  static constexpr int weight(int k) { return k; }
  static void decode(const uint8_t* blk, float* w) {
    alignas(64) float sv[16];  // d*sc[0..7], dmin*m[0..7]
    _mm512_store_ps(sv, gguf_fields::q4k_scale_vector(blk));
    const __m512i low = _mm512_set1_epi32(15);
    for (int J = 0; J < 4; ++J) {
      const __m512 lo_s = _mm512_set1_ps(sv[2 * J]), hi_s = _mm512_set1_ps(sv[2 * J + 1]);
      for (int i = 0; i < 2; ++i) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 32 * J + 16 * i)));
        _mm512_store_ps(w + 64 * J + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), lo_s));
        _mm512_store_ps(w + 64 * J + 32 + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), hi_s));
      }
    }
    _mm256_store_ps(w + 256, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_load_ps(sv + 8)));
  }
  static void side(const float* x, float* out) {
    alignas(64) float s[16];
    _mm512_store_ps(s, gguf_x::q4k_sums(x));  // lanes 8-15: the sums of sub-blocks 0-7
    for (int i = 0; i < 8; ++i) out[i] = s[8 + i];
  }
};

// Q6_K (210 bytes: ql[128], qh[64], 16 int8 scales, d f16): weight 128h + 64p + c (c < 64) is
// q = (nibble p of ql[64h + c]) | (field 2p + c / 32 of qh[32h + c % 32]) << 4 (llama.cpp's
// dequantize_row_q6_K order), in sub-block (weight) / 16, valued d*sc*(q - 32). Decoded as
// gguf_f32.cpp's Q6_K chunks are read: per (h, p) a vector of the 64 q, one per byte; byte u of
// dword lane l (weight 128h + 64p + 4l + u) masked in place is q * 2^(8u), which times
// d*sc * 2^-8u less 32*d*sc (one FMA, exact) is the weight. So the scratch holds the weights in
// the order k = 16 * (4 * (2h + p) + u) + l.
struct Q6K {
  static constexpr int64_t kType = gguf::kTypeQ6_K, kBlockBytes = 210, kPerBlock = 256;
  static constexpr int weight(int k) {
    const int l = k % 16, u = (k / 16) % 4, hp = k / 64;
    return 64 * hp + 4 * l + u;
  }
  static void decode(const uint8_t* blk, float* w) {
    const __m512 sv = gguf_fields::q6k_scale_vector(blk), neg = _mm512_mul_ps(sv, _mm512_set1_ps(-32.0f));
    for (int h = 0; h < 2; ++h) {
      for (int p = 0; p < 2; ++p) {
        // Bits 6-7 of each byte are left over; the masks below take bits 0-5.
        const __m512i q = p == 0 ? gguf_fields::q6k_q_bytes<0>(blk, h) : gguf_fields::q6k_q_bytes<1>(blk, h);
        // Lane l lies in sub-block 8h + 4p + l / 4.
        const __m512i sub = _mm512_add_epi32(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(8 * h + 4 * p));
        const __m512 s = _mm512_permutexvar_ps(sub, sv), ns = _mm512_permutexvar_ps(sub, neg);
        for (int u = 0; u < 4; ++u) {
          const __m512 su = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / float(1u << (8 * u))));
          const __m512 f = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(int(0x3Fu << (8 * u)))));
          _mm512_store_ps(w + 16 * (4 * (2 * h + p) + u), _mm512_fmadd_ps(f, su, ns));
        }
      }
    }
  }
  static void side(const float*, float*) {}
};

// The float32 kernels: Fmt's weights as floats, x as float32 lanes.
template <typename Fmt>
struct F32 {
  static constexpr int64_t kType = Fmt::kType, kBlockBytes = Fmt::kBlockBytes;
  // Floats of scratch per W row: kPerBlock rounded up to whole cache lines (the decoders store
  // aligned vectors), and one line more, so that rows do not lie a multiple of 1 KB apart (loads
  // from one row would wait on stores to another with the same address bits below 4 KB).
  static constexpr int64_t kStride = (Fmt::kPerBlock + 15) / 16 * 16 + 16;
  static constexpr int64_t kScratchBytes = 4 * kStride, kXtBytes = 4 * Fmt::kPerBlock * kLanes;

  // Lane j of xt: x in the order of weight(k), then the side entries (xr null: zeros).
  static void prepare(const float* xr, int j, uint8_t* xt) {
    float* out = reinterpret_cast<float*>(xt);
    alignas(64) float side[16] = {};
    if (xr != nullptr) Fmt::side(xr, side);
    for (int k = 0; k < 256; ++k) out[k * kLanes + j] = xr != nullptr ? xr[Fmt::weight(k)] : 0.0f;
    for (int64_t k = 256; k < Fmt::kPerBlock; ++k) out[k * kLanes + j] = side[k - 256];
  }
  static void decode(const uint8_t* blk, uint8_t* w) { Fmt::decode(blk, reinterpret_cast<float*>(w)); }

  // part[r] += entries [k0, k1) of W row r times xt[k0, k1).
  template <int R>
  __attribute__((always_inline)) static inline void entries(const float* w, const float* xt, int64_t k0, int64_t k1,
                                                            __m512 (&part)[R]) {
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 xv = _mm512_load_ps(xt + k * kLanes);
      for (int r = 0; r < R; ++r) part[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * kStride + k]), xv, part[r]);
    }
  }
  // Slice c of R of the super-block's weights into part (the last slice with the side entries).
  template <int R>
  __attribute__((always_inline)) static inline void multiply(const uint8_t* w, const uint8_t* xb, int c,
                                                             __m512 (&part)[R]) {
    const float* wf = reinterpret_cast<const float*>(w);
    const float* xf = reinterpret_cast<const float*>(xb);
    entries<R>(wf, xf, c * 256 / R, (c + 1) * 256 / R, part);
    if (c == R - 1) entries<R>(wf, xf, 256, Fmt::kPerBlock, part);
  }
};

#if defined(__AVX512BF16__)
// The bfloat16 kernels, for bfloat16 x (exact in one term): a lane of x holds a pair of
// consecutive values of K as bfloat16, W holds the unscaled codes as bfloat16 (exact: small
// integers), and vdpbf16ps adds the two products of a pair per lane (32 products per
// instruction, twice the FMAs'). Each sub-block's dot products go into a chain of their own,
// scaled once by the sub-block's scale (one FMA per 16 pairs for Q4_K, per 8 for Q6_K).
using chunk::bf16_of;

// The bfloat16 bits of the integer v (|v| < 256; exact).
constexpr uint16_t bf16_of_signed(int v) { return v < 0 ? uint16_t(0x8000 | bf16_of(-v)) : bf16_of(v); }

// Shared by both formats: x as pairs (xt: 128 pairs x 16 lanes x 2 bfloat16, then Side vectors of
// 16 floats); a W row's scratch: 256 bfloat16 codes (natural order), then its float scales.
struct Bf16Pairs {
  static constexpr int64_t kPairBytes = 128 * kLanes * 4;
  static void prepare_pairs(const float* xr, int j, uint8_t* xt) {
    uint16_t* out = reinterpret_cast<uint16_t*>(xt);
    // x rounded to nearest even, as QmmArgs::x_bf16_terms = 1 asks (exact for bfloat16 x).
    for (int k = 0; k < 256; ++k)
      out[(k / 2) * 2 * kLanes + 2 * j + k % 2] = xr != nullptr ? c10::BFloat16(xr[k]).x : uint16_t(0);
  }
  // Chains of dot products over the pairs [p0, p1) of a sub-block, into part[r] scaled by
  // scales[r][s].
  template <int R>
  __attribute__((always_inline)) static inline void sub_block(const uint8_t* w, int64_t stride, const uint8_t* xb,
                                                              int64_t p0, int64_t p1, int64_t scales_at, int s,
                                                              __m512 (&part)[R]) {
    __m512 chain[R];
    for (int r = 0; r < R; ++r) chain[r] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; ++p) {
      const __m512bh xv = (__m512bh)_mm512_load_si512(xb + p * 64);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, w + r * stride + 4 * p, 4);
        chain[r] = _mm512_dpbf16_ps(chain[r], (__m512bh)_mm512_set1_epi32(pair), xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* sc = reinterpret_cast<const float*>(w + r * stride + scales_at);
      part[r] = _mm512_fmadd_ps(chain[r], _mm512_set1_ps(sc[s]), part[r]);
    }
  }
};

// Q4_K: codes q (natural order, as Q4K above), scratch floats d*sc[0..7] then -dmin*m[0..7]; x
// side: the 8 sub-block sums of x (gguf_x::q4k_sums, float32), met by the -dmin*m in float32.
struct Q4KBf16 : Bf16Pairs {
  static constexpr int64_t kType = gguf::kTypeQ4_K, kBlockBytes = 144;
  static constexpr int64_t kScratchBytes = 512 + 64 + 64, kXtBytes = kPairBytes + 8 * 64;
  static void prepare(const float* xr, int j, uint8_t* xt) {
    prepare_pairs(xr, j, xt);
    alignas(64) float s[16] = {};
    if (xr != nullptr) _mm512_store_ps(s, gguf_x::q4k_sums(xr));
    float* side = reinterpret_cast<float*>(xt + kPairBytes);
    for (int i = 0; i < 8; ++i) side[i * kLanes + j] = s[8 + i];
  }
  static void decode(const uint8_t* blk, uint8_t* w) {
    alignas(64) static constexpr chunk::Planes<4>::Table kTable = chunk::Planes<4>::table();
    const __m512i table = _mm512_load_si512(kTable.e);
    const __m512 sv = gguf_fields::q4k_scale_vector(blk);
    _mm512_store_ps(reinterpret_cast<float*>(w + 512), _mm512_mask_sub_ps(sv, __mmask16(0xFF00), _mm512_setzero_ps(), sv));
    for (int J = 0; J < 4; ++J) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * J)));
      _mm512_store_si512(w + 128 * J, _mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(15)), table));
      _mm512_store_si512(w + 128 * J + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table));
    }
  }
  template <int R>
  __attribute__((always_inline)) static inline void multiply(const uint8_t* w, const uint8_t* xb, int c,
                                                             __m512 (&part)[R]) {
    for (int s = c * 8 / R; s < (c + 1) * 8 / R; ++s) sub_block<R>(w, kScratchBytes, xb, 16 * s, 16 * s + 16, 512, s, part);
    if (c == R - 1)
      for (int s = 0; s < 8; ++s) {
        const __m512 xs = _mm512_load_ps(reinterpret_cast<const float*>(xb + kPairBytes) + s * kLanes);
        for (int r = 0; r < R; ++r) {
          const float* mins = reinterpret_cast<const float*>(w + r * kScratchBytes + 512) + 8;
          part[r] = _mm512_fmadd_ps(_mm512_set1_ps(mins[s]), xs, part[r]);
        }
      }
  }
};

// Q6_K: codes q - 32 (natural order, as the layout at Q6K above), scratch floats d*sc[0..15].
struct Q6KBf16 : Bf16Pairs {
  static constexpr int64_t kType = gguf::kTypeQ6_K, kBlockBytes = 210;
  static constexpr int64_t kScratchBytes = 512 + 64 + 64, kXtBytes = kPairBytes;
  static void prepare(const float* xr, int j, uint8_t* xt) { prepare_pairs(xr, j, xt); }
  struct Table {
    alignas(64) uint16_t e[64];
  };
  static constexpr Table table() {
    Table t{};
    for (int e = 0; e < 64; ++e) t.e[e] = bf16_of_signed(e - 32);
    return t;
  }
  static void decode(const uint8_t* blk, uint8_t* w) {
    alignas(64) static constexpr Table kTable = table();
    const __m512i lo_table = _mm512_load_si512(kTable.e), hi_table = _mm512_load_si512(kTable.e + 32);
    _mm512_store_ps(reinterpret_cast<float*>(w + 512), gguf_fields::q6k_scale_vector(blk));
    for (int h = 0; h < 2; ++h) {
      for (int p = 0; p < 2; ++p) {
        // Byte c: the q of weight 128h + 64p + c.
        const __m512i q = _mm512_and_si512(p == 0 ? gguf_fields::q6k_q_bytes<0>(blk, h) : gguf_fields::q6k_q_bytes<1>(blk, h),
                                           _mm512_set1_epi8(0x3F));
        for (int i = 0; i < 2; ++i) {
          const __m512i words = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, i));
          _mm512_store_si512(w + 2 * (128 * h + 64 * p + 32 * i), _mm512_permutex2var_epi16(lo_table, words, hi_table));
        }
      }
    }
  }
  template <int R>
  __attribute__((always_inline)) static inline void multiply(const uint8_t* w, const uint8_t* xb, int c,
                                                             __m512 (&part)[R]) {
    for (int s = c * 16 / R; s < (c + 1) * 16 / R; ++s) sub_block<R>(w, kScratchBytes, xb, 8 * s, 8 * s + 8, 512, s, part);
  }
};
#endif

// The skeleton below (tile, run) takes a kernel Kern (F32<Fmt>, Q4KBf16, Q6KBf16) that provides:
//   kType, kBlockBytes        the GGUF type; bytes per super-block
//   kXtBytes                  laid-out x per super-block and group of 16 rows (whole cache lines)
//   kScratchBytes             decoded W per row and super-block (whole cache lines)
//   prepare(xr, j, xt)        one row's super-block of x (256 floats; null: a missing row, zeros)
//                             into lane j of that super-block's xt
//   decode(blk, w)            one super-block of one W row into its scratch
//   multiply<R>(w, xb, c, part)  slice c of R of the super-block (W rows at w, kScratchBytes
//                             apart; x at xb) added to part[r], the last slice with the side terms
constexpr int kTileRows = 8;  // W rows per tile: 8 accumulators and 8 chains in registers
constexpr int kMaxGroups = kGgufPanelMaxRows / kLanes;

// W rows [n, n + R) times every group of 16 rows of x, into y. The scratch holds two super-blocks
// of the R rows: while one is multiplied by the first group, in R slices, the next one is
// decoded a row after each slice, so that the decoding (integer and conversion work) runs beside
// the multiplications rather than between tiles of them. Each super-block's products go into
// part[], then into the row's total (in memory, one per group).
template <typename Kern, int R>
void tile(const GgufArgs& a, int64_t groups, const uint8_t* xt, int64_t group_bytes, int64_t n, uint8_t* scratch,
          float* y) {
  // Each row's super-block kAhead blocks on is fetched while this one is decoded: the rows of a
  // tile are R streams of W that the hardware prefetchers do not run far enough ahead on.
  constexpr int64_t kAhead = 4;
  const int64_t blocks_per_row = a.K / 256, row_bytes = blocks_per_row * Kern::kBlockBytes;
  auto decode = [&](int64_t b, int r, uint8_t* w) __attribute__((always_inline)) {
    const uint8_t* row = a.blocks + (n + r) * row_bytes;
    if (b + kAhead < blocks_per_row)
      for (int64_t off = 0; off < Kern::kBlockBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + (b + kAhead) * Kern::kBlockBytes + off), _MM_HINT_T0);
    Kern::decode(row + b * Kern::kBlockBytes, w + r * Kern::kScratchBytes);
  };
  alignas(64) float total[kMaxGroups][R * kLanes];
  for (int64_t g = 0; g < groups; ++g) std::fill_n(total[g], R * kLanes, 0.0f);
  for (int r = 0; r < R; ++r) decode(0, r, scratch);
  for (int64_t b = 0; b < blocks_per_row; ++b) {
    const uint8_t* w = scratch + (b % 2) * R * Kern::kScratchBytes;
    uint8_t* next = scratch + ((b + 1) % 2) * R * Kern::kScratchBytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* xb = xt + g * group_bytes + b * Kern::kXtBytes;
      __m512 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
      for (int c = 0; c < R; ++c) {
        Kern::template multiply<R>(w, xb, c, part);
        if (g == 0 && b + 1 < blocks_per_row) decode(b + 1, c, next);
      }
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(total[g] + r * kLanes, _mm512_add_ps(_mm512_load_ps(total[g] + r * kLanes), part[r]));
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kLanes && kLanes * g + j < a.M; ++j) y[(kLanes * g + j) * a.N + n + r] = total[g][r * kLanes + j];
}

// y [M, N] = x times W in one parallel region, as chunk::run does: the threads lay out x (items of
// one super-block of one group of 16 rows) from one counter, wait until all of it is done, then
// take spans of W rows from another.
template <typename Kern>
void run(const GgufArgs& a, float* y) {
  const int64_t groups = (a.M + kLanes - 1) / kLanes, bpr = a.K / 256, group_bytes = bpr * Kern::kXtBytes;
  chunk::CacheLineVector<uint8_t> xt(groups * group_bytes);
  const int64_t threads = threads_for_work(a.M, a.N, a.K);
  const SpanSchedule spans(a.N, threads);
  const int64_t team = std::min(threads, spans.count), items = groups * bpr;
  std::atomic<int64_t> next_item{0}, items_done{0}, next_span{0};
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t g = i / bpr, b = i % bpr;
      for (int j = 0; j < kLanes; ++j) {
        const int64_t m = kLanes * g + j;
        Kern::prepare(m < a.M ? a.x + m * a.K + 256 * b : nullptr, j, xt.data() + g * group_bytes + b * Kern::kXtBytes);
      }
      items_done.fetch_add(1, std::memory_order_release);
    }
    while (items_done.load(std::memory_order_acquire) < items) std::this_thread::yield();
    chunk::CacheLineVector<uint8_t> scratch(2 * kTileRows * Kern::kScratchBytes);
    for (int64_t s; (s = next_span.fetch_add(1, std::memory_order_relaxed)) < spans.count;) {
      const auto [n0, n1] = spans.rows(s);
      int64_t n = n0;
      for (; n + kTileRows <= n1; n += kTileRows) tile<Kern, kTileRows>(a, groups, xt.data(), group_bytes, n, scratch.data(), y);
      for (; n < n1; ++n) tile<Kern, 1>(a, groups, xt.data(), group_bytes, n, scratch.data(), y);
    }
  });
}

}  // namespace

bool gguf_panel_built() { return true; }

static void check_rows(const GgufArgs& a) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGgufPanelMaxRows && a.K % 256 == 0, "gguf_qmm: the panel kernels take 1 to ",
              kGgufPanelMaxRows, " rows of x and whole super-blocks, got M = ", a.M, ", K = ", a.K);
}

void gguf_panel(const GgufArgs& a, int64_t ggml_type, float* y) {
  check_rows(a);
  if (ggml_type == Q4K::kType) return run<F32<Q4K>>(a, y);
  if (ggml_type == Q6K::kType) return run<F32<Q6K>>(a, y);
  TORCH_CHECK(false, "gguf_qmm: no panel kernel for ggml type ", ggml_type);
}

#if defined(__AVX512BF16__)
bool gguf_panel_bf16_built() { return true; }

void gguf_panel_bf16(const GgufArgs& a, int64_t ggml_type, float* y) {
  check_rows(a);
  if (ggml_type == Q4KBf16::kType) return run<Q4KBf16>(a, y);
  if (ggml_type == Q6KBf16::kType) return run<Q6KBf16>(a, y);
  TORCH_CHECK(false, "gguf_qmm: no bfloat16 panel kernel for ggml type ", ggml_type);
}
#else
bool gguf_panel_bf16_built() { return false; }
void gguf_panel_bf16(const GgufArgs&, int64_t, float*) {
  TORCH_CHECK(false, "gguf_qmm: the bfloat16 panel kernels need AVX512_BF16");
}
#endif

#else  // without AVX-512 F/BW/VL: the chunk kernels serve these rows (gguf_f32.cpp, gguf_avx2.cpp)

bool gguf_panel_built() { return false; }
void gguf_panel(const GgufArgs&, int64_t, float*) { TORCH_CHECK(false, "gguf_qmm: the panel kernels need AVX-512"); }
bool gguf_panel_bf16_built() { return false; }
void gguf_panel_bf16(const GgufArgs&, int64_t, float*) {
  TORCH_CHECK(false, "gguf_qmm: the bfloat16 panel kernels need AVX512_BF16");
}

#endif

}  // namespace cpu
}  // namespace torch_qmm
