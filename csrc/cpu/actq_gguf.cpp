// CPU gguf_qmm_int8_activations: gguf_qmm (Q4_K, Q6_K) with x quantized to int8 per super-block
// of 256 along K (actq_x.h; llama.cpp's q8_K granularity) and multiplied with the weight codes in
// integer arithmetic, after llama.cpp's q4_K / q6_K dot products. An opt-in approximation, as
// qmm_int8_activations (actq_qmm.cpp), whose x blocks are of 32.
//
// With d_x the scale and q_i the codes of x over one super-block:
//   Q4_K (sub-blocks s of 32; w = d*sc_s*q - dmin*m_s, q in 0..15):
//     y += d * d_x * (sum_s sc_s * sum_{i in s} q_i qx_i)  -  sum_s dmin*m_s * X_s
//   Q6_K (sub-blocks s of 16; w = d*sc_s*(q - 32), q in 0..63):
//     y += d * (d_x * (sum_s sc_s * sum_{i in s} q_i qx_i)  -  sum_s sc_s * 32 * X_s)
//   X_s = d_x * sum_{i in s} qx_i, the sum of the dequantized x over sub-block s.
// The parenthesized sum over the whole super-block is int32 (vpmaddubsw pairs of codes and x
// below 2^15, or for the 512-bit kernels vpdpbusd quads below 2^15 packed to int16, then
// vpmaddwd or vpdpwssd against the integer sub-block scales, added up; at most
// 8 * 63 * 32 * 15 * 127 for Q4_K and 16 * 128 * 16 * 63 * 127 for Q6_K, below 2^31), so one
// float multiply per super-block, W row and x row carries the scales; the rest float32. So y is
// W times the dequantized x up to float32 rounding, with the bound of the affine path over blocks
// of 256 (docs/activation-quantization.md): |y - W x| <= sum_b (d_b / 2) * sum_{i in b} |w_i|
// (+ rounding).
//
// Kernels, on the chunk driver (chunk_driver.h; a chunk is one super-block): VecKernel<Fmt, true>
// ("int8x/avx512bw-q4k", "int8x/avx512bw-q6k": the same integer products on 64 bytes at a time,
// where built for AVX512BW, unless TORCH_QMM_CPU_NO_INT8_512=1), VecKernel<Fmt, false> ("int8x/avx2-q4k",
// "int8x/avx2-q6k") and ScalarKernel<Fmt> (portable; CPUs without AVX2 and
// TORCH_QMM_CPU_NO_AVX2_CHUNKS=1). x with Inf or NaN, or a result that is not finite, takes the
// exact gguf_qmm.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "../gguf_format.h"
#include "../gguf_validate.h"
#include "actq_dot.h"
#include "actq_x.h"
#include "chunk_avx2.h"
#include "chunk_driver.h"
#include "hsum.h"
#include "gguf_fields.h"
#include "qmm_kernels.h"
#include "x_rows.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace torch_qmm {
namespace cpu {
namespace actq {
namespace {

constexpr int64_t kSuper = gguf::kQK_K, kRuns = kSuper / kBlock;  // 8 runs of 32 codes per super-block

using gguf_fields::f16_at;

// Side data per super-block and x row: the x scale d_x at 0, then Fmt::kSums offset sums X_s
// from kSumsAt (the 512-bit kernels: from Fmt::kWideSumsAt, zeros between).
constexpr int64_t kSumsAt = 1;
// Q4_K: the codes of weight 32s + i are bits 4*(s%2).. of byte 32*(s/2) + i of qs.
struct Q4K {
  static constexpr int64_t kType = gguf::kTypeQ4_K, kBlockBytes = 144, kQs = 16, kSums = 8;
  static constexpr int kSub = 32;  // weights per sub-block, each with its offset sum X_s
  static constexpr float offset_factor = 1.0f;
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 2 : 1; }
  static constexpr int kWideRowsAtOne = 4;  // W rows per 512-bit tile at one row of x (VecKernel)
  // The 512-bit layout of x (WideX): the sub-blocks in the order 64 bytes of qs bring them, low
  // nibbles then high ones: bytes 0-63 hold sub-blocks 0, 2 (low) and 1, 3 (high), 64-127 4, 6, 5, 7.
  static constexpr int kWideOrder[kRuns] = {0, 2, 1, 3, 4, 6, 5, 7};
  // Side data of the 512-bit layout: d_x at 0, the offset sums X_s at 8-15 (where the mins lie in
  // the block's vector of scales and mins), zeros between.
  static constexpr int64_t kWideSumsAt = 8;
  static void scales_mins(const uint8_t* blk, uint8_t (&sc)[8], uint8_t (&mn)[8]) {
    const gguf_fields::Q4kScaleBytes b = gguf_fields::q4k_scale_bytes(blk + 4);
    std::memcpy(sc, b.scale, 8);  // bytes in memory order: sub-blocks 0..7 (little-endian)
    std::memcpy(mn, b.min, 8);
  }
  // The portable form: this super-block's part of y for one x row.
  static float scalar(const uint8_t* blk, const int8_t* xq, const float* side) {
    uint8_t sc[8], mn[8];
    scales_mins(blk, sc, mn);
    int32_t t = 0;
    float mins = 0.0f;
    for (int s = 0; s < 8; ++s) {
      const uint8_t* qs = blk + kQs + 32 * (s / 2);
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) dot += int32_t((qs[i] >> (4 * (s % 2))) & 0xF) * int32_t(xq[32 * s + i]);
      t += int32_t(sc[s]) * dot;
      mins += float(mn[s]) * side[kSumsAt + s];
    }
    return float(t) * (f16_at(blk) * side[0]) - f16_at(blk + 2) * mins;
  }
#if defined(__AVX2__) && defined(__FMA__)
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const int8_t* const (&xc)[MB],
                                                          const float* const (&side)[MB], __m256 (&acc)[R][MB]) {
    // Byte pair s of each 128-bit lane: the int16 scale of sub-block s (vpshufb indices).
    alignas(32) static constexpr auto pick = [] {
      struct { int8_t b[8][32]; } t{};
      for (int s = 0; s < 8; ++s)
        for (int i = 0; i < 32; ++i) t.b[s][i] = int8_t(2 * s + i % 2);
      return t;
    }();
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; ++r) {
      const __m128i sm = _mm256_castsi256_si128(gguf_fields::q4k_scale_min_bytes(gguf_fields::q4k_head(blk[r])));
      // The 8 scales as int16 words 0-7 of both lanes: each sub-block's broadcast is one vpshufb.
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
      const __m256i mn = _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8));
      const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(mn), _mm256_set1_ps(f16_at(blk[r] + 2)));
      __m256i t[MB];
      for (int m = 0; m < MB; ++m) t[m] = _mm256_setzero_si256();
      for (int run = 0; run < 4; ++run) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + kQs + 32 * run));
        const __m256i q[2] = {_mm256_and_si256(w, nibble), _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble)};
        for (int half = 0; half < 2; ++half) {
          const int s = 2 * run + half;
          const __m256i scale = _mm256_shuffle_epi8(sc16, _mm256_load_si256(reinterpret_cast<const __m256i*>(pick.b[s])));
          for (int m = 0; m < MB; ++m) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m] + 32 * s));
            t[m] = dot2_16(t[m], _mm256_maddubs_epi16(q[half], x), scale);
          }
        }
      }
      const float d = f16_at(blk[r]);
      for (int m = 0; m < MB; ++m)
        acc[r][m] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(side[m] + kSumsAt),
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m]), _mm256_set1_ps(d * side[m][0]), acc[r][m]));
    }
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // 512 bits: pair k of x positions (kWideOrder[2k], kWideOrder[2k + 1]) meets the low (k even) or
  // high (k odd) nibbles of qs bytes 64 (k / 2) .. + 63, so dword lane e of its product vector D_k
  // (dot4_512: the 4 codes of bytes 4e .. 4e + 3) lies in sub-block kWideOrder[2k + e / 8]. The
  // two pairs of one 64-byte load are packed into int16 words (vpackssdw, per 128-bit lane: words
  // 0-3 from D_2j, 4-7 from D_2j+1; |D| <= 4 * 15 * 127, no saturation) and meet their sub-blocks'
  // scales in one vpdpwssd. The mins term is one masked FMA of the block's 16-lane vector
  // [d*sc_s, dmin*m_s] with the side data (kWideSumsAt).
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block512(const uint8_t* const (&blk)[R], const int8_t* const (&xc)[MB],
                                                             const float* const (&side)[MB], __m512 (&acc)[R][MB]) {
    // Word 8L + i of the packed pairs of load j: the scale of the sub-block of D_{2j + i / 4}'s dword
    // 4L + i % 4, as word 2s of q4k_scale_min_lanes' int32 lane s.
    alignas(64) static constexpr auto idx = [] {
      struct { int16_t w[2][32]; } t{};
      for (int j = 0; j < 2; ++j)
        for (int w = 0; w < 32; ++w) {
          const int lane = w / 8, i = w % 8, k = 2 * j + i / 4, e = 4 * lane + i % 4;
          t.w[j][w] = int16_t(2 * kWideOrder[2 * k + e / 8]);
        }
      return t;
    }();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; ++r) {
      const __m128i head = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r]));
      const __m512i lanes = gguf_fields::q4k_scale_min_lanes(head);  // int32 [sc_0..7, m_0..7]
      const __m512 mins = gguf_fields::q4k_scale_vector(blk[r]);     // lanes 8-15: dmin * m_s
      const __m512 d = _mm512_broadcastss_ps(_mm_cvtph_ps(head));
      __m512i t[MB];
      for (int m = 0; m < MB; ++m) t[m] = _mm512_setzero_si512();
      for (int j = 0; j < 2; ++j) {
        const __m512i w = _mm512_loadu_si512(blk[r] + kQs + 64 * j);
        const __m512i lo = _mm512_and_si512(w, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        const __m512i scale = _mm512_permutexvar_epi16(_mm512_load_si512(idx.w[j]), lanes);
        for (int m = 0; m < MB; ++m) {
          const __m512i d0 = dot4_512_from_zero(lo, _mm512_loadu_si512(xc[m] + 128 * j));
          const __m512i d1 = dot4_512_from_zero(hi, _mm512_loadu_si512(xc[m] + 128 * j + 64));
          t[m] = dot2_16_512(t[m], _mm512_packs_epi32(d0, d1), scale);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m512 xs = _mm512_loadu_ps(side[m]);  // d_x, zeros, X_0..7
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), _mm512_mul_ps(d, _mm512_set1_ps(side[m][0])), acc[r][m]);
        acc[r][m] = _mm512_mask3_fnmadd_ps(mins, xs, acc[r][m], __mmask16(0xFF00));
      }
    }
  }
#endif
};

// Q6_K: run b = 4h + f of 32 x codes holds weights 128h + 32f + i, whose code is nibble f / 2 of ql byte
// 64h + 32 (f % 2) + i with bits 2f, 2f + 1 of qh byte 32h + i above it (dequantize_row_q6_K's
// order); bytes 0-15 lie in sub-block 2b, 16-31 in 2b + 1.
struct Q6K {
  static constexpr int64_t kType = gguf::kTypeQ6_K, kBlockBytes = 210, kQh = 128, kScales = 192, kD = 208, kSums = 16;
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 2 : 1; }
  static constexpr int kWideRowsAtOne = 8;
  static constexpr int64_t kWideSumsAt = kSumsAt;
  // 64 bytes of ql (half h) hold x runs 4h, 4h + 1 (low nibbles) and 4h + 2, 4h + 3 (high):
  // the natural order.
  static constexpr int kWideOrder[kRuns] = {0, 1, 2, 3, 4, 5, 6, 7};
  static constexpr int kSub = 16;
  static constexpr float offset_factor = 32.0f;  // the offset q - 32
  static int code(const uint8_t* blk, int b, int i) {
    const int h = b / 4, f = b % 4;
    const int lo = (blk[64 * h + 32 * (f % 2) + i] >> (4 * (f / 2))) & 0xF;
    const int hi = (blk[kQh + 32 * h + i] >> (2 * f)) & 3;
    return lo | (hi << 4);
  }
  static float scalar(const uint8_t* blk, const int8_t* xq, const float* side) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + kScales);
    int32_t t = 0;
    float offsets = 0.0f;
    for (int b = 0; b < 8; ++b)
      for (int i = 0; i < 32; ++i) t += int32_t(sc[2 * b + i / 16]) * code(blk, b, i) * int32_t(xq[32 * b + i]);
    for (int s = 0; s < 16; ++s) offsets += float(sc[s]) * side[kSumsAt + s];
    return f16_at(blk + kD) * (float(t) * side[0] - offsets);
  }
#if defined(__AVX2__) && defined(__FMA__)
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const int8_t* const (&xc)[MB],
                                                          const float* const (&side)[MB], __m256 (&acc)[R][MB]) {
    // For run b (mod 4): lane 0 picks int16 word 2b, lane 1 word 2b + 1 (vpshufb indices).
    alignas(32) static constexpr auto pick = [] {
      struct { int8_t b[4][32]; } t{};
      for (int b = 0; b < 4; ++b)
        for (int i = 0; i < 32; ++i) t.b[b][i] = int8_t(2 * (2 * b + i / 16) + i % 2);
      return t;
    }();
    const __m256i nibble = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    for (int r = 0; r < R; ++r) {
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + kScales));
      // The 16 int8 scales as int16: 0-7 in both lanes of sc16[0], 8-15 in both of sc16[1], so each
      // run's pair (sub-blocks 2b, 2b + 1) is one vpshufb.
      const __m256i sc16[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8)),
                               _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)))};
      const __m256 s_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8));
      const __m256 s_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
      __m256i it[MB];
      for (int m = 0; m < MB; ++m) it[m] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + kQh + 32 * h));
        // Bits 2f, 2f + 1 of each qh byte moved to bits 4, 5 (16-bit shifts; the mask drops what
        // crosses from the neighbouring byte).
        const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), high), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high),
                               _mm256_and_si256(qh, high), _mm256_and_si256(_mm256_srli_epi16(qh, 2), high)};
        for (int t2 = 0; t2 < 2; ++t2) {
          const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + 64 * h + 32 * t2));
          const __m256i lo[2] = {_mm256_and_si256(ql, nibble), _mm256_and_si256(_mm256_srli_epi16(ql, 4), nibble)};
          for (int p = 0; p < 2; ++p) {
            const int f = t2 + 2 * p, b = 4 * h + f;
            const __m256i q = _mm256_or_si256(lo[p], hi[f]);
            const __m256i scale = _mm256_shuffle_epi8(sc16[b / 4], _mm256_load_si256(reinterpret_cast<const __m256i*>(pick.b[b % 4])));
            for (int m = 0; m < MB; ++m) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m] + 32 * b));
              it[m] = dot2_16(it[m], _mm256_maddubs_epi16(q, x), scale);
            }
          }
        }
      }
      const __m256 d = _mm256_set1_ps(f16_at(blk[r] + kD));
      for (int m = 0; m < MB; ++m) {  // the hoisted -32, in units of d
        const __m256 offsets = _mm256_fmadd_ps(s_hi, _mm256_loadu_ps(side[m] + kSumsAt + 8),
                                               _mm256_mul_ps(s_lo, _mm256_loadu_ps(side[m] + kSumsAt)));
        const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(it[m]), _mm256_set1_ps(side[m][0]), offsets);
        acc[r][m] = _mm256_fmadd_ps(t, d, acc[r][m]);
      }
    }
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // 512 bits: pair k = 2h + p of x runs (2k, 2k + 1) is the low (p = 0) or high (p = 1) nibbles
  // of ql bytes 64h .. 64h + 63, with the qh bits of x runs 4h + 2p (bytes 0-31) and 4h + 2p + 1
  // (32-63) from qh bytes 32h .. 32h + 31 in both halves; its 4 sub-blocks 4k .. 4k + 3 take 16
  // bytes each, so dword lane e of its product vector D_k (dot4_512) lies in sub-block 4k + e / 4.
  // The two pairs of one h are packed into int16 words (vpackssdw, per 128-bit lane L: words 0-3
  // from D_2h, 4-7 from D_2h+1; |D| <= 4 * 63 * 127 < 2^15, no saturation) and meet their
  // sub-blocks' scales in one vpdpwssd.
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block512(const uint8_t* const (&blk)[R], const int8_t* const (&xc)[MB],
                                                             const float* const (&side)[MB], __m512 (&acc)[R][MB]) {
    alignas(64) static constexpr auto idx = [] {  // word 8L + i of h: sub-block 4(2h + i / 4) + L
      struct { int16_t w[2][32]; } t{};
      for (int h = 0; h < 2; ++h)
        for (int w = 0; w < 32; ++w) t.w[h][w] = int16_t(4 * (2 * h + w % 8 / 4) + w / 8);
      return t;
    }();
    const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
    // qh bits 2f, 2f + 1 to bits 4, 5 (16-bit shifts; the mask drops what crosses bytes): f = 0, 1
    // (left by 4, 2) for the low nibbles' halves, f = 2, 3 (right by 0, 2) for the high ones'.
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int r = 0; r < R; ++r) {
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + kScales));
      const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
      const __m512 sf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8));
      __m512i it[MB];
      for (int m = 0; m < MB; ++m) it[m] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + kQh + 32 * h)));
        const __m512i ql = _mm512_loadu_si512(blk[r] + 64 * h);
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(ql, nibble), _mm512_and_si512(_mm512_sllv_epi16(qh, left), high)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                            _mm512_and_si512(_mm512_srlv_epi16(qh, right), high))};
        const __m512i scale = _mm512_permutexvar_epi16(_mm512_load_si512(idx.w[h]), sc16);
        for (int m = 0; m < MB; ++m) {
          const __m512i d0 = dot4_512_from_zero(q[0], _mm512_loadu_si512(xc[m] + 128 * h));
          const __m512i d1 = dot4_512_from_zero(q[1], _mm512_loadu_si512(xc[m] + 128 * h + 64));
          it[m] = dot2_16_512(it[m], _mm512_packs_epi32(d0, d1), scale);
        }
      }
      const __m512 d = _mm512_set1_ps(f16_at(blk[r] + kD));
      for (int m = 0; m < MB; ++m) {  // the hoisted -32, in units of d
        const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(it[m]), _mm512_set1_ps(side[m][0]),
                                         _mm512_mul_ps(sf, _mm512_loadu_ps(side[m] + kWideSumsAt)));
        acc[r][m] = _mm512_fmadd_ps(t, d, acc[r][m]);
      }
    }
  }
#endif
};

// What the kernels share: W rows of super-blocks, x quantized per super-block, side data per
// super-block: the x scale, then Fmt::kSums offset sums. K is whole super-blocks: nothing for
// rest(). Two layouts of x: natural (WIDE false: the AVX2 and portable kernels) and WideX (WIDE
// true, the 512-bit kernels: run Fmt::kWideOrder[p] of 32 codes at position p).
template <typename Fmt, bool WIDE>
struct Base {
  using X = int8_t;
  static constexpr int64_t kSumsFrom = WIDE ? Fmt::kWideSumsAt : kSumsAt;
  static constexpr int64_t kXPerChunk = kSuper, kSidePerChunk = kSumsFrom + Fmt::kSums;
  static constexpr int kMaxXBlock = 4;
  static constexpr int64_t slab_bytes(int) { return 0; }  // one pass over K (chunk_driver.h)
  const uint8_t* blocks;
  int64_t chunks, row_bytes, rest_floats = 0, part_chunks = 1;
  Base(const uint8_t* w, int64_t K) : blocks(w), chunks(K / kSuper), row_bytes(chunks * Fmt::kBlockBytes) {}
  const uint8_t* row(int64_t n) const { return blocks + n * row_bytes; }
  void prepare_part(const float* x, int64_t c0, int64_t c1, X* xc, float* side, float*) const {
    for (int64_t c = c0; c < c1; ++c) {
      int8_t q[kSuper];
      float* sd = side + c * kSidePerChunk;
      const float d = quantize_block(x + c * kSuper, q, kSuper);
      sd[0] = d;
      std::fill(sd + 1, sd + kSumsFrom, 0.0f);
      for (int s = 0; s < Fmt::kSums; ++s)
        sd[kSumsFrom + s] = Fmt::offset_factor * (d * float(block_sum(q + Fmt::kSub * s, Fmt::kSub)));
      for (int p = 0; p < kRuns; ++p) {
        const int b = WIDE ? Fmt::kWideOrder[p] : p;
        std::memcpy(xc + c * kSuper + p * kBlock, q + b * kBlock, kBlock);
      }
    }
  }
  template <int R>
  void start_tile(int64_t, int64_t, int64_t) const {}
  float rest(int64_t, const float*) const { return 0.0f; }
};

template <typename Fmt>
struct ScalarKernel : Base<Fmt, false> {
  using Acc = float;
  using Base<Fmt, false>::Base;
  static constexpr int tile_rows(int) { return 1; }
  template <int R, int MB>
  inline void chunk(int64_t, const uint8_t* const (&row)[R], int64_t c, const int8_t* const (&xc)[MB],
                    const float* const (&side)[MB], Acc (&acc)[R][MB]) const {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] += chunk::rounded(Fmt::scalar(row[r] + c * Fmt::kBlockBytes, xc[m], side[m]));
  }
  static Acc zero() { return 0.0f; }
  static float reduce(Acc a) { return a; }
};

#if defined(__AVX2__) && defined(__FMA__)
// Prefetch into L1, for tiles of up to 4 rows the super-blocks of the next tile (R rows on) at
// blk's column: the next tile takes the same slab of chunks next (chunk_driver.h). A tile of 8
// rows (Q6_K at one row of x) would so fetch its 8 rows' whole length ahead, past what L1 holds:
// it takes its own rows' super-blocks 2 on (4096 x 14336, 2 threads of a Xeon, paired rounds in
// one process: 0.92 of the time with the next tile's; no gain at 2-row tiles, 7% lost at M = 2).
template <typename Fmt, int R>
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* const (&blk)[R], int64_t row_bytes) {
  const int64_t ahead = R >= 8 ? 2 * Fmt::kBlockBytes : R * row_bytes;
  for (int r = 0; r < R; ++r) chunk::prefetch_range(blk[r], ahead, Fmt::kBlockBytes);
}

// The vector kernels: 256-bit (WIDE false: x in natural order, Fmt::block, Fmt::tile_rows) and
// 512-bit (WIDE true: x in WideX, Fmt::block512, tiles of 4 W rows at one row of x, else 2).
template <typename Fmt, bool WIDE>
struct VecKernel : Base<Fmt, WIDE> {
  using Acc = std::conditional_t<WIDE, __m512, __m256>;
  using Base<Fmt, WIDE>::Base;
  // 512 bits: Fmt::kWideRowsAtOne W rows per tile at one row of x (more rows of W in flight where
  // the call streams W once; Zen 4, 4096 x 14336, against 2 rows: Q4_K 4 rows, 1.45-2.02 -> 1.27-1.41
  // ms over 4 processes each; against 4 rows, medians of 5 alternating processes: Q6_K 8 rows,
  // 1.31 -> 1.17 ms, Q4_K no faster), 2 above.
  static constexpr int tile_rows(int mb) { return WIDE ? (mb == 1 ? Fmt::kWideRowsAtOne : 2) : Fmt::tile_rows(mb); }
  template <int R, int MB>
  __attribute__((always_inline)) inline void chunk(int64_t, const uint8_t* const (&row)[R], int64_t c,
                                                   const int8_t* const (&xc)[MB], const float* const (&side)[MB],
                                                   Acc (&acc)[R][MB]) const {
    const uint8_t* blk[R];
    for (int r = 0; r < R; ++r) blk[r] = row[r] + c * Fmt::kBlockBytes;
    prefetch_ahead<Fmt, R>(blk, this->row_bytes);
    if constexpr (WIDE)
      Fmt::template block512<R, MB>(blk, xc, side, acc);
    else
      Fmt::template block<R, MB>(blk, xc, side, acc);
  }
  static Acc zero() { return Acc{}; }
  static float reduce(Acc v) { return hsum(v); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kHave512 = true;
#else
constexpr bool kHave512 = false;
#endif

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// The kernel width: 512 bits where built for AVX-512 BW and TORCH_QMM_CPU_NO_INT8_512 is unset,
// else 256 (AVX2); none (the portable kernel) without AVX2 or with TORCH_QMM_CPU_NO_AVX2_CHUNKS=1.
int vector_bits() {
#if defined(__AVX2__) && defined(__FMA__)
  if (env_set("TORCH_QMM_CPU_NO_AVX2_CHUNKS")) return 0;
  return kHave512 && !env_set("TORCH_QMM_CPU_NO_INT8_512") ? 512 : 256;
#else
  return 0;
#endif
}

// f(Fmt{}) for Q4_K / Q6_K (check_gguf_int8_activations refuses the others first).
template <typename F>
void with_format(int64_t ggml_type, F&& f) {
  if (ggml_type == Q4K::kType) return f(Q4K{});
  if (ggml_type == Q6K::kType) return f(Q6K{});
  TORCH_CHECK_VALUE(false, "gguf_qmm_int8_activations: no kernel for ggml_type ", ggml_type);
}

void gguf_int8x(const float* x, const uint8_t* blocks, int64_t ggml_type, int64_t M, int64_t N, int64_t K, float* y) {
  with_format(ggml_type, [&](auto fmt) {
    using Fmt = decltype(fmt);
    const int bits = vector_bits();
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512BW__)
    if (bits == 512) return chunk::run(VecKernel<Fmt, true>(blocks, K), x, M, N, K, y);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (bits == 256) return chunk::run(VecKernel<Fmt, false>(blocks, K), x, M, N, K, y);
#endif
    chunk::run(ScalarKernel<Fmt>(blocks, K), x, M, N, K, y);
  });
}

std::string gguf_int8x_kernel(int64_t ggml_type) {
  const int bits = vector_bits();
  if (bits == 0) return "scalar";
  return std::string(bits == 512 ? "avx512bw" : "avx2") + (ggml_type == Q4K::kType ? "-q4k" : "-q6k");
}

}  // namespace
}  // namespace actq
}  // namespace cpu

namespace {

at::Tensor exact_gguf_qmm(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_qmm::gguf_qmm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(x, blocks, ggml_type, N, K);
}

at::Tensor gguf_int8x_cpu(const at::Tensor& x, const at::Tensor& blocks_in, int64_t ggml_type, int64_t N, int64_t K) {
  check_gguf_int8_activations(x, blocks_in, ggml_type, N, K);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const int64_t M = x.numel() / K;
  if (M == 0 || N == 0) return at::zeros(out_shape, x.options());
  const cpu::XRows xr = cpu::x_rows(x, M, K);
  if (!xr.finite) return exact_gguf_qmm(x, blocks_in, ggml_type, N, K);
  const at::Tensor& xf = xr.xf;
  const at::Tensor blocks = blocks_in.contiguous();
  at::Tensor yf = at::empty({M, N}, xf.options());
  cpu::actq::gguf_int8x(xf.data_ptr<float>(), blocks.data_ptr<uint8_t>(), ggml_type, M, N, K, yf.data_ptr<float>());
  // Non-finite results (overflowing block sums, or Inf/NaN in the blocks' f16 scales) are redone
  // exactly, as qmm_int8_activations does.
  if (!cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return exact_gguf_qmm(x, blocks_in, ggml_type, N, K);
  return yf.to(x.scalar_type()).reshape(out_shape);
}

// "int8x/<isa>-q4k", "int8x/<isa>-q6k" (isa avx512bw or avx2), "int8x/scalar", "exact" (x not
// finite) or "empty".
std::string gguf_int8x_cpu_route(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                                 int64_t K) {
  check_gguf_int8_activations(x, blocks, ggml_type, N, K);
  const int64_t M = x.numel() / K;
  if (M == 0 || N == 0) return "empty";
  if (!cpu::x_rows(x, M, K).finite) return "exact";
  return "int8x/" + cpu::actq::gguf_int8x_kernel(ggml_type);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("gguf_qmm_int8_activations", &gguf_int8x_cpu);
  m.impl("_gguf_cpu_route_int8_activations", &gguf_int8x_cpu_route);
}

}  // namespace torch_qmm
