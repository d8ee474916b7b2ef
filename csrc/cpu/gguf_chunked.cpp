// Q4_K and Q6_K x float32/float16/bfloat16 at small M, with the bfloat16 dot products of
// chunk.h: the nibbles (and Q6_K's 2-bit high fields) of a super-block are 64-byte chunks cut
// into planes by vpermw; x is laid out to match once per call, as P exact bfloat16 terms
// (QmmArgs::x_bf16_terms); each plane's dot product is scaled per lane by its sub-block's scale,
// and the offsets (Q4_K mins, Q6_K's -32) are hoisted out as one 16-lane FMA per super-block
// against sums of x. The block layouts are described at Q4K and Q6K below. At the end: which of
// the GGUF chunk families (AVX-512 float32, bfloat16, AVX2) takes a call.
#include "gguf_chunked.h"

#include <c10/util/Half.h>

#include <cstring>

#include "../gguf_format.h"
#include "chunk.h"
#include "chunk_driver.h"
#include "gguf_chunk_kernel.h"
#include "gguf_fields.h"
#include "gguf_x.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace {

using namespace chunk;

using gguf_fields::f16_at;

// Terms t of x (rounded to nearest even, what terms 0..t-1 left) into xb[t * 32].
template <int P>
inline void put_terms(float v, uint16_t* xb) {
  for (int t = 0; t < P; ++t) {
    const c10::BFloat16 term(v);
    xb[t * 32] = term.x;
    v -= static_cast<float>(term);
  }
}

// One vpermw plane of a chunk: plane j of every u16 word (fields of F bits) as bfloat16.
template <int F, int J>
__attribute__((always_inline)) inline __m512i plane(__m512i w, __m512i table) {
  return _mm512_permutexvar_epi16(J == 0 ? w : _mm512_srli_epi16(w, F * J), table);
}

// The planes J in the sequence: each plane's dot products with x added to chains[r][m][slot(J)]
// (zeroed first unless `carry`: then the chains go on from their values).
template <int R, int MB, int P, int F, int kSlots, typename Slot, int... J>
__attribute__((always_inline)) inline void dot_planes(const __m512i (&w)[R], __m512i table,
                                                      const uint16_t* const (&xc)[MB], Slot slot,
                                                      __m512 (&chains)[R][MB][kSlots],
                                                      std::integer_sequence<int, J...>, bool carry = false) {
  if (!carry)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < kSlots; ++c) chains[r][m][c] = _mm512_setzero_ps();
  auto step = [&](auto jc) __attribute__((always_inline)) {
    constexpr int j = decltype(jc)::value;
    __m512i v[R];
    for (int r = 0; r < R; ++r) v[r] = plane<F, j>(w[r], table);
    for (int t = 0; t < P; ++t)
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_loadu_si512(xc[m] + (j * P + t) * 32);
        for (int r = 0; r < R; ++r) {
          __m512& chain = chains[r][m][slot(j)];
          chain = _mm512_dpbf16_ps(chain, (__m512bh)v[r], (__m512bh)xv);
        }
      }
  };
  (step(std::integral_constant<int, J>{}), ...);
}

// One 64-byte chunk of nibbles at byte `at` of each block, x of the chunk at xc: even planes (low
// nibbles) scaled per lane by sv[ie], odd planes (high nibbles) by sv[io], into acc.
template <int R, int MB, int P>
__attribute__((always_inline)) inline void nibble_chunk(const uint8_t* const (&blk)[R], int64_t at,
                                                        const uint16_t* const (&xc)[MB], const __m512 (&sv)[R],
                                                        __m512i ie, __m512i io, __m512 (&acc)[R][MB]) {
  alignas(64) static constexpr Planes<4>::Table kTable = Planes<4>::table();
  __m512i w[R];
  for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(blk[r] + at);
  __m512 ch[R][MB][2];
  dot_planes<R, MB, P, 4, 2>(w, _mm512_load_si512(kTable.e), xc, [](int j) { return j % 2; }, ch,
                             std::make_integer_sequence<int, 4>{});
  for (int r = 0; r < R; ++r) {
    const __m512 se = _mm512_permutexvar_ps(ie, sv[r]), so = _mm512_permutexvar_ps(io, sv[r]);
    for (int m = 0; m < MB; ++m)
      acc[r][m] = _mm512_fmadd_ps(ch[r][m][1], so, _mm512_fmadd_ps(ch[r][m][0], se, acc[r][m]));
  }
}

// Q4_K (144 bytes: d, dmin f16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles):
// w = d*sc[s]*q - dmin*m[s], 8 sub-blocks of 32. Byte c of the nibbles lies in the 64-weight run
// J = c / 32, low nibble = weight 64J + c % 32 (sub-block 2J), high nibble = weight 64J + 32 +
// c % 32 (sub-block 2J + 1) (llama.cpp's order). As in the float32 kernel (gguf_f32.cpp), the
// nibbles are dealt by 16-byte quarters into chunks h = 0, 1 (gguf_fields::q4k_dealt_nibbles), so
// lane l (bytes 4l .. 4l + 3 of a chunk) lies in run J = l / 4 in both. In the 4-bit planes of chunk.h even planes hold low nibbles and odd planes high ones: two
// chains per (W row, x row) over the whole super-block, scaled once by sub-blocks 2(l / 4) and
// 2(l / 4) + 1. The mins are hoisted: y -= sum_s dmin*m[s] * (sum of x over sub-block s).
struct Q4K {
  static constexpr int64_t kType = gguf::kTypeQ4_K, kBlockBytes = 144;
  template <int P>
  static constexpr int64_t kXPerBlock = 2 * 4 * P * 32;
  // W rows per tile: 4 at one row of x, else 2 (at four rows of x 2 rather than 1: Zen 4,
  // 4096 x 14336, bfloat16 x, M = 4 / 8 / 16: 2.9 / 5.5 / 9.8 -> 2.5 / 4.6 / 8.5 ms; float16 x
  // within the noise).
  static constexpr int tile_rows(int mb) { return mb == 1 ? 4 : 2; }
  // Rows of x up to which this beats the fused / GEMM routes of gguf_qmm.cpp, by bfloat16 terms
  // of x (measured against TORCH_QMM_CPU_NO_BF16=1: benchmarks/README.md, "GGUF row limits").
  static constexpr int64_t max_rows(int terms) { return terms >= 3 ? 16 : terms == 2 ? 32 : 128; }

  // x of one super-block -> xb (planes of chunk h = 0, 1: word i of plane j is byte
  // c = 2i + j / 2 of the chunk, quarter J = c / 16, nibble j % 2) and xs (lanes 8-15: sub-block
  // sums).
  template <int P>
  static void prepare(const float* x, uint16_t* xb, float* xs) {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i) {
          const int c = 2 * i + (j >= 2 ? 1 : 0), run = c / 16;
          put_terms<P>(x[64 * run + 32 * (j % 2) + 16 * h + c % 16], xb + ((h * 4 + j) * P) * 32 + i);
        }
    _mm512_storeu_ps(xs, gguf_x::q4k_sums(x));
  }

  template <int R, int MB, int P>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R],
                                                          const uint16_t* const (&xb)[MB],
                                                          const float* const (&xs)[MB], __m512 (&acc)[R][MB]) {
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      sv[r] = gguf_fields::q4k_scale_vector(blk[r]);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fnmadd_ps(sv[r], _mm512_loadu_ps(xs[m]), acc[r][m]);
    }
    alignas(64) static constexpr Planes<4>::Table kTable = Planes<4>::table();
    __m512 ch[R][MB][2];
    for (int h = 0; h < 2; ++h) {
      __m512i w[R];
      for (int r = 0; r < R; ++r)
        w[r] = h == 0 ? gguf_fields::q4k_dealt_nibbles<0>(blk[r]) : gguf_fields::q4k_dealt_nibbles<1>(blk[r]);
      const uint16_t* xc[MB];
      for (int m = 0; m < MB; ++m) xc[m] = xb[m] + h * 4 * P * 32;
      dot_planes<R, MB, P, 4, 2>(w, _mm512_load_si512(kTable.e), xc, [](int j) { return j % 2; }, ch,
                                 std::make_integer_sequence<int, 4>{}, h == 1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 se = gguf_fields::q4k_dealt_scales<0>(sv[r]), so = gguf_fields::q4k_dealt_scales<1>(sv[r]);
      for (int m = 0; m < MB; ++m)
        acc[r][m] = _mm512_fmadd_ps(ch[r][m][1], so, _mm512_fmadd_ps(ch[r][m][0], se, acc[r][m]));
    }
  }
};

// Q6_K (210 bytes: ql[128] low nibbles, qh[64] high 2 bits, 16 int8 scales, d f16):
// w = d*sc[s]*(q - 32), 16 sub-blocks of 16, q = low nibble + 16 * high field. Half h (128
// weights) has ql bytes 64h + c: low nibble = weight 128h + c, high nibble = weight 128h + 64 + c;
// and qh bytes 32h + l: field f (bits 2f, 2f+1) = high bits of weight 128h + 32f + l (llama.cpp's
// dequantize_row_q6_K order). So: the two ql halves are 4-bit chunks (even planes: sub-block
// 8h + l/4 of lane l, odd: 8h + 4 + l/4), the 64 qh bytes one 2-bit chunk (plane j, field f =
// j % 4: lane l in sub-block 8(l/8) + 2f + (l%8)/4; x times 16), and the -32 is hoisted:
// y -= sum_s d*sc[s] * 32 * (sum of x over sub-block s), one 16-lane FMA per super-block.
struct Q6K {
  static constexpr int64_t kType = gguf::kTypeQ6_K, kBlockBytes = 210, kQh = 128, kScales = 192, kD = 208;
  template <int P>
  static constexpr int64_t kXPerBlock = (2 * 4 + 8) * P * 32;
  static constexpr int tile_rows(int mb) { return mb == 1 ? 2 : 1; }
  // Measured like Q4K::max_rows (benchmarks/README.md).
  static constexpr int64_t max_rows(int terms) { return terms >= 3 ? 2 : terms == 2 ? 4 : 32; }

  template <int P>
  static void prepare(const float* x, uint16_t* xb, float* xs) {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i) {
          const int c = 2 * i + (j >= 2 ? 1 : 0);
          put_terms<P>(x[128 * h + 64 * (j % 2) + c], xb + ((h * 4 + j) * P) * 32 + i);
        }
    uint16_t* xh = xb + 2 * 4 * P * 32;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) {
        const int c = 2 * i + (j >= 4 ? 1 : 0), h = c / 32, l = c % 32;
        put_terms<P>(16.0f * x[128 * h + 32 * (j % 4) + l], xh + (j * P) * 32 + i);
      }
    _mm512_storeu_ps(xs, gguf_x::q6k_sums(x));
  }

  struct Idx {
    alignas(64) int32_t even[2][16];
    alignas(64) int32_t odd[2][16];
    alignas(64) int32_t field[4][16];
  };
  static constexpr Idx idx() {
    Idx t{};
    for (int l = 0; l < 16; ++l) {
      for (int h = 0; h < 2; ++h) {
        t.even[h][l] = 8 * h + l / 4;
        t.odd[h][l] = 8 * h + 4 + l / 4;
      }
      for (int f = 0; f < 4; ++f) t.field[f][l] = 8 * (l / 8) + 2 * f + (l % 8) / 4;
    }
    return t;
  }

  template <int R, int MB, int P>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R],
                                                          const uint16_t* const (&xb)[MB],
                                                          const float* const (&xs)[MB], __m512 (&acc)[R][MB]) {
    alignas(64) static constexpr Planes<2>::Table kTable2 = Planes<2>::table();
    alignas(64) static constexpr Idx kIdx = idx();
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + kScales))));
      sv[r] = _mm512_mul_ps(sc, _mm512_set1_ps(f16_at(blk[r] + kD)));
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fnmadd_ps(sv[r], _mm512_loadu_ps(xs[m]), acc[r][m]);
    }
    for (int h = 0; h < 2; ++h) {
      const uint16_t* xc[MB];
      for (int m = 0; m < MB; ++m) xc[m] = xb[m] + h * 4 * P * 32;
      nibble_chunk<R, MB, P>(blk, 64 * h, xc, sv, _mm512_load_si512(kIdx.even[h]), _mm512_load_si512(kIdx.odd[h]),
                             acc);
    }
    {
      const __m512i table2 = _mm512_load_si512(kTable2.e);
      __m512i w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(blk[r] + kQh);
      const uint16_t* xc[MB];
      for (int m = 0; m < MB; ++m) xc[m] = xb[m] + 2 * 4 * P * 32;
      __m512 ch[R][MB][4];  // by field f = j % 4
      dot_planes<R, MB, P, 2, 4>(w, table2, xc, [](int j) { return j % 4; }, ch, std::make_integer_sequence<int, 8>{});
      for (int f = 0; f < 4; ++f) {
        const __m512i fi = _mm512_load_si512(kIdx.field[f]);
        for (int r = 0; r < R; ++r) {
          const __m512 sf = _mm512_permutexvar_ps(fi, sv[r]);
          for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(ch[r][m][f], sf, acc[r][m]);
        }
      }
    }
  }
};

// Fmt with x as P bfloat16 terms, in the form GgufChunkKernel takes (gguf_chunk_kernel.h).
template <typename Fmt, int P>
struct Terms {
  using X = uint16_t;
  static constexpr int64_t kType = Fmt::kType, kBlockBytes = Fmt::kBlockBytes, kXPerBlock = Fmt::template kXPerBlock<P>;
  static constexpr int64_t kSide = 16;
  static constexpr int tile_rows(int mb) { return Fmt::tile_rows(mb); }
  static void prepare(const float* x, X* xb, float* xs) { Fmt::template prepare<P>(x, xb, xs); }
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const X* const (&xb)[MB],
                                                          const float* const (&xs)[MB], __m512 (&acc)[R][MB]) {
    Fmt::template block<R, MB, P>(blk, xb, xs, acc);
  }
};

template <int P>
bool run_terms(const GgufArgs& a, int64_t ggml_type, float* y) {
  return run_gguf_chunks<GgufZmmSlabs, Terms<Q4K, P>, Terms<Q6K, P>>(a, ggml_type, y);
}

}  // namespace

// The bfloat16 multipliers yield to the AVX2 kernels, where those serve, for float32 x (three
// terms) and for Q6_K: on the AVX-512 + AMX Xeon measured they are 1.2-2.4x slower there at
// M = 1-8 (benchmarks/README.md, "Routes on an AVX-512 Xeon").
static bool bf16_yields(const GgufArgs& a, int64_t ggml_type) {
  return (a.x_bf16_terms >= 3 || ggml_type == Q6K::kType) && gguf_avx2_multiplier(a, ggml_type) != nullptr;
}

// Where float32_fma_first(), the bfloat16 multipliers leave every M to the float32 ones and past
// their rows to the GEMM route (on the Xeon measured: slower than both at M = 16-64,
// benchmarks/README.md, "Float32 kernels past 15 rows"), unless TORCH_QMM_CPU_NO_F32_CHUNKS
// steps the float32 kernels aside.
static const char* bf16_multiplier(const GgufArgs& a, int64_t ggml_type) {
  if (a.avoid_bf16 || a.M < 1 || bf16_yields(a, ggml_type)) return nullptr;
  if (float32_fma_first() && !f32_chunks_avoided()) return nullptr;
  const int64_t limit = ggml_type == Q4K::kType ? Q4K::max_rows(a.x_bf16_terms)
                        : ggml_type == Q6K::kType ? Q6K::max_rows(a.x_bf16_terms) : 0;
  if (a.M > limit || !a.x_in_range) return nullptr;
  return a.x_bf16_terms == 1 ? "bf16x1" : a.x_bf16_terms == 2 ? "bf16x2" : "bf16x3";
}

static void run_bf16(const GgufArgs& a, int64_t ggml_type, float* y) {
  const bool ran = a.x_bf16_terms == 1   ? run_terms<1>(a, ggml_type, y)
                   : a.x_bf16_terms == 2 ? run_terms<2>(a, ggml_type, y)
                                         : run_terms<3>(a, ggml_type, y);
  TORCH_CHECK(ran, "gguf_qmm: no chunk kernel for ggml type ", ggml_type, " (gguf_chunked_multiplier)");
}

#else  // without AVX512_BF16: the AVX2 kernels (gguf_avx2.cpp), else the fused decode-and-dot of gguf_qmm.cpp

static const char* bf16_multiplier(const GgufArgs&, int64_t) { return nullptr; }
static void run_bf16(const GgufArgs&, int64_t, float*) { TORCH_CHECK(false, "gguf_qmm: the bfloat16 chunk kernels need AVX512_BF16"); }

#endif

namespace {

enum class Family { kNone, kF32, kBf16, kAvx2 };

// Whether the AVX-512 float32 kernels go before the bfloat16 ones: for float32 x (three terms)
// and Q6_K on every CPU, as the AVX2 ones do (bf16_yields); for Q4_K with bfloat16 / float16 x
// where float32_fma_first(); for float16 x (two terms) where the float32 panel kernels take rows
// (Zen 4, 4096 x 14336, 2 threads, Q4_K, M = 14 / 16 / 32: bf16x2 11.0 / 12.5 / 25.4 ms, the
// float32 panel 11.2 / 11.1 / 21.0).
bool f32_first(const GgufArgs& a, int64_t ggml_type, const char* f32) {
  const bool panel = f32 != nullptr && std::strncmp(f32, "f32-panel", 9) == 0;
  return a.x_bf16_terms >= 3 || ggml_type == gguf::kTypeQ6_K || float32_fma_first() || (a.x_bf16_terms == 2 && panel);
}

Family family(const GgufArgs& a, int64_t ggml_type, const char** name) {
  const char* f32 = gguf_f32_multiplier(a, ggml_type);
  if (f32 != nullptr && f32_first(a, ggml_type, f32)) return *name = f32, Family::kF32;
  if ((*name = bf16_multiplier(a, ggml_type)) != nullptr) return Family::kBf16;
  if (f32 != nullptr) return *name = f32, Family::kF32;
  if ((*name = gguf_avx2_multiplier(a, ggml_type)) != nullptr) return Family::kAvx2;
  return Family::kNone;
}

}  // namespace

// Rows the bfloat16 panel kernels take (gguf_panel.cpp), ahead of every family: the groups of 16
// rows (gguf_panel_group_rows) of bfloat16 x (one term), where the bfloat16 products go first
// (not float32_fma_first()), up to kGgufPanelMaxRows rows. Zen 4, 4096 x 14336, 2 threads,
// bfloat16 x, M = 16 / 32 / 64 / 128: Q4_K 7.8 / 15.1 / 31.2 / 59.8 ms with bf16x1 -> 6.0 / 11.2 /
// 22.9 / 42.7; Q6_K 13.0 / 25.2 with the float32 chunk kernels (10.6 / 19.2 on the float32 panel),
// 63.1 / 102 on the GEMM route -> 6.4 / 11.5 / 22.3 / 43.7.
static int64_t bf16_panel_rows(const GgufArgs& a, int64_t ggml_type) {
  if (a.x_bf16_terms != 1 || a.avoid_bf16 || !a.x_in_range || a.M > kGgufPanelMaxRows) return 0;
  if (ggml_type != gguf::kTypeQ4_K && ggml_type != gguf::kTypeQ6_K) return 0;
  if (!gguf_panel_bf16_built() || gguf_panel_avoided() || float32_fma_first()) return 0;
  return gguf_panel_group_rows(a.M);
}

const char* gguf_chunked_multiplier(const GgufArgs& a, int64_t ggml_type) {
  if (bf16_panel_rows(a, ggml_type) > 0) return ggml_type == gguf::kTypeQ4_K ? "bf16x1-panel-q4k" : "bf16x1-panel-q6k";
  const char* name = nullptr;
  family(a, ggml_type, &name);
  return name;
}

void gguf_chunked(const GgufArgs& args, int64_t ggml_type, float* y) {
  GgufArgs a = args;
  if (const int64_t panel = bf16_panel_rows(a, ggml_type); panel > 0) {
    GgufArgs head = a;
    head.M = panel;
    gguf_panel_bf16(head, ggml_type, y);
    if (panel == a.M) return;
    a.x += panel * a.K;  // the rows left go to the families below
    a.M -= panel;
    y += panel * a.N;
  }
  const char* name = nullptr;
  switch (family(a, ggml_type, &name)) {
    case Family::kF32: return gguf_f32(a, ggml_type, y);
    case Family::kBf16: return run_bf16(a, ggml_type, y);
    case Family::kAvx2: return gguf_avx2(a, ggml_type, y);
    case Family::kNone: break;
  }
  TORCH_CHECK(false, "gguf_qmm: no chunk kernel takes these operands (gguf_chunked_multiplier)");
}

}  // namespace cpu
}  // namespace torch_qmm
