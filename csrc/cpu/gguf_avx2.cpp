// The GGUF K-quants (Q2_K .. Q6_K), IQ4_XS and the lattice i-quants (LatticeGroups) x
// float32/float16/bfloat16 at small M on AVX2 + FMA (gguf_chunked.cpp
// routes here where no AVX-512 kernel goes first), on the chunk driver of chunk_driver.h. A chunk is
// one super-block of 256 weights; its code bytes are read 32 at a time as 8 dwords and cut into
// fields by masks, as U4Multiplier does (chunk_avx2.h): a field masked in place is the integer
// q * 2^s, made a float by Fields (converted: "avx2-q4k"; taken as the bits of a subnormal:
// "avx2-q4k-subnormal"), and meets x times the matching power of two (prepared once per call), so
// each FMA adds q * x, times a power of two, rounded once; both give the same sums. Every vector
// of decoded fields lies in at most two sub-blocks (lanes 0-3 / 4-7, or all 8 in one), so a chain
// of such vectors is scaled once per chain; the offsets (Q4_K's mins, Q6_K's -32) are hoisted out
// as FMAs against sub-block sums of x.
#include "gguf_chunked.h"

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <array>
#include <cstring>

#include "../gguf_format.h"
#include "chunk_avx2.h"
#include "chunk_driver.h"
#include "gguf_chunk_kernel.h"
#include "gguf_fields.h"
#include "gguf_lattice_avx2.h"
#include "qmm_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace torch_qmm {
namespace cpu {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace chunk;

using gguf_fields::f16_at;

// Field j (0..7) of the 4-bit nibbles of a 32-byte load w: q * 2^s, s = nibble_shift<F>(j). In
// place (w & (15 << 4j)) while the field ends by bit F::kFieldBits; above, shifted down to bit 0
// ((w >> 4j) & 15; j = 7 needs no mask).
template <typename F>
constexpr int nibble_shift(int j) { return 4 * j + 4 <= F::kFieldBits ? 4 * j : 0; }
template <typename F>
__attribute__((always_inline)) inline __m256 nibble_field(__m256i w, int j) {
  if (nibble_shift<F>(j) == 4 * j) return F::value(_mm256_and_si256(w, _mm256_set1_epi32(15 << (4 * j))));
  const __m256i down = _mm256_srli_epi32(w, 4 * j);
  return F::value(j == 7 ? down : _mm256_and_si256(down, _mm256_set1_epi32(15)));
}

// The scales of a block are stored once and broadcast from memory (vbroadcastss m32: a load,
// where a broadcast from a register takes two shuffles on the vector pipes the decode needs).
// This keeps the compiler from forwarding the stored values through registers.
template <typename T>
__attribute__((always_inline)) inline void reload_from_memory(T& v) {
  __asm__ volatile("" : "+m"(v));
}

// How a field v = q * 2^s of code bits (a dword lane, s + 6 <= 23) becomes a float, with the factor
// on x and on the sub-block scale that make each chain the same sum:
//   Fields<false>: vcvtdq2ps, q * 2^s exactly; x * 2^-s (exact: x_in_range); scales as they are.
//   Fields<true>: the bits of v as a float, the subnormal q * 2^(s - 149), with no instruction;
//     x * 2^(kSubnormalX - s), and the chain's scale times 2^(149 - kSubnormalX). Each product is
//     q * x * 2^(kSubnormalX - 149), so each chain is the Fields<false> one times that power of two,
//     with the same roundings while every partial sum either is normal or lies on the subnormal
//     grid: so for x in chunk::x_in_subnormal_range. The CPU must not treat subnormal operands as
//     zero (chunk::run clears MXCSR.DAZ around the kernel, kSubnormalOperands), nor slow down on
//     them: measured on Zen 3 (an FMA with a subnormal operand issues as fast as any), where
//     dropping the 32 converts per super-block and W row gave 48 -> 43 cycles at one row of x.
//     Where they are taken: subnormal_fields_enabled (qmm_kernels.h).
template <bool kSub>
struct Fields {
  static constexpr bool kSubnormal = kSub;
  // Bits a field may use in place: below the exponent (a subnormal's 23), or below the sign for
  // the signed convert.
  static constexpr int kFieldBits = kSub ? 23 : 31;
  __attribute__((always_inline)) static inline __m256 value(__m256i v) {
    return kSub ? _mm256_castsi256_ps(v) : _mm256_cvtepi32_ps(v);
  }
  static constexpr float x_factor(int s) { return kSub ? chunk::pow2(chunk::kSubnormalX - s) : chunk::pow2(-s); }
  // x_factor(shift(i)) for i < kN, computed at compile time (pow2 is a loop).
  template <int kN, typename Shift>
  static constexpr std::array<float, kN> x_factors(Shift shift) {
    std::array<float, kN> f{};
    for (int i = 0; i < kN; ++i) f[i] = x_factor(shift(i));
    return f;
  }
  static constexpr float kScaleFactor = kSub ? chunk::pow2(149 - chunk::kSubnormalX) : 1.0f;
  // The highest bit a field may start at in place: x's factor 2^(kSubnormalX - s) (2^-s) must keep
  // every x in range normal and finite (chunk_driver.h).
  static constexpr int kMaxShift = kSub ? 16 : 24;
  // Whether a field of `width` bits at bit s stays in place (else it is shifted down to bit 0).
  static constexpr bool in_place(int s, int width) { return s + width <= kFieldBits && s <= kMaxShift; }
};

// Lanes 0-3 = v[i], lanes 4-7 = v[i + 1]: one vpermps.
__attribute__((always_inline)) inline __m256 pair_of(__m256 v, int i) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1));
}

// Q4_K (144 bytes: d, dmin f16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles):
// w = d*sc[s]*q - dmin*m[s], 8 sub-blocks of 32. Nibble bytes 32J + b (run J = 0..3): low nibble
// = weight 64J + b (sub-block 2J), high = 64J + 32 + b (sub-block 2J + 1), llama.cpp's order.
// In a 32-byte run, byte b = 4l + i sits in dword lane l, so field j holds in lane l the weight
// 64J + 32 (j % 2) + 4l + j / 2: even fields are all in sub-block 2J, odd ones in 2J + 1. Two
// chains per (W row, x row) and run, each scaled by one broadcast; the mins are hoisted:
// y -= sum_s dmin*m[s] * (sum of x over sub-block s).
template <typename F>
struct Q4K {
  using X = float;
  static constexpr int64_t kType = gguf::kTypeQ4_K, kBlockBytes = 144, kQs = 16, kXPerBlock = 256, kSide = 8;
  static constexpr bool kSubnormalOperands = F::kSubnormal;
  // W rows per tile: 8 at one row of x and 2 at two (block() takes them in pairs), 1 above. At one
  // row, each 1 KB of prepared x per super-block comes from L2 once per 8 W rows, not per 2
  // (one Zen 3 core, W in L3: 61 -> 48 cycles per W row and super-block).
  static constexpr int tile_rows(int mb) { return mb == 1 ? 8 : mb <= 2 ? 2 : 1; }

  static constexpr int weight(int run, int j, int l) { return 64 * run + 32 * (j % 2) + 4 * l + j / 2; }
  static void prepare(const float* x, float* xc, float* xs) {
    static constexpr std::array<float, 8> factor = F::template x_factors<8>(nibble_shift<F>);
    for (int run = 0; run < 4; ++run)
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 8; ++l) xc[(8 * run + j) * 8 + l] = x[weight(run, j, l)] * factor[j];
    for (int s = 0; s < 8; ++s) {
      float t = 0.0f;
      for (int i = 0; i < 32; ++i) t += x[32 * s + i];
      xs[s] = t;
    }
  }

  // d*sc[0..7] * F::kScaleFactor into sd, dmin*m[0..7] as the returned vector (products exact: 11
  // by 6 bits, and a power of two). The scale (min) bytes are spread to dwords by one vpshufb of
  // gguf_fields::q4k_scale_min_bytes, which holds them in both lanes (vpmovzxbd from a register
  // is two µops on the shuffle pipes); d and dmin go through memory to their broadcasts (loads,
  // where a broadcast from a register is a shuffle). One Zen 3 core, W in L3, against the scalar
  // unpack (gguf_fields::q4k_scale_bytes): 44.4-45.4 -> 43.6-44.3 cycles per W row and
  // super-block at one row of x, 32.0-32.4 -> 31.4-31.6 per x row at two.
  __attribute__((always_inline)) static inline __m256 scales(const uint8_t* blk, float* sd) {
    const __m256i head = gguf_fields::q4k_head(blk);
    const __m256i bytes = gguf_fields::q4k_scale_min_bytes(head);
    auto dwords = [&](int first) __attribute__((always_inline)) {
      const char z = -1, a = char(first), b = char(first + 4);
      return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(bytes, _mm256_setr_epi8(a, z, z, z, a + 1, z, z, z, a + 2, z, z, z, a + 3, z, z, z,
                                                                            b, z, z, z, b + 1, z, z, z, b + 2, z, z, z, b + 3, z, z, z)));
    };
    alignas(16) float dd[4];
    _mm_store_ps(dd, _mm_mul_ps(_mm_cvtph_ps(_mm256_castsi256_si128(head)), _mm_setr_ps(F::kScaleFactor, 1.0f, 1.0f, 1.0f)));
    reload_from_memory(dd);
    _mm256_store_ps(sd, _mm256_mul_ps(dwords(0), _mm256_broadcast_ss(dd)));
    return _mm256_mul_ps(dwords(8), _mm256_broadcast_ss(dd + 1));
  }

  // At one or two rows of x, the tile's two W rows go through the block together (P = 2): each
  // row's sums are chains of dependent FMAs (the order of the sums is fixed), and the two rows'
  // independent chains overlap; each x vector is loaded once for both rows. (Measured on a Zen 3
  // core, W in L3, two rows of x: 37 -> 32 cycles per W row, x row and super-block. Q6_K's
  // block, with more registers live, lost at two rows of x: 44 -> 60.)
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m256 (&acc)[R][MB]) {
    constexpr int P = MB <= 2 && R % 2 == 0 ? 2 : 1;
    for (int r0 = 0; r0 < R; r0 += P) {
      alignas(32) float sd[P][8];
      __m256 mins[P];
      for (int p = 0; p < P; ++p) mins[p] = scales(blk[r0 + p], sd[p]);
      reload_from_memory(sd);
      for (int p = 0; p < P; ++p)
        for (int m = 0; m < MB; ++m) acc[r0 + p][m] = _mm256_fnmadd_ps(mins[p], _mm256_loadu_ps(xs[m]), acc[r0 + p][m]);
      for (int run = 0; run < 4; ++run) {
        __m256i w[P];
        for (int p = 0; p < P; ++p) w[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r0 + p] + kQs + 32 * run));
        __m256 ch[P][MB][2];
        for (int p = 0; p < P; ++p)
          for (int m = 0; m < MB; ++m) ch[p][m][0] = ch[p][m][1] = _mm256_setzero_ps();
        // Unrolled, so that each field's mask is a constant (rolled, GCC built the masks in the
        // loop: 32 -> 90 cycles at two rows of x).
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          for (int m = 0; m < MB; ++m) {
            const __m256 xv = _mm256_loadu_ps(xc[m] + (8 * run + j) * 8);
            for (int p = 0; p < P; ++p)
              ch[p][m][j % 2] = _mm256_fmadd_ps(nibble_field<F>(w[p], j), xv, ch[p][m][j % 2]);
          }
        for (int p = 0; p < P; ++p) {
          const __m256 se = _mm256_broadcast_ss(sd[p] + 2 * run), so = _mm256_broadcast_ss(sd[p] + 2 * run + 1);
          for (int m = 0; m < MB; ++m)
            acc[r0 + p][m] = _mm256_fmadd_ps(ch[p][m][1], so, _mm256_fmadd_ps(ch[p][m][0], se, acc[r0 + p][m]));
        }
      }
    }
  }
};

// Q6_K (210 bytes: ql[128] low nibbles, qh[64] high 2 bits, 16 int8 scales, d f16):
// w = d*sc[s]*(q - 32), 16 sub-blocks of 16, q = low nibble + 16 * high field. Half h (128
// weights): ql bytes 64h + 32t + b: low nibble (p = 0) = weight 128h + 32t + b, high nibble
// (p = 1) = weight 128h + 64 + 32t + b; qh bytes 32h + b: field f (bits 2f, 2f+1) = high bits of
// weight 128h + 32f + b (llama.cpp's dequantize_row_q6_K order). The weight of nibble p of byte
// b has its high field f = 2p + t in byte b of qh, at bit 4p + 2t. So for each (t, p), two ANDs
// and an OR on the whole 32-byte vectors (ql or ql >> 4 for the nibbles, qh shifted so that the
// field sits at bits 4-5 of its byte) leave the 6-bit q of every weight in its own byte; with
// b = 4l + u (dword lane l, byte u), the field of byte u (an AND, or a shift for u = 3) is
// q * 2^(8u) (exact; q for u = 3), which meets x * 2^-(8u). Every such vector has lanes 0-3 in
// sub-block 8h + 2k and lanes 4-7 in 8h + 2k + 1, k = t + 2p: per half, 4 chains k of 4 vectors
// (u = 0..3), each scaled by one pair of scales. The -32 is hoisted: y -= sum_s d*sc[s] * 32 *
// (sum of x over sub-block s).
template <typename F>
struct Q6K {
  using X = float;
  static constexpr int64_t kType = gguf::kTypeQ6_K, kBlockBytes = 210, kQh = 128, kScales = 192, kD = 208;
  static constexpr int64_t kXPerBlock = 256, kSide = 16;
  static constexpr bool kSubnormalOperands = F::kSubnormal;
  // W rows per tile: 2 at one or two rows of x (block() alternates them), 1 above.
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 2 : 1; }

  // Byte u of a dword holds its field at bit byte_shift(u) once extracted (byte 3 shifted down).
  static constexpr int byte_shift(int u) { return u == 3 ? 0 : 8 * u; }
  static void prepare(const float* x, float* xc, float* xs) {
    static constexpr std::array<float, 4> factor = F::template x_factors<4>(byte_shift);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k) {
        const int t = k % 2, p = k / 2;
        for (int u = 0; u < 4; ++u)
          for (int l = 0; l < 8; ++l)
            xc[((h * 4 + k) * 4 + u) * 8 + l] = x[128 * h + 64 * p + 32 * t + 4 * l + u] * factor[u];
      }
    for (int s = 0; s < 16; ++s) {
      float t = 0.0f;
      for (int i = 0; i < 16; ++i) t += x[16 * s + i];
      xs[s] = 32.0f * t;
    }
  }

  // The 6-bit q of the weights of nibble p, run t of the block's half at ql / qh, one per byte.
  __attribute__((always_inline)) static inline __m256i q_bytes(const uint8_t* ql, const uint8_t* qh, int t, int p) {
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const __m256i lo = p == 0 ? l : _mm256_srli_epi32(l, 4);
    const int up = 4 - (4 * p + 2 * t);  // moves the high field to bits 4-5 of its byte
    const __m256i hi = up > 0 ? _mm256_slli_epi32(h, up) : up < 0 ? _mm256_srli_epi32(h, -up) : h;
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0F)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  }
  // Byte u of every dword of q (q * 2^(8u); q itself for u = 3) as F makes it a float.
  __attribute__((always_inline)) static inline __m256 byte_field(__m256i q, int u) {
    return F::value(u == 3 ? _mm256_srli_epi32(q, 24) : _mm256_and_si256(q, _mm256_set1_epi32(0x3F << (8 * u))));
  }

  // At one row of x, the tile's two W rows alternate chain by chain (P = 2): each row's sums are
  // one chain of dependent FMAs (the order of the sums is fixed), and the two rows' chains overlap.
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m256 (&acc)[R][MB]) {
    constexpr int P = MB == 1 && R % 2 == 0 ? 2 : 1;
    for (int r0 = 0; r0 < R; r0 += P) {
      __m256 s_lo[P], s_hi[P], c_lo[P], c_hi[P];  // d*sc[s] for the offsets; times F::kScaleFactor for the chains
      for (int i = 0; i < P; ++i) {
        const uint8_t* b = blk[r0 + i];
        const __m256 d = _mm256_set1_ps(f16_at(b + kD));
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kScales));
        s_lo[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), d);
        s_hi[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))), d);
        for (int m = 0; m < MB; ++m)
          acc[r0 + i][m] = _mm256_fnmadd_ps(s_hi[i], _mm256_loadu_ps(xs[m] + 8),
                                            _mm256_fnmadd_ps(s_lo[i], _mm256_loadu_ps(xs[m]), acc[r0 + i][m]));
        c_lo[i] = F::kSubnormal ? _mm256_mul_ps(s_lo[i], _mm256_set1_ps(F::kScaleFactor)) : s_lo[i];
        c_hi[i] = F::kSubnormal ? _mm256_mul_ps(s_hi[i], _mm256_set1_ps(F::kScaleFactor)) : s_hi[i];
      }
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 2; ++t)
          for (int p = 0; p < 2; ++p)
            for (int i = 0; i < P; ++i) {
              const int k = t + 2 * p;
              const __m256i q = q_bytes(blk[r0 + i] + 64 * h + 32 * t, blk[r0 + i] + kQh + 32 * h, t, p);
              __m256 ch[MB];
              for (int m = 0; m < MB; ++m) ch[m] = _mm256_setzero_ps();
              for (int u = 0; u < 4; ++u) {
                const __m256 v = byte_field(q, u);
                for (int m = 0; m < MB; ++m) ch[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xc[m] + ((h * 4 + k) * 4 + u) * 8), ch[m]);
              }
              const __m256 sp = pair_of(h == 0 ? c_lo[i] : c_hi[i], 2 * k);
              for (int m = 0; m < MB; ++m) acc[r0 + i][m] = _mm256_fmadd_ps(ch[m], sp, acc[r0 + i][m]);
            }
    }
  }
};

// The field of kWidth bits at bit s of each dword of q, as F makes it a float: in place where F
// allows (F::in_place), else shifted down to bit 0.
template <typename F, int kWidth>
__attribute__((always_inline)) inline __m256 code_field(__m256i q, int s) {
  constexpr int kMask = (1 << kWidth) - 1;
  if (F::in_place(s, kWidth)) return F::value(_mm256_and_si256(q, _mm256_set1_epi32(kMask << s)));
  const __m256i down = _mm256_srli_epi32(q, s);
  return F::value(s + kWidth == 32 ? down : _mm256_and_si256(down, _mm256_set1_epi32(kMask)));
}

// One chain of byte codes, as Q5K and IQ4XS lay them out (code byte u of dword lane L a field at
// bit 8u; x prepared per chain k as 4 vectors, u = 0..3): ch[m] = sum over u of the fields times
// x row m's vector (k, u).
template <typename F, int kWidth, int MB>
__attribute__((always_inline)) inline void byte_code_chain(__m256i q, const float* const (&xc)[MB], int k,
                                                           __m256 (&ch)[MB]) {
  for (int m = 0; m < MB; ++m) ch[m] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u) {
    const __m256 v = code_field<F, kWidth>(q, 8 * u);
    for (int m = 0; m < MB; ++m) ch[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xc[m] + (k * 4 + u) * 8), ch[m]);
  }
}

// Q5_K (176 bytes: Q4_K's d, dmin and 12 scale bytes, qh[32], then Q4_K's 128 nibble bytes):
// w = d*sc[s]*q - dmin*m[s], 8 sub-blocks of 32. For run c and nibble p, the 32 weights
// 64c + 32p + b (b = 0..31, sub-block 2c + p) have their low 4 bits in nibble p of qs byte 32c + b
// and their fifth bit at bit 2c + p of qh byte b: codes() assembles the 5-bit codes one per byte
// (as Q6K::q_bytes), and byte u of dword lane L, the weight 64c + 32p + 4L + u, is a field at bit
// 8u. One chain of 4 vectors per (c, p), scaled by one broadcast; Q4K's scales and hoisted mins.
template <typename F>
struct Q5K {
  using X = float;
  static constexpr int64_t kType = gguf::kTypeQ5_K, kBlockBytes = 176, kQh = 16, kQs = 48, kXPerBlock = 256, kSide = 8;
  static constexpr bool kSubnormalOperands = F::kSubnormal;
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 2 : 1; }

  static constexpr int field_shift(int u) { return F::in_place(8 * u, 5) ? 8 * u : 0; }
  static void prepare(const float* x, float* xc, float* xs) {
    for (int k = 0; k < 8; ++k)  // k = 2c + p: the run's sub-block
      for (int u = 0; u < 4; ++u)
        for (int l = 0; l < 8; ++l) xc[(k * 4 + u) * 8 + l] = x[32 * k + 4 * l + u] * F::x_factor(field_shift(u));
    for (int k = 0; k < 8; ++k) {
      float t = 0.0f;
      for (int i = 0; i < 32; ++i) t += x[32 * k + i];
      xs[k] = t;
    }
  }
  __attribute__((always_inline)) static inline __m256i codes(const uint8_t* blk, int c, int p) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQs + 32 * c));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQh));
    const __m256i low = _mm256_and_si256(p == 0 ? q : _mm256_srli_epi32(q, 4), _mm256_set1_epi8(0x0F));
    const int down = 2 * c + p - 4;  // moves bit 2c + p of each qh byte to bit 4
    const __m256i high = down > 0 ? _mm256_srli_epi32(h, down) : down < 0 ? _mm256_slli_epi32(h, -down) : h;
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x10)));
  }

  // At one or two rows of x, the tile's two W rows alternate chain by chain (P = 2; one Zen 3 core,
  // 4096 x 4096, two rows of x: Q2_K 2.40 -> 1.79 ms, Q3_K 3.17 -> 2.38, Q5_K 1.95 -> 1.85 against
  // one W row at a time; Q6K keeps that at two rows).
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m256 (&acc)[R][MB]) {
    constexpr int P = MB <= 2 && R % 2 == 0 ? 2 : 1;
    for (int r0 = 0; r0 < R; r0 += P) {
      alignas(32) float sd[P][8];
      for (int i = 0; i < P; ++i) {
        const __m256 mins = Q4K<F>::scales(blk[r0 + i], sd[i]);  // Q5_K's first 16 bytes are Q4_K's
        for (int m = 0; m < MB; ++m) acc[r0 + i][m] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(xs[m]), acc[r0 + i][m]);
      }
      reload_from_memory(sd);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p)
          for (int i = 0; i < P; ++i) {
            __m256 ch[MB];
            byte_code_chain<F, 5>(codes(blk[r0 + i], c, p), xc, 2 * c + p, ch);
            const __m256 sc = _mm256_broadcast_ss(sd[i] + 2 * c + p);
            for (int m = 0; m < MB; ++m) acc[r0 + i][m] = _mm256_fmadd_ps(ch[m], sc, acc[r0 + i][m]);
          }
    }
  }
};

// IQ4_XS (136 bytes: d f16, scales_h, scales_l[4], qs[128]): w = d*(l_j - 32)*v[q], 8 sub-blocks
// of 32, v = gguf::kIQ4Values (int8). Run c (of 4) reads qs bytes 32c + b: byte b < 16 holds the
// codes of weights 32(2c) + b (low nibble) and 32(2c) + 16 + b (high nibble), byte 16 + b those of
// sub-block 2c + 1. One vpshufb of a run's nibbles (p = 0 low, 1 high) into a table of v + 128
// (1..241) leaves one unsigned byte code per weight; byte u of dword lane L (b = 4L + u) is the
// weight 32(2c + L/4) + 16p + 4(L%4) + u, a field at bit 8u, as Q5K's. Each vector has lanes 0-3 in
// sub-block 2c and 4-7 in 2c + 1: one chain of 4 vectors per (c, p), scaled by that pair of
// scales; the + 128 is hoisted: y -= sum_j 128*d*(l_j - 32) * (sum of x over sub-block j).
template <typename F>
struct IQ4XS {
  using X = float;
  static constexpr int64_t kType = gguf::kTypeIQ4_XS, kBlockBytes = 136, kQs = 8,
                           kXPerBlock = 256, kSide = 8;
  static constexpr bool kSubnormalOperands = F::kSubnormal;
  // W rows per tile: 8 at one row of x (as Q4K's: the prepared x comes from L2 once per 8 W rows;
  // one Zen 3 core, 4096 x 14336: 6.0 -> 4.8 ms against 2 rows), 2 at two, 1 above.
  static constexpr int tile_rows(int mb) { return mb == 1 ? 8 : mb <= 2 ? 2 : 1; }

  static constexpr int field_shift(int u) { return F::in_place(8 * u, 8) ? 8 * u : 0; }
  static constexpr int weight(int c, int p, int u, int l) { return 32 * (2 * c + l / 4) + 16 * p + 4 * (l % 4) + u; }
  static void prepare(const float* x, float* xc, float* xs) {
    for (int c = 0; c < 4; ++c)
      for (int p = 0; p < 2; ++p)
        for (int u = 0; u < 4; ++u)
          for (int l = 0; l < 8; ++l) xc[((2 * c + p) * 4 + u) * 8 + l] = x[weight(c, p, u, l)] * F::x_factor(field_shift(u));
    for (int j = 0; j < 8; ++j) {
      float t = 0.0f;
      for (int i = 0; i < 32; ++i) t += x[32 * j + i];
      xs[j] = t;
    }
  }

  // d*(l_j - 32) * F::kScaleFactor into sd, 128*d*(l_j - 32) as the returned vector (exact: 11 by
  // 6 bits, and powers of two). The 8 bytes d, scales_h, scales_l spread to one dword per
  // sub-block j: nibble j % 2 of scales_l[j / 2] (a vpshufb and a variable shift), bits 2j, 2j + 1
  // of scales_h (a broadcast and a variable shift), as gguf::iq4xs_scale; d by vcvtph2ps.
  __attribute__((always_inline)) static inline __m256 scales(const uint8_t* blk, float* sd) {
    const __m128i head = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk));
    const __m256i low_bytes = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(head, _mm_setr_epi8(4, 4, 5, 5, 6, 6, 7, 7, -1, -1, -1, -1, -1, -1, -1, -1)));
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(low_bytes, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), _mm256_set1_epi32(15));
    const __m256i high_bits = _mm256_broadcastd_epi32(_mm_srli_epi32(head, 16));  // scales_h in the low 16 bits
    const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(high_bits, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    const __m256i l = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
    const float d = _mm_cvtss_f32(_mm_cvtph_ps(head));
    const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(l), _mm256_set1_ps(d));
    _mm256_store_ps(sd, _mm256_mul_ps(s, _mm256_set1_ps(F::kScaleFactor)));
    return _mm256_mul_ps(s, _mm256_set1_ps(128.0f));
  }
  // gguf::kIQ4Values + 128 in both 16-byte lanes (vpshufb looks up within each lane).
  static constexpr std::array<uint8_t, 32> kTable = [] {
    std::array<uint8_t, 32> t{};
    for (int i = 0; i < 32; ++i) t[i] = uint8_t(gguf::kIQ4Values[i % 16] + 128);
    return t;
  }();
  __attribute__((always_inline)) static inline __m256i codes(const uint8_t* blk, int c, int p) {
    const __m256i table = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kTable.data()));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQs + 32 * c));
    const __m256i nibbles = _mm256_and_si256(p == 0 ? q : _mm256_srli_epi32(q, 4), _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(table, nibbles);
  }

  // At one or two rows of x, the tile's W rows alternate chain by chain in pairs, as Q5K's (P = 2).
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m256 (&acc)[R][MB]) {
    constexpr int P = MB <= 2 && R % 2 == 0 ? 2 : 1;
    for (int r0 = 0; r0 < R; r0 += P) {
      alignas(32) float sd[P][8];
      for (int i = 0; i < P; ++i) {
        const __m256 offsets = scales(blk[r0 + i], sd[i]);
        for (int m = 0; m < MB; ++m) acc[r0 + i][m] = _mm256_fnmadd_ps(offsets, _mm256_loadu_ps(xs[m]), acc[r0 + i][m]);
      }
      reload_from_memory(sd);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256 sc[P];  // sub-blocks 2c (lanes 0-3) and 2c + 1 (lanes 4-7), for both nibbles
        for (int i = 0; i < P; ++i) sc[i] = pair_of(_mm256_load_ps(sd[i]), 2 * c);
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p)
          for (int i = 0; i < P; ++i) {
            __m256 ch[MB];
            byte_code_chain<F, 8>(codes(blk[r0 + i], c, p), xc, 2 * c + p, ch);
            for (int m = 0; m < MB; ++m) acc[r0 + i][m] = _mm256_fmadd_ps(ch[m], sc[i], acc[r0 + i][m]);
          }
      }
    }
  }
};

// Q2_K and Q3_K (metal/gguf_format.h): 16 sub-blocks of 16 whose 2-bit code fields (Q3_K: and a
// third bit) sit as Q6_K's runs do. Half h reads the 32 code bytes at C::kQs + 32h; byte b = 16s + l
// holds, at bits 2j, the code of weight 128h + 32j + 16s + l. With b = 4L + u (dword lane L, byte
// u), the field of (j, u) holds in lane L the weight 128h + 32j + 16(L / 4) + 4(L % 4) + u: lanes
// 0-3 in sub-block 8h + 2j, lanes 4-7 in 8h + 2j + 1. So, per half and j, a chain of 4 vectors
// (u = 0..3) scaled by one pair of sub-block scales, as Q6K's. The codes C::codes gives are fields
// of `C::kWidth` bits at bit C::shift(j, u) of each dword; the offsets (Q2_K's mins, Q3_K's -4)
// are hoisted against sub-block sums of x: y -= sum_s offset[s] * (sum of x over s).
//   C provides: kType, kBlockBytes, kWidth; shift(j, u); kXSumFactor (the sums of x are kept times
//   it); scales(blk, s_lo, s_hi, o_lo, o_hi) (the 16 sub-block scales and offsets as float vectors;
//   offset = scale for Q3_K, whose offset is 4 * scale); codes(blk, h, j) (the 32 bytes whose
//   fields shift(j, u) are the codes).
template <typename C, typename F>
struct Sixteens {
  using X = float;
  static constexpr int64_t kType = C::kType, kBlockBytes = C::kBlockBytes, kXPerBlock = 256, kSide = 16;
  static constexpr bool kSubnormalOperands = F::kSubnormal;
  static constexpr int tile_rows(int mb) { return mb <= 2 ? 2 : 1; }

  // Field (j, u) at bit field_shift(j, u) once extracted (in place, or shifted down to bit 0).
  static constexpr int field_shift(int j, int u) { return F::in_place(C::shift(j, u), C::kWidth) ? C::shift(j, u) : 0; }
  static void prepare(const float* x, float* xc, float* xs) {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int u = 0; u < 4; ++u)
          for (int l = 0; l < 8; ++l)
            xc[((h * 4 + j) * 4 + u) * 8 + l] =
                x[128 * h + 32 * j + 16 * (l / 4) + 4 * (l % 4) + u] * F::x_factor(field_shift(j, u));
    for (int s = 0; s < 16; ++s) {
      float t = 0.0f;
      for (int i = 0; i < 16; ++i) t += x[16 * s + i];
      xs[s] = C::kXSumFactor * t;
    }
  }
  __attribute__((always_inline)) static inline __m256 field(__m256i q, int j, int u) {
    return code_field<F, C::kWidth>(q, C::shift(j, u));
  }

  // At one or two rows of x, the tile's two W rows alternate chain by chain, as Q5K's (P = 2).
  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&xs)[MB], __m256 (&acc)[R][MB]) {
    constexpr int P = MB <= 2 && R % 2 == 0 ? 2 : 1;
    for (int r0 = 0; r0 < R; r0 += P) {
      __m256 c_lo[P], c_hi[P];
      for (int i = 0; i < P; ++i) {
        __m256 s_lo, s_hi, o_lo, o_hi;
        C::scales(blk[r0 + i], s_lo, s_hi, o_lo, o_hi);
        for (int m = 0; m < MB; ++m)
          acc[r0 + i][m] = _mm256_fnmadd_ps(o_hi, _mm256_loadu_ps(xs[m] + 8),
                                            _mm256_fnmadd_ps(o_lo, _mm256_loadu_ps(xs[m]), acc[r0 + i][m]));
        c_lo[i] = F::kSubnormal ? _mm256_mul_ps(s_lo, _mm256_set1_ps(F::kScaleFactor)) : s_lo;
        c_hi[i] = F::kSubnormal ? _mm256_mul_ps(s_hi, _mm256_set1_ps(F::kScaleFactor)) : s_hi;
      }
      // Unrolled, so that every shift and mask is a constant.
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < P; ++i) {
            const __m256i q = C::codes(blk[r0 + i], h, j);
            __m256 ch[MB];
            for (int m = 0; m < MB; ++m) ch[m] = _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) {
              const __m256 v = field(q, j, u);
              for (int m = 0; m < MB; ++m) ch[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xc[m] + ((h * 4 + j) * 4 + u) * 8), ch[m]);
            }
            const __m256 sp = pair_of(h == 0 ? c_lo[i] : c_hi[i], 2 * j);
            for (int m = 0; m < MB; ++m) acc[r0 + i][m] = _mm256_fmadd_ps(ch[m], sp, acc[r0 + i][m]);
          }
    }
  }
};

// Q2_K (84 bytes: 16 bytes of 4-bit scale | 4-bit min << 4, qs[64], d, dmin f16): the codes are
// the qs bytes themselves, field (j, u) at bit 8u + 2j; w = d*sc[s]*q - dmin*m[s].
struct Q2KCodes {
  static constexpr int64_t kType = gguf::kTypeQ2_K, kBlockBytes = 84, kQs = 16, kD = 80;
  static constexpr int kWidth = 2;
  static constexpr float kXSumFactor = 1.0f;
  static constexpr int shift(int j, int u) { return 8 * u + 2 * j; }
  __attribute__((always_inline)) static inline void scales(const uint8_t* blk, __m256& s_lo, __m256& s_hi, __m256& o_lo,
                                                           __m256& o_hi) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256 d = _mm256_set1_ps(f16_at(blk + kD)), dmin = _mm256_set1_ps(f16_at(blk + kD + 2));
    const __m256i low4 = _mm256_set1_epi32(15);
    s_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo, low4)), d);
    s_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, low4)), d);
    o_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), dmin);
    o_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), dmin);
  }
  __attribute__((always_inline)) static inline __m256i codes(const uint8_t* blk, int h, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQs + 32 * h));
  }
};

// Q3_K (110 bytes: hmask[32], qs[64], 12 bytes of 6-bit scales, d f16): the code of weight
// 128h + 32j + b is the 2 bits 2j of qs byte 32h + b and, as its bit 2, bit 4h + j of hmask
// byte b; codes() assembles the 3-bit codes of (h, j) one per byte (two shifts, two ANDs and an
// OR on the whole 32 bytes), field (j, u) at bit 8u. w = d*(sc[s] - 32)*(q - 4), the -4 hoisted.
struct Q3KCodes {
  static constexpr int64_t kType = gguf::kTypeQ3_K, kBlockBytes = 110, kQs = 32, kScales = 96, kD = 108;
  static constexpr int kWidth = 3;
  static constexpr float kXSumFactor = 4.0f;
  static constexpr int shift(int, int u) { return 8 * u; }
  // The 16 scales sc - 32 as int8: from the 12 bytes, the low 4 bits of scale s are the low
  // (s < 8) or high (s >= 8) nibble of byte s % 8, its top 2 bits bits 2 * (s / 4) of byte
  // 8 + s % 4 (gguf::q3k_scale), done on 32-bit words, 4 scales each (llama.cpp unpacks so too).
  __attribute__((always_inline)) static inline __m128i signed_scales(const uint8_t* blk) {
    uint32_t w[3];
    std::memcpy(w, blk + kScales, 12);
    constexpr uint32_t kLow = 0x0F0F0F0Fu, kTwo = 0x03030303u;
    const uint32_t s0 = (w[0] & kLow) | ((w[2] & kTwo) << 4);
    const uint32_t s1 = (w[1] & kLow) | (((w[2] >> 2) & kTwo) << 4);
    const uint32_t s2 = ((w[0] >> 4) & kLow) | (((w[2] >> 4) & kTwo) << 4);
    const uint32_t s3 = ((w[1] >> 4) & kLow) | (((w[2] >> 6) & kTwo) << 4);
    return _mm_sub_epi8(_mm_setr_epi32(int(s0), int(s1), int(s2), int(s3)), _mm_set1_epi8(32));
  }
  __attribute__((always_inline)) static inline void scales(const uint8_t* blk, __m256& s_lo, __m256& s_hi, __m256& o_lo,
                                                           __m256& o_hi) {
    const __m128i sc = signed_scales(blk);
    const __m256 d = _mm256_set1_ps(f16_at(blk + kD));
    s_lo = o_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    s_hi = o_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
  }
  __attribute__((always_inline)) static inline __m256i codes(const uint8_t* blk, int h, int j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQs + 32 * h));
    const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(q, 2 * j), _mm256_set1_epi8(0x03));
    const int down = 4 * h + j - 2;  // moves bit 4h + j of each hmask byte to bit 2
    const __m256i high = down > 0 ? _mm256_srli_epi32(m, down) : down < 0 ? _mm256_slli_epi32(m, -down) : m;
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x04)));
  }
};

template <typename F>
using Q2K = Sixteens<Q2KCodes, F>;
template <typename F>
using Q3K = Sixteens<Q3KCodes, F>;

// The lattice i-quants (IQ1_S .. IQ3_S): each group of 8 weights decoded by
// gguf_lattice_avx2.h (a codebook load, its sign mask or offset, its scale), then one FMA per row
// of x with x's 8 values of the group. x is used as it is (no preparation, no side data); a tile of
// two W rows at one row of x shares each load of x.
template <int type>
struct LatticeGroups {
  using X = float;
  using L = gguf::Lattice<type>;
  static constexpr int64_t kType = type, kBlockBytes = int64_t(sizeof(typename L::Block)), kXPerBlock = 256, kSide = 1;
  static constexpr int tile_rows(int mb) { return mb == 1 ? 2 : 1; }
  // Decoding a group costs more than its FMAs: 3 rows of x left go in one block, not 2 + 1
  // (4096 x 14336, IQ2_XXS, 2 threads: M = 3 13.7 ms against M = 4 9.4 with blocks of 2 + 1).
  static constexpr bool kThreeRowBlocks = true;
  static void prepare(const float* x, float* xc, float* side) {
    std::memcpy(xc, x, 256 * sizeof(float));
    side[0] = 0.0f;
  }

  template <int R, int MB>
  __attribute__((always_inline)) static inline void block(const uint8_t* const (&blk)[R], const float* const (&xc)[MB],
                                                          const float* const (&)[MB], __m256 (&acc)[R][MB]) {
    const float* grid = lattice::grid<type>();
    typename L::Block b[R];
    float d[R];
    for (int r = 0; r < R; ++r) {
      std::memcpy(&b[r], blk[r], sizeof(b[r]));  // blocks are byte-aligned inside a row
      d[r] = c10::Half(uint16_t(L::d_bits(&b[r])), c10::Half::from_bits());
    }
    // Unrolled whole: every bit field code() reads sits at a constant place, and what it reads per
    // sub-block (its scale, IQ2_XXS's / IQ3_XXS's sign word) is computed once for its groups.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l)
        for (int r = 0; r < R; ++r) {
          const int g = 4 * j + l;
          const __m256 w = lattice::weights<type>(grid, L::code(&b[r], g, d[r]));
          for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xc[m] + 8 * g), acc[r][m]);
        }
  }
};

// 8 float32 lanes; block b of each row of the next tile (R rows on) prefetched into L1, so W
// streams a tile ahead of its use (the next tile takes the same slab of blocks next).
struct GgufYmm {
  using Acc = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  // K slabs at 4 rows of x, where x traffic bounds these kernels (chunk_driver.h).
  static constexpr int64_t slab_bytes(int mb) { return mb >= 4 ? chunk::kSlabBytes : 0; }
  template <int R>
  __attribute__((always_inline)) static inline void prefetch(const uint8_t* const (&row)[R], int64_t b, int64_t row_bytes,
                                                             int64_t block_bytes) {
    for (int r = 0; r < R; ++r) chunk::prefetch_range(row[r], R * row_bytes + b * block_bytes, block_bytes);
  }
};

// Whether a call takes the Fields<true> kernels: where the CPU takes them and x is in their range;
// for Q4_K only where the rows of x go in blocks of 4 and 1 (M % 4 < 2). One Zen 3 core, W in L3,
// cycles per W row, x row and super-block, Fields<false> / <true>: Q4_K M=1 48 / 44.5, M=2
// 32.2 / 35.6 (its two-row block, with 8 chains live, spills more), M=4 28.6 / 27.9; Q6_K M=1
// 66 / 58, M=2 43.5 / 41.5, M=4 36.5 / 35, M=8 36.5 / 35.5.
bool subnormal_fields_for(const GgufArgs& a, int64_t ggml_type) {
  return a.x_in_subnormal_range && (ggml_type != gguf::kTypeQ4_K || a.M % 4 < 2) && subnormal_fields_enabled();
}

// The kernel names of each type: Fields<false>, Fields<true>.
struct Avx2Names {
  int64_t ggml_type;
  const char* converted;
  const char* subnormal;
};
constexpr Avx2Names kAvx2Names[] = {{gguf::kTypeQ2_K, "avx2-q2k", "avx2-q2k-subnormal"},
                                    {gguf::kTypeQ3_K, "avx2-q3k", "avx2-q3k-subnormal"},
                                    {gguf::kTypeQ4_K, "avx2-q4k", "avx2-q4k-subnormal"},
                                    {gguf::kTypeQ5_K, "avx2-q5k", "avx2-q5k-subnormal"},
                                    {gguf::kTypeQ6_K, "avx2-q6k", "avx2-q6k-subnormal"},
                                    {gguf::kTypeIQ4_XS, "avx2-iq4xs", "avx2-iq4xs-subnormal"}};
// The lattice i-quants' kernel takes no code fields as floats: one name each.
constexpr Avx2Names kLatticeNames[] = {{gguf::kTypeIQ2_XXS, "avx2-iq2xxs", nullptr}, {gguf::kTypeIQ2_XS, "avx2-iq2xs", nullptr},
                                       {gguf::kTypeIQ2_S, "avx2-iq2s", nullptr},     {gguf::kTypeIQ3_XXS, "avx2-iq3xxs", nullptr},
                                       {gguf::kTypeIQ3_S, "avx2-iq3s", nullptr},     {gguf::kTypeIQ1_S, "avx2-iq1s", nullptr},
                                       {gguf::kTypeIQ1_M, "avx2-iq1m", nullptr}};

const char* lattice_name(int64_t ggml_type) {
  for (const Avx2Names& n : kLatticeNames)
    if (n.ggml_type == ggml_type) return n.converted;
  return nullptr;
}

bool run_lattice(const GgufArgs& a, int64_t ggml_type, float* y) {
  return run_gguf_chunks<GgufYmm, LatticeGroups<gguf::kTypeIQ2_XXS>, LatticeGroups<gguf::kTypeIQ2_XS>,
                         LatticeGroups<gguf::kTypeIQ2_S>, LatticeGroups<gguf::kTypeIQ3_XXS>, LatticeGroups<gguf::kTypeIQ3_S>,
                         LatticeGroups<gguf::kTypeIQ1_S>, LatticeGroups<gguf::kTypeIQ1_M>>(a, ggml_type, y);
}

template <typename F>
bool run_avx2(const GgufArgs& a, int64_t ggml_type, float* y) {
  return run_gguf_chunks<GgufYmm, Q4K<F>, Q6K<F>, Q2K<F>, Q3K<F>, Q5K<F>, IQ4XS<F>>(a, ggml_type, y);
}

}  // namespace

const char* gguf_avx2_multiplier(const GgufArgs& a, int64_t ggml_type) {
  if (avx2_chunks_avoided() || a.M < 1 || a.M > kGgufAvx2MaxRows) return nullptr;
  if (const char* name = lattice_name(ggml_type)) return name;  // x as it is: any finite or not x
  if (!a.x_in_range) return nullptr;
  for (const Avx2Names& n : kAvx2Names)
    if (n.ggml_type == ggml_type) return subnormal_fields_for(a, ggml_type) ? n.subnormal : n.converted;
  return nullptr;
}

void gguf_avx2(const GgufArgs& a, int64_t ggml_type, float* y) {
  const bool ran = lattice_name(ggml_type) != nullptr          ? run_lattice(a, ggml_type, y)
                   : subnormal_fields_for(a, ggml_type) ? run_avx2<Fields<true>>(a, ggml_type, y)
                                                        : run_avx2<Fields<false>>(a, ggml_type, y);
  TORCH_CHECK(ran, "gguf_qmm: no AVX2 chunk kernel for ggml type ", ggml_type, " (gguf_avx2_multiplier)");
}

#else  // no AVX2: the fused decode-and-dot of gguf_qmm.cpp serves these calls.

const char* gguf_avx2_multiplier(const GgufArgs&, int64_t) { return nullptr; }
void gguf_avx2(const GgufArgs&, int64_t, float*) { TORCH_CHECK(false, "gguf_qmm: the AVX2 chunk kernels need AVX2 and FMA"); }

#endif

}  // namespace cpu
}  // namespace torch_qmm
