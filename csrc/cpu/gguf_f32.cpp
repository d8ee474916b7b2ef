// Q4_K and Q6_K x float32/float16/bfloat16 at small M with AVX-512 float32 FMAs, on the chunk
// driver of chunk_driver.h (gguf_chunked.cpp decides when). A chunk is one super-block of 256
// weights; its code bytes are read 64 at a time as 16 dwords and cut into fields by masks, as
// chunk.h's F32Multiplier does for affine codes: a field masked in place is q * 2^s, exact in
// float32, and meets x * 2^-s (prepared once per call, exact for |x| >= 2^-98: x_in_range), so
// each FMA adds q * x rounded once. The lanes of every decoded vector lie in known sub-blocks, so
// a chain of such vectors is scaled once by a per-lane vector of the sub-block scales (one
// vpermps); the offsets (Q4_K's mins, Q6_K's -32) are hoisted out as one 16-lane FMA per
// super-block against sub-block sums of x. The lane layouts are those of the AVX2 kernels
// (gguf_avx2.cpp) at twice the width.
#include "gguf_chunked.h"

#include <c10/util/Exception.h>

#include "../gguf_format.h"
#include "chunk.h"
#include "chunk_driver.h"
#include "gguf_chunk_kernel.h"
#include "gguf_fields.h"
#include "gguf_x.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

using namespace chunk;


// Per-lane index tables (vpermps) into a block's 16-lane scale vector.
struct LaneIdx {
  alignas(64) int32_t i[16];
};

// Q4_K (144 bytes: d, dmin f16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles):
// w = d*sc[s]*q - dmin*m[s], 8 sub-blocks of 32. Byte c of the nibbles lies in the 64-weight run
// J = c / 32: low nibble = weight 64J + c % 32 (sub-block 2J), high nibble = weight 64J + 32 +
// c % 32 (sub-block 2J + 1) (llama.cpp's order). The nibbles are dealt by 16-byte quarters into
// vectors h = 0, 1 (gguf_fields::q4k_dealt_nibbles): dword lane l holds bytes
// 32J + 16h + 4(l % 4) + t (t = 0..3) of run J = l / 4, and its field j (0..7) is nibble j % 2 of
// byte t = j / 2, weight
// 64J + 32(j % 2) + 16h + 4(l % 4) + j / 2, in sub-block 2J + j % 2. So every field of one parity,
// in both vectors, has lane l in the same sub-block: one chain of 8 fields per parity, scaled once
// by a per-lane vector of the sub-block scales (two scaling FMAs per super-block, W row and x row,
// where chunks of 64 bytes as they lie would need four). The mins are hoisted:
// y -= sum_s dmin*m[s] * (sum of x over sub-block s).
struct Q4K {
  using X = float;
  static constexpr int64_t kType = gguf::kTypeQ4_K, kBlockBytes = 144, kXPerBlock = 256, kSide = 16;
  // W rows per tile: 4 at one or two rows of x, 2 at four (fewer would read x from L2 at a rate it
  // does not sustain: 4 KB per super-block and W row at four rows of x).
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 4 : 2; }
  using Field = F32Multiplier<4>;

  static constexpr int weight(int h, int j, int l) { return 64 * (l / 4) + 32 * (j % 2) + 16 * h + 4 * (l % 4) + j / 2; }
  // xc[(8h + j) * 16 + l] = x[weight(h, j, l)] * x_factor(2i) for j = 2i + p (block reads field
  // 2i + 1 shifted down to where field 2i lies); xs: lanes 0-7 zero (they meet the scales), 8-15
  // the sub-block sums of x (they meet the mins). For vector h and parity p, the fields j = 2i + p
  // take lanes 4J .. 4J + 3 from the 16 floats at 64J + 32p + 16h: element i of their runs of 4
  // (gguf_x::every_fourth).
  static void prepare(const float* x, float* xc, float* xs) {
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 2; ++p) {
        const float* base = x + 32 * p + 16 * h;
        const __m512 v[4] = {_mm512_loadu_ps(base), _mm512_loadu_ps(base + 64), _mm512_loadu_ps(base + 128),
                             _mm512_loadu_ps(base + 192)};
        __m512 f[4];
        gguf_x::every_fourth(v, f);
        for (int i = 0; i < 4; ++i) {
          const int j = 2 * i + p;
          _mm512_storeu_ps(xc + (8 * h + j) * 16, _mm512_mul_ps(f[i], _mm512_set1_ps(Field::x_factor(2 * i))));
        }
      }
    _mm512_storeu_ps(xs, gguf_x::q4k_sums(x));
  }

  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m512 (&acc)[R][MB]) {
    __m512 sv[R];
    __m512i w[R][2];
    for (int r = 0; r < R; ++r) {
      sv[r] = gguf_fields::q4k_scale_vector(blk[r]);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fnmadd_ps(sv[r], _mm512_loadu_ps(xs[m]), acc[r][m]);
      w[r][0] = gguf_fields::q4k_dealt_nibbles<0>(blk[r]);
      w[r][1] = gguf_fields::q4k_dealt_nibbles<1>(blk[r]);
    }
    // The even fields of both vectors, then the odd ones (the vectors shifted down by a nibble, so
    // that field 2i + 1 sits where field 2i did): one chain per (W row, x row) at a time.
    for_each_index([&](auto pc) __attribute__((always_inline)) {
      constexpr int p = decltype(pc)::value;
      if constexpr (p == 1)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) w[r][h] = _mm512_srli_epi32(w[r][h], 4);
      __m512 ch[R][MB];
      for (int h = 0; h < 2; ++h)
        for_each_index([&](auto ic) __attribute__((always_inline)) {
          constexpr int i = decltype(ic)::value, j = 2 * i + p;
          const __m512i mask = _mm512_set1_epi32(int(15u << (8 * i)));
          __m512 xj[MB];
          for (int m = 0; m < MB; ++m) {
            xj[m] = _mm512_loadu_ps(xc[m] + (8 * h + j) * 16);
            if constexpr (R > 1) in_register(xj[m]);
          }
          for (int r = 0; r < R; ++r) {
            const __m512 q = Field::field<2 * i>(w[r][h], mask);
            for (int m = 0; m < MB; ++m)
              ch[r][m] = h == 0 && i == 0 ? _mm512_mul_ps(q, xj[m]) : _mm512_fmadd_ps(q, xj[m], ch[r][m]);
          }
        }, std::make_integer_sequence<int, 4>{});
      for (int r = 0; r < R; ++r) {
        const __m512 s = gguf_fields::q4k_dealt_scales<p>(sv[r]);
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(ch[r][m], s, acc[r][m]);
      }
    }, std::make_integer_sequence<int, 2>{});
  }
};

// Q6_K (210 bytes: ql[128] low nibbles, qh[64] high 2 bits, 16 int8 scales, d f16):
// w = d*sc[s]*(q - 32), 16 sub-blocks of 16, q = low nibble + 16 * high field. Half h (128
// weights): ql byte 64h + c (c = 0..63) holds in nibble p the weight 128h + 64p + c; its high
// field f = 2p + t (t = c / 32) is bits 2f, 2f+1 of qh byte 32h + c % 32 (llama.cpp's
// dequantize_row_q6_K order). So per (h, p) one 64-byte vector of the 6-bit q of 64 weights,
// one per byte: the nibbles (ql, or ql >> 4) under a byte mask, the qh half broadcast to both
// 32-byte halves and shifted per half (by 4 - 2f) so that its field sits at bits 4-5, merged by
// one vpternlogd (bits 6-7 of each byte are left over from qh and masked off below). With
// c = 4l + u (dword lane l, byte u) the field of byte u under the mask 0x3F << 8u is q * 2^(8u),
// exact, meeting x * 2^-(8u); lane l lies in sub-block 8h + 4p + l / 4 for every u: one chain
// per (h, p) of 4 vectors, scaled by one permuted scale vector. The -32 is hoisted:
// y -= sum_s d*sc[s] * 32 * (sum of x over sub-block s).
struct Q6K {
  using X = float;
  static constexpr int64_t kType = gguf::kTypeQ6_K, kBlockBytes = 210;
  static constexpr int64_t kXPerBlock = 256, kSide = 16;
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 4 : 2; }

  static constexpr float factor(int u) { return 1.0f / float(1u << (8 * u)); }
  static constexpr int weight(int h, int p, int u, int l) { return 128 * h + 64 * p + 4 * l + u; }
  // xc[((2h + p) * 4 + u) * 16 + l] = x[weight(h, p, u, l)] * factor(u): element u of the runs of 4
  // of the 64 floats from 128h + 64p (gguf_x::every_fourth); xs[s] = 32 * the sum of x over
  // sub-block s.
  static void prepare(const float* x, float* xc, float* xs) {
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 2; ++p) {
        const float* base = x + 128 * h + 64 * p;
        __m512 f[4];
        gguf_x::every_fourth_at(base, 32, f);
        for (int u = 0; u < 4; ++u)
          _mm512_storeu_ps(xc + ((2 * h + p) * 4 + u) * 16, _mm512_mul_ps(f[u], _mm512_set1_ps(factor(u))));
      }
    _mm512_storeu_ps(xs, gguf_x::q6k_sums(x));
  }

  struct Idx {
    LaneIdx sub[2][2];  // [h][p]
  };
  static constexpr Idx idx() {
    Idx t{};
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 2; ++p)
        for (int l = 0; l < 16; ++l) t.sub[h][p].i[l] = 8 * h + 4 * p + l / 4;
    return t;
  }

  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m512 (&acc)[R][MB]) {
    alignas(64) static constexpr Idx kIdx = idx();
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      sv[r] = gguf_fields::q6k_scale_vector(blk[r]);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fnmadd_ps(sv[r], _mm512_loadu_ps(xs[m]), acc[r][m]);
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i sub[2] = {_mm512_load_si512(kIdx.sub[h][0].i), _mm512_load_si512(kIdx.sub[h][1].i)};
      for_each_index([&](auto pc) __attribute__((always_inline)) {
        constexpr int p = decltype(pc)::value;
        __m512i q[R];
        for (int r = 0; r < R; ++r) q[r] = gguf_fields::q6k_q_bytes<p>(blk[r], h);
        __m512 ch[R][MB];
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MB; ++m) ch[r][m] = _mm512_setzero_ps();
        for_each_index([&](auto uc) __attribute__((always_inline)) {
          constexpr int u = decltype(uc)::value;
          const __m512i mask = _mm512_set1_epi32(int(0x3Fu << (8 * u)));
          __m512 xu[MB];
          for (int m = 0; m < MB; ++m) {
            xu[m] = _mm512_loadu_ps(xc[m] + ((2 * h + p) * 4 + u) * 16);
            if constexpr (R > 1) in_register(xu[m]);
          }
          for (int r = 0; r < R; ++r) {
            const __m512 v = _mm512_cvtepu32_ps(_mm512_and_si512(q[r], mask));
            for (int m = 0; m < MB; ++m) ch[r][m] = _mm512_fmadd_ps(v, xu[m], ch[r][m]);
          }
        }, std::make_integer_sequence<int, 4>{});
        for (int r = 0; r < R; ++r) {
          const __m512 s = _mm512_permutexvar_ps(sub[p], sv[r]);
          for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(ch[r][m], s, acc[r][m]);
        }
      }, std::make_integer_sequence<int, 2>{});
    }
  }
};

}  // namespace

// Rows of a call the panel kernels (gguf_panel.cpp) take (gguf_panel_group_rows), the chunk
// kernels the rest. At 14 rows the chunk kernels cost about 6% more than a panel group (Zen 4,
// 4096 x 14336, 2 threads, float32 x: Q4_K / Q6_K chunk M = 12, 14, 16: 9.5 / 10.0, 11.3 / 11.8,
// 12.5 / 13.0 ms; panel 10.5-10.8 / 11.2 for any of them).
static int64_t panel_rows(const GgufArgs& a) {
  if (!gguf_panel_built() || gguf_panel_avoided()) return 0;
  return gguf_panel_group_rows(a.M);
}

// Up to kGgufF32MaxRows rows, and up to kGgufPanelMaxRows where the panel kernels take all but
// the last 13 or fewer (they beat the GEMM route there: Zen 4, 4096 x 14336, 2 threads, float32
// x, M = 64 / 128: Q4_K 68-119 / 104-153 ms on the GEMM route in two runs, 37.6 / 74.6 here; Q6_K
// 65-113 / 103-148 -> 37.2 / 75.0).
const char* gguf_f32_multiplier(const GgufArgs& a, int64_t ggml_type) {
  if (f32_chunks_avoided() || a.M < 1) return nullptr;
  if (ggml_type != Q4K::kType && ggml_type != Q6K::kType) return nullptr;
  if (!a.x_in_range) return nullptr;
  const int64_t panel = a.M <= kGgufPanelMaxRows ? panel_rows(a) : 0;
  if (panel > 0) return ggml_type == Q4K::kType ? "f32-panel-q4k" : "f32-panel-q6k";
  if (a.M > kGgufF32MaxRows) return nullptr;
  return ggml_type == Q4K::kType ? "f32-q4k" : "f32-q6k";
}

void gguf_f32(const GgufArgs& a, int64_t ggml_type, float* y) {
  const int64_t panel = panel_rows(a);
  if (panel > 0) {
    GgufArgs head = a;
    head.M = panel;
    gguf_panel(head, ggml_type, y);
  }
  if (panel == a.M) return;
  GgufArgs rest = a;
  rest.x = a.x + panel * a.K;
  rest.M = a.M - panel;
  y += panel * a.N;
  const bool ran = run_gguf_chunks<GgufZmm, Q4K, Q6K>(rest, ggml_type, y);
  TORCH_CHECK(ran, "gguf_qmm: no AVX-512 float32 chunk kernel for ggml type ", ggml_type, " (gguf_f32_multiplier)");
}

#else  // without AVX-512: the AVX2 kernels (gguf_avx2.cpp), else the fused decode-and-dot.

const char* gguf_f32_multiplier(const GgufArgs&, int64_t) { return nullptr; }
void gguf_f32(const GgufArgs&, int64_t, float*) { TORCH_CHECK(false, "gguf_qmm: the float32 chunk kernels need AVX-512"); }

#endif

}  // namespace cpu
}  // namespace torch_qmm
