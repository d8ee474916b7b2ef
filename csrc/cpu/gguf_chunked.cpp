// Q4_K x float32/float16/bfloat16 at small M, with the bfloat16 dot products of chunk.h.
//
// A Q4_K super-block (144 bytes: d, dmin as f16, 12 bytes of packed 6-bit scales and mins, 128
// bytes of nibbles) is an affine block of 8 sub-blocks of 32: w = d*sc[s]*q - dmin*m[s]. Its
// nibbles are two 64-byte chunks k = 0, 1; byte c of chunk k lies in the 64-weight run
// J = 2k + c / 32, low nibble = weight 64J + c % 32 (sub-block 2J), high nibble = weight
// 64J + 32 + c % 32 (sub-block 2J + 1) (llama.cpp's dequantize_row_q4_K order). Cut into the
// 4-bit planes of chunk.h (plane j = bits [4j, 4j+4) of u16 word i: bytes 2i, 2i+1), even
// planes hold low nibbles and odd planes high ones, so each (W row, x row) keeps two float32
// accumulators per chunk and scales them with the sub-block scales of lanes 0-7 (J = 2k) and
// 8-15 (J = 2k + 1). The mins are hoisted: y -= sum_s dmin*m[s] * (sum of x over sub-block s).
// Scales and mins of a super-block are unpacked with 32-bit SWAR, converted and multiplied by d /
// dmin in one 16-lane vector (block_scales). x enters as P bfloat16 terms, exactly as for the
// affine kernels (QmmArgs::x_bf16_terms).
#include "gguf_chunked.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../gguf_format.h"
#include "chunk.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace {

using namespace chunk;

constexpr int64_t kBlockBytes = 144, kQsOffset = 16, kSpanRows = 128;
static_assert(sizeof(gguf::BlockQ4K) == kBlockBytes, "Q4_K layout");

// Rows of x up to which this kernel beats the fused / GEMM routes of gguf_qmm.cpp, by bfloat16
// terms of x. Measured on 14336x5120 (2-core Zen 4, chunked against TORCH_QMM_CPU_NO_BF16=1, ms):
// 3 terms (float32) 34.6 / 45.6 at M=16, 74 / 55 at 32; 2 (float16) 54 / 54 at 32, 105 / 80 at
// 64; 1 (bfloat16) 110 / 125 at 128. M=1: 2.0 / 1.7 / 1.4 against 8.3 for all three.
inline int64_t max_rows(int x_bf16_terms) { return x_bf16_terms >= 3 ? 16 : x_bf16_terms == 2 ? 32 : 128; }

// [d*sc[0..7], dmin*m[0..7]] of the super-block at blk (gguf::q4k_scale_min, 4 bytes at a time).
inline __m512 block_scales(const uint8_t* blk) {
  uint16_t dh, mh;
  uint32_t s0, s1, s2;
  std::memcpy(&dh, blk, 2);
  std::memcpy(&mh, blk + 2, 2);
  std::memcpy(&s0, blk + 4, 4);
  std::memcpy(&s1, blk + 8, 4);
  std::memcpy(&s2, blk + 12, 4);
  const uint32_t sc_lo = s0 & 0x3F3F3F3Fu, m_lo = s1 & 0x3F3F3F3Fu;
  const uint32_t sc_hi = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);  // (q[j-4] >> 6) << 4
  const uint32_t m_hi = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
  const __m128i bytes = _mm_set_epi32(int(m_hi), int(m_lo), int(sc_hi), int(sc_lo));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  const float d = float(c10::Half(dh, c10::Half::from_bits())), dmin = float(c10::Half(mh, c10::Half::from_bits()));
  return _mm512_mul_ps(f, _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(d), _mm512_set1_ps(dmin)));
}

// Lane l of chunk k: scale of sub-block 2J (even planes) / 2J + 1 (odd), J = 2k + (l >= 8).
struct ScaleIdx {
  alignas(64) int32_t even[2][16];
  alignas(64) int32_t odd[2][16];
};
constexpr ScaleIdx scale_idx() {
  ScaleIdx t{};
  for (int k = 0; k < 2; ++k)
    for (int l = 0; l < 16; ++l) {
      t.even[k][l] = 2 * (2 * k + (l >= 8 ? 1 : 0));
      t.odd[k][l] = t.even[k][l] + 1;
    }
  return t;
}

constexpr int tile_rows(int mb) { return mb == 1 ? 4 : mb == 2 ? 2 : 1; }
inline int x_block_rows(int64_t left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }

// Prepared x per row: P bfloat16 terms per weight in plane order (xb[2b + k][plane j][term t]
// [lane i]) and per super-block 16 floats: zeros, then the 8 sub-block sums (lanes 8-15 meet
// the mins of block_scales).
template <int P>
struct PreparedX {
  std::vector<uint16_t> xb;
  std::vector<float> xs;
  int64_t xb_stride, xs_stride;
};

template <int R, int MB, int P>
void tile(const GgufArgs& a, int64_t n, const uint16_t* const (&xb)[MB], const float* const (&xs)[MB],
          float (&out)[R][MB]) {
  alignas(64) static constexpr Planes<4>::Table kTable = Planes<4>::table();
  alignas(64) static constexpr ScaleIdx kIdx = scale_idx();
  const __m512i table = _mm512_load_si512(kTable.e);
  const int64_t nb = a.K / 256, row_bytes = nb * kBlockBytes;
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = a.blocks + (n + r) * row_bytes;
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * kBlockBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + R * row_bytes), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(blk + R * row_bytes + 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(blk + R * row_bytes + 128), _MM_HINT_T1);
      sv[r] = block_scales(blk);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fnmadd_ps(sv[r], _mm512_loadu_ps(xs[m] + 16 * b), acc[r][m]);
    }
    for (int k = 0; k < 2; ++k) {
      __m512i w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(row[r] + b * kBlockBytes + kQsOffset + 64 * k);
      __m512 pe[R][MB], po[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) pe[r][m] = po[r][m] = _mm512_setzero_ps();
      const int64_t xoff = (2 * b + k) * 4 * P * 32;
      auto step = [&](auto jc) __attribute__((always_inline)) {
        constexpr int j = decltype(jc)::value;
        __m512i v[R];
        for (int r = 0; r < R; ++r)
          v[r] = _mm512_permutexvar_epi16(j == 0 ? w[r] : _mm512_srli_epi16(w[r], 4 * j), table);
        for (int t = 0; t < P; ++t)
          for (int m = 0; m < MB; ++m) {
            const __m512i xv = _mm512_loadu_si512(xb[m] + xoff + (j * P + t) * 32);
            for (int r = 0; r < R; ++r) {
              __m512& chain = j % 2 ? po[r][m] : pe[r][m];
              chain = _mm512_dpbf16_ps(chain, (__m512bh)v[r], (__m512bh)xv);
            }
          }
      };
      for_each_index(step, std::make_integer_sequence<int, 4>{});
      const __m512i ie = _mm512_load_si512(kIdx.even[k]), io = _mm512_load_si512(kIdx.odd[k]);
      for (int r = 0; r < R; ++r) {
        const __m512 se = _mm512_permutexvar_ps(ie, sv[r]), so = _mm512_permutexvar_ps(io, sv[r]);
        for (int m = 0; m < MB; ++m)
          acc[r][m] = _mm512_fmadd_ps(po[r][m], so, _mm512_fmadd_ps(pe[r][m], se, acc[r][m]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int MB, int P>
void run_block(const GgufArgs& a, int64_t n0, int64_t n1, int64_t m0, const PreparedX<P>& px, float* y) {
  constexpr int R = tile_rows(MB);
  const uint16_t* xb[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xb[m] = px.xb.data() + (m0 + m) * px.xb_stride;
    xs[m] = px.xs.data() + (m0 + m) * px.xs_stride;
  }
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    float out[R][MB];
    tile<R, MB, P>(a, n, xb, xs, out);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[(m0 + m) * a.N + n + r] = out[r][m];
  }
  for (; n < n1; ++n) {
    float out[1][MB];
    tile<1, MB, P>(a, n, xb, xs, out);
    for (int m = 0; m < MB; ++m) y[(m0 + m) * a.N + n] = out[0][m];
  }
}

template <int P>
void run(const GgufArgs& a, float* y) {
  const int64_t nb = a.K / 256;
  PreparedX<P> px;
  px.xb_stride = nb * 2 * 4 * P * 32;
  px.xs_stride = nb * 16;
  px.xb.resize(a.M * px.xb_stride);
  px.xs.assign(a.M * px.xs_stride, 0.0f);
  for (int64_t m = 0; m < a.M; ++m) {
    const float* x = a.x + m * a.K;
    uint16_t* xb = px.xb.data() + m * px.xb_stride;
    float* xs = px.xs.data() + m * px.xs_stride;
    for (int64_t b = 0; b < nb; ++b) {
      for (int k = 0; k < 2; ++k)
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 32; ++i) {
            const int c = 2 * i + (j >= 2 ? 1 : 0);   // byte within the chunk
            const int run = 2 * k + c / 32;            // 64-weight run J
            float rest = x[256 * b + 64 * run + 32 * (j % 2) + c % 32];
            for (int t = 0; t < P; ++t) {
              const c10::BFloat16 term(rest);
              xb[((2 * b + k) * 4 + j) * P * 32 + t * 32 + i] = term.x;
              rest -= static_cast<float>(term);
            }
          }
      for (int s = 0; s < 8; ++s) {
        float t = 0.0f;
        for (int i = 0; i < 32; ++i) t += x[256 * b + 32 * s + i];
        xs[16 * b + 8 + s] = t;
      }
    }
  }
  const int64_t spans = (a.N + kSpanRows - 1) / kSpanRows;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), spans), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < spans;) {
      const int64_t n0 = i * kSpanRows, n1 = std::min(a.N, n0 + kSpanRows);
      for (int64_t m0 = 0; m0 < a.M;) {
        const int mb = x_block_rows(a.M - m0);
        if (mb == 4) run_block<4, P>(a, n0, n1, m0, px, y);
        else if (mb == 2) run_block<2, P>(a, n0, n1, m0, px, y);
        else run_block<1, P>(a, n0, n1, m0, px, y);
        m0 += mb;
      }
    }
  });
}

}  // namespace

const char* gguf_q4k_chunked_tile(const GgufArgs& a, int64_t ggml_type) {
  if (ggml_type != gguf::kTypeQ4_K || a.avoid_bf16 || a.M < 1 || a.M > max_rows(a.x_bf16_terms)) return nullptr;
  if (!x_in_range(a.x, a.M * a.K)) return nullptr;
  return a.x_bf16_terms == 1 ? "bf16x1" : a.x_bf16_terms == 2 ? "bf16x2" : "bf16x3";
}

void gguf_q4k_chunked(const GgufArgs& a, float* y) {
  switch (a.x_bf16_terms) {
    case 1: return run<1>(a, y);
    case 2: return run<2>(a, y);
    default: return run<3>(a, y);
  }
}

#else  // the fused decode-and-dot of gguf_qmm.cpp serves every CPU without AVX512_BF16

const char* gguf_q4k_chunked_tile(const GgufArgs&, int64_t) { return nullptr; }
void gguf_q4k_chunked(const GgufArgs&, float*) { TORCH_CHECK(false, "gguf_qmm: the Q4_K chunk kernel needs AVX512_BF16"); }

#endif

}  // namespace cpu
}  // namespace torch_qmm
