// GGUF K-quant blocks and i-quant blocks, as llama.cpp writes them (its block_q2_K / q3_K / q4_K / q5_K /
// q6_K / iq4_xs / iq2_xxs / iq2_xs / iq2_s / iq3_xxs / iq3_s / iq1_s / iq1_m structs):
// one place for host C++
// (csrc/gguf_format.h forwards here; csrc/cpu/gguf_qmm.cpp, csrc/gguf_validate.cpp) and the Metal
// kernels (metal/gguf_qmm.h). Compiled by both compilers: Metal sources define TORCH_QMM_METAL
// before including it. Constants are enumerators (no address space in MSL), helpers templates.
//
// A GGUF matrix W [N, K] (ggml: ne0 = K innermost, ne1 = N) is stored row by row; each row is
// K / 256 super-blocks of 256 consecutive weights. torch_qmm keeps them as uint8 [N, K/256 * bytes].
//
//   Q4_K (144 bytes / 256 weights)              Q6_K (210 bytes / 256 weights)
//   +------+------+-----------+----------+      +---------+---------+------------+------+
//   | d    | dmin | scales[12]| qs[128]  |      | ql[128] | qh[64]  | scales[16] | d    |
//   | f16  | f16  | 8 x (6b scale, 6b min)| 4-bit|      | low 4b  | high 2b | int8       | f16  |
//   +------+------+-----------+----------+      +---------+---------+------------+------+
//   Q4_K: 8 sub-blocks of 32; chunk c (of 4, 64 weights each) reads qs[32c .. 32c+32):
//         low nibbles -> weights 64c + l, sub-block 2c;  high nibbles -> 64c + 32 + l, sub-block 2c+1;
//         w = d * scale_j * q - dmin * min_j.
//   Q6_K: 16 sub-blocks of 16; half h (of 2, 128 weights) reads ql[64h ..), qh[32h ..), scales[8h ..):
//         for l < 32, weights 128h + l + 32i (i = 0..3) take 4 bits of ql and 2 bits of qh[l] (bits 2i);
//         w = d * scales[sub] * (q - 32).
//
//   Q2_K (84 bytes / 256 weights)               Q3_K (110 bytes / 256 weights)
//   +------------+---------+------+------+      +-----------+---------+------------+------+
//   | scales[16] | qs[64]  | d    | dmin |      | hmask[32] | qs[64]  | scales[12] | d    |
//   | 4b sc|4b min| 2-bit  | f16  | f16  |      | high bit  | low 2b  | 16 x 6-bit | f16  |
//   +------------+---------+------+------+      +-----------+---------+------------+------+
//   Both: 16 sub-blocks of 16; half h (of 2, 128 weights) reads qs[32h ..): for j = 0..3, s = 0..1,
//         l < 16, weight 128h + 32j + 16s + l takes bits 2j, 2j+1 of qs[32h + 16s + l], sub-block
//         8h + 2j + s (the layout of Q6_K's runs, one shift per run of 32);
//         Q2_K: w = d * (scales[sub] & 15) * q - dmin * (scales[sub] >> 4), q = 0..3;
//         Q3_K: the code's third bit is bit 4h + j of hmask[16s + l]; w = d * (sc_sub - 32) * (q - 4),
//               q = 0..7 (sc_sub: q3k_scale).
//
//   Q5_K (176 bytes / 256 weights): Q4_K's d, dmin and scales[12], then qh[32], then qs[128] as
//         Q4_K's; the code's fifth bit is bit 2c + nib of qh[l] for weight 64c + 32*nib + l (its
//         sub-block 2c + nib); w = d * scale_j * q - dmin * min_j, q = 0..31.
//
//   IQ4_XS (136 bytes / 256 weights)
//   +------+----------+-------------+----------+
//   | d    | scales_h | scales_l[4] | qs[128]  |
//   | f16  | 8 x 2b   | 8 x 4b      | 4-bit    |
//   +------+----------+-------------+----------+
//   8 sub-blocks of 32; sub-block j reads qs[16j .. 16j+16): the low nibble of byte l is the code of
//   weight 32j + l, the high nibble that of 32j + 16 + l (Q4_0's order); a code indexes 16 int8
//   values (kIQ4Values); w = d * (ls_j - 32) * kIQ4Values[q], ls_j: iq4xs_scale.
//   The lattice i-quants (IQ1_S 50, IQ1_M 56, IQ2_XXS 66, IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110
//   bytes / 256 weights): 32 groups of 8 weights, each group one entry of a codebook of 8-value
//   vectors (IQ1, IQ2) or two entries of one of 4-value vectors (IQ3) (metal/gguf_iq_grids.h), with
//   sign bits (IQ2, IQ3) or an offset of +-1/8 (IQ1), and a scale per 16 or 32 weights; each type's
//   fields are listed at its Lattice below. w = scale * q, q the group's signed codebook value.
// Decode order and bit placement follow llama.cpp's dequantize_row_q2_K / q3_K / q4_K / q5_K / q6_K /
// iq4_xs / iq2_xxs / iq2_xs / iq2_s / iq3_xxs / iq3_s / iq1_s / iq1_m.
#pragma once

#ifndef TORCH_QMM_METAL
#include <cstdint>
#endif

#include "gguf_iq_grids.h"

namespace torch_qmm {
namespace gguf {

// ggml_type ids (ggml's enum ggml_type); Python mirror: torch_qmm/interop/gguf_types.py.
enum GGMLType : int {
  kTypeQ4_0 = 2,
  kTypeQ4_1 = 3,
  kTypeQ5_0 = 6,
  kTypeQ5_1 = 7,
  kTypeQ8_0 = 8,
  kTypeQ2_K = 10,
  kTypeQ3_K = 11,
  kTypeQ4_K = 12,
  kTypeQ5_K = 13,
  kTypeQ6_K = 14,
  kTypeIQ2_XXS = 16,
  kTypeIQ2_XS = 17,
  kTypeIQ3_XXS = 18,
  kTypeIQ1_S = 19,
  kTypeIQ4_NL = 20,
  kTypeIQ3_S = 21,
  kTypeIQ2_S = 22,
  kTypeIQ4_XS = 23,
  kTypeIQ1_M = 29,
  kTypeMXFP4 = 39
};

// Weights per super-block of every K-quant.
enum : int { kQK_K = 256 };

struct BlockQ2K {
  uint8_t scales[kQK_K / 16];  // 16 x (4-bit scale | 4-bit min << 4)
  uint8_t qs[kQK_K / 4];       // 2-bit codes, 4 per byte
  uint16_t d;                  // f16 bits: super-block scale of the sub-block scales
  uint16_t dmin;               // f16 bits: super-block scale of the sub-block mins
};
static_assert(sizeof(BlockQ2K) == 84, "Q2_K block must be 84 bytes (ggml block_q2_K)");

struct BlockQ3K {
  uint8_t hmask[kQK_K / 8];  // the codes' high bits
  uint8_t qs[kQK_K / 4];     // the codes' low 2 bits
  uint8_t scales[12];        // 16 x 6-bit scales, packed (see q3k_scale)
  uint16_t d;                // f16 bits: super-block scale
};
static_assert(sizeof(BlockQ3K) == 110, "Q3_K block must be 110 bytes (ggml block_q3_K)");

struct BlockQ4K {
  uint16_t d;           // f16 bits: super-block scale of the sub-block scales
  uint16_t dmin;        // f16 bits: super-block scale of the sub-block mins
  uint8_t scales[12];   // 8 x (6-bit scale, 6-bit min), packed (see q4k_scale_min)
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ4K) == 144, "Q4_K block must be 144 bytes (ggml block_q4_K)");

struct BlockQ5K {
  uint16_t d;           // f16 bits, as Q4_K's
  uint16_t dmin;        // f16 bits, as Q4_K's
  uint8_t scales[12];   // as Q4_K's (q4k_scale_min)
  uint8_t qh[kQK_K / 8];  // the codes' fifth bits
  uint8_t qs[kQK_K / 2];  // the codes' low 4 bits, as Q4_K's
};
static_assert(sizeof(BlockQ5K) == 176, "Q5_K block must be 176 bytes (ggml block_q5_K)");

struct BlockQ6K {
  uint8_t ql[kQK_K / 2];      // low 4 bits
  uint8_t qh[kQK_K / 4];      // high 2 bits
  int8_t scales[kQK_K / 16];  // 16 sub-block scales
  uint16_t d;                 // f16 bits: super-block scale
};
static_assert(sizeof(BlockQ6K) == 210, "Q6_K block must be 210 bytes (ggml block_q6_K)");

struct BlockIQ4XS {
  uint16_t d;            // f16 bits: super-block scale
  uint16_t scales_h;     // the high 2 bits of the 8 sub-block scales (bits 2j, 2j + 1)
  uint8_t scales_l[4];   // their low 4 bits (sub-block j: nibble j % 2 of byte j / 2)
  uint8_t qs[kQK_K / 2];  // 4-bit codes, sub-block j at 16j (see the layout above)
};
static_assert(sizeof(BlockIQ4XS) == 136, "IQ4_XS block must be 136 bytes (ggml block_iq4_xs)");

// The lattice i-quants' blocks (llama.cpp's block_iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s,
// iq1_m). Every one is a whole number of uint16, so the blocks of a row stay 2-aligned.
struct BlockIQ2XXS {
  uint16_t d;              // f16 bits: super-block scale
  uint16_t qs[kQK_K / 8];  // per 32 weights: 4 codebook-index bytes, then a uint32 of 4 sign indices and a scale
};
static_assert(sizeof(BlockIQ2XXS) == 66, "IQ2_XXS block must be 66 bytes (ggml block_iq2_xxs)");

struct BlockIQ2XS {
  uint16_t d;                  // f16 bits: super-block scale
  uint16_t qs[kQK_K / 8];      // per group of 8: 9-bit codebook index | 7-bit sign index << 9
  uint8_t scales[kQK_K / 32];  // 4-bit scales, one per 16 weights (low nibble first)
};
static_assert(sizeof(BlockIQ2XS) == 74, "IQ2_XS block must be 74 bytes (ggml block_iq2_xs)");

struct BlockIQ2S {
  uint16_t d;                  // f16 bits: super-block scale
  uint8_t qs[kQK_K / 4];       // the 32 codebook indices' low 8 bits, then the 32 groups' sign bytes
  uint8_t qh[kQK_K / 32];      // the indices' top 2 bits, 4 groups per byte
  uint8_t scales[kQK_K / 32];  // 4-bit scales, one per 16 weights (low nibble first)
};
static_assert(sizeof(BlockIQ2S) == 82, "IQ2_S block must be 82 bytes (ggml block_iq2_s)");

struct BlockIQ3XXS {
  uint16_t d;                 // f16 bits: super-block scale
  uint8_t qs[3 * kQK_K / 8];  // 64 codebook indices (4 weights each), then per 32 weights a uint32 of signs and scale
};
static_assert(sizeof(BlockIQ3XXS) == 98, "IQ3_XXS block must be 98 bytes (ggml block_iq3_xxs)");

struct BlockIQ3S {
  uint16_t d;                  // f16 bits: super-block scale
  uint8_t qs[kQK_K / 4];       // the 64 codebook indices' low 8 bits (4 weights each)
  uint8_t qh[kQK_K / 32];      // their 9th bits, bit i % 8 of byte i / 8
  uint8_t signs[kQK_K / 8];    // one sign byte per group of 8 weights
  uint8_t scales[kQK_K / 64];  // 4-bit scales, one per 32 weights (low nibble first)
};
static_assert(sizeof(BlockIQ3S) == 110, "IQ3_S block must be 110 bytes (ggml block_iq3_s)");

struct BlockIQ1S {
  uint16_t d;               // f16 bits: super-block scale
  uint8_t qs[kQK_K / 8];    // the 32 codebook indices' low 8 bits
  uint16_t qh[kQK_K / 32];  // per 32 weights: 4 x 3 index bits, a 3-bit scale, the offset's sign
};
static_assert(sizeof(BlockIQ1S) == 50, "IQ1_S block must be 50 bytes (ggml block_iq1_s)");

struct BlockIQ1M {
  uint8_t qs[kQK_K / 8];       // the 32 codebook indices' low 8 bits
  uint8_t qh[kQK_K / 16];      // per group a nibble: 3 index bits, the offset's sign (low nibble first)
  uint8_t scales[kQK_K / 32];  // 4 uint16 of 3-bit scales (one per 16 weights); their top nibbles are d
};
static_assert(sizeof(BlockIQ1M) == 56, "IQ1_M block must be 56 bytes (ggml block_iq1_m)");

// The values IQ4_XS's (and IQ4_NL's) 4-bit codes index (llama.cpp's kvalues_iq4nl).
// Internal linkage (static) in both languages: every translation unit (Metal source) has its own.
#ifdef TORCH_QMM_METAL
static constant constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#else
static constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#endif

#ifndef TORCH_QMM_METAL
// The ggml types with a native gguf_qmm kernel: the bytes of their super-blocks (0: not native).
// Must match NATIVE_TYPES in gguf_types.py and the instantiations in metal/gguf.metal.
inline int64_t block_bytes(int64_t t) {
  switch (t) {
    case kTypeQ2_K: return int64_t(sizeof(BlockQ2K));
    case kTypeQ3_K: return int64_t(sizeof(BlockQ3K));
    case kTypeQ4_K: return int64_t(sizeof(BlockQ4K));
    case kTypeQ5_K: return int64_t(sizeof(BlockQ5K));
    case kTypeQ6_K: return int64_t(sizeof(BlockQ6K));
    case kTypeIQ4_XS: return int64_t(sizeof(BlockIQ4XS));
    case kTypeIQ2_XXS: return int64_t(sizeof(BlockIQ2XXS));
    case kTypeIQ2_XS: return int64_t(sizeof(BlockIQ2XS));
    case kTypeIQ2_S: return int64_t(sizeof(BlockIQ2S));
    case kTypeIQ3_XXS: return int64_t(sizeof(BlockIQ3XXS));
    case kTypeIQ3_S: return int64_t(sizeof(BlockIQ3S));
    case kTypeIQ1_S: return int64_t(sizeof(BlockIQ1S));
    case kTypeIQ1_M: return int64_t(sizeof(BlockIQ1M));
    default: return 0;
  }
}

inline bool is_native_gguf_type(int64_t t) { return block_bytes(t) != 0; }

// For messages: the native types as "id (name)".
inline const char* native_gguf_types() {
  return "10 (Q2_K), 11 (Q3_K), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K), 16 (IQ2_XXS), 17 (IQ2_XS), 18 (IQ3_XXS), "
         "19 (IQ1_S), 21 (IQ3_S), 22 (IQ2_S), 23 (IQ4_XS), 29 (IQ1_M)";
}
#endif

struct ScaleMin {
  int scale;
  int min;
};

// Scale and min of Q4_K sub-block j (0..7) from the 12 packed bytes (llama.cpp get_scale_min_k4):
// j < 4: the low 6 bits of bytes j and j+4; j >= 4: 4 bits from byte j+4 plus the top 2 bits
// of bytes j-4 (scale) and j (min). `Bytes` is any pointer (host or a Metal address space).
template <typename Bytes>
inline ScaleMin q4k_scale_min(int j, Bytes q) {
  ScaleMin r;
  if (j < 4) {
    r.scale = q[j] & 63;
    r.min = q[j + 4] & 63;
  } else {
    r.scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    r.min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
  return r;
}

// Signed scale (-32..31) of Q3_K sub-block j (0..15) from the 12 packed bytes (llama.cpp
// dequantize_row_q3_K's unpacking): the low 4 bits are the low (j < 8) or high (j >= 8) nibble of
// byte j % 8, the top 2 bits are bits 2 * (j / 4) of byte 8 + j % 4.
template <typename Bytes>
inline int q3k_scale(int j, Bytes q) {
  const int low = j < 8 ? (q[j] & 0xF) : (q[j - 8] >> 4);
  const int high = (q[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
  return (low | (high << 4)) - 32;
}

// Signed scale (-32..31) of IQ4_XS sub-block j (0..7): the low 4 bits are nibble j % 2 of
// scales_l[j / 2], the top 2 bits are bits 2j, 2j + 1 of scales_h (llama.cpp dequantize_row_iq4_xs).
template <typename Bytes>
inline int iq4xs_scale(int j, Bytes scales_l, unsigned scales_h) {
  const int low = (scales_l[j >> 1] >> (4 * (j & 1))) & 0xF;
  const int high = (scales_h >> (2 * j)) & 3;
  return (low | (high << 4)) - 32;
}

// ---- The lattice i-quants: one group of 8 weights at a time --------------------------------------
// Lattice<type>::code(b, r, d) reads group r (0..31: weights 8r .. 8r + 8) of block b (a pointer to
// the block struct in any address space) given d, the super-block scale as a float (the f16 bits
// Lattice<type>::d_bits(b)), as a Code8; its weights are scale * q[i] with q from group8, each
// exact in float32 (an f16 times an integer of at most 5 bits times a codebook value of at most 6
// bits, IQ1's offset included). The CPU decoder (csrc/cpu/gguf_qmm.cpp), the AVX2 kernel
// (csrc/cpu/gguf_avx2.cpp), the Metal slices (metal/gguf_qmm.h) and the mma loader
// (metal/gguf_mma.h) all read groups through these; Lattice<type>::grid(i) is codebook entry i
// (kWidth int8 values, byte i the value of weight i) for those that tabulate it.
struct Code8 {
  uint64_t entry;     // byte i: the codebook value of weight i, an int8 (IQ2 / IQ3 magnitudes are below 64)
  uint32_t index[2];  // the entry's codebook index (IQ3: the indices of weights 0..3 and 4..7)
  uint32_t signs;     // bit i set: weight i negated (IQ2, IQ3; 0 for IQ1); with seven_signs, bits 0-6 only
  bool seven_signs;   // signs holds 7 bits, the eighth is their parity (sign_byte; IQ2_XXS, IQ2_XS, IQ3_XXS)
  float offset;    // added to every value before the sign (IQ1: +-1/8; 0 otherwise)
  float scale;
};

struct Group8 {
  float q[8];
  float scale;
};

// The sign byte of a 7-bit sign index: bit 7 makes the number of set bits even (llama.cpp's
// ksigns_iq2xs table; IQ2_XXS, IQ2_XS and IQ3_XXS store 7 of the 8 signs of a group).
constexpr inline uint32_t even_sign_byte(uint32_t index7) {
  uint32_t p = index7 ^ (index7 >> 4);
  p ^= p >> 2;
  p ^= p >> 1;
  return index7 | ((p & 1u) << 7);
}

// The 8 sign bits of a group.
inline uint32_t sign_byte(Code8 c) { return c.seven_signs ? even_sign_byte(c.signs) : c.signs; }

// The group's values: q[i] = +-(int8 byte i of the entry + offset). The sign is a factor of +-1
// (exact), not a choice: the sign bits are data a CPU cannot predict, and a branch per weight
// (what compilers made of the choice) cost the scalar decoder more than the rest of its work.
inline Group8 group8(Code8 c) {
  Group8 g;
  const uint32_t signs = sign_byte(c);
  for (int i = 0; i < 8; ++i) {
    const float v = float(int(int8_t(uint8_t(c.entry >> (8 * i))))) + c.offset;
    g.q[i] = v * (1.0f - 2.0f * float((signs >> i) & 1u));
  }
  g.scale = c.scale;
  return g;
}

// A group of IQ2 / IQ3: an 8-value entry (or two 4-value ones, the first holding weights 0..3) and
// its sign bits (seven_signs: 7 of them, see sign_byte).
inline Code8 signed_code(uint64_t entry, uint32_t index, uint32_t signs, bool seven_signs, float scale) {
  Code8 c;
  c.entry = entry;
  c.index[0] = index;
  c.index[1] = 0;
  c.signs = signs;
  c.seven_signs = seven_signs;
  c.offset = 0.0f;
  c.scale = scale;
  return c;
}
inline Code8 signed_code(uint32_t lo, uint32_t hi, uint32_t index_lo, uint32_t index_hi, uint32_t signs, bool seven_signs,
                         float scale) {
  Code8 c = signed_code(uint64_t(lo) | (uint64_t(hi) << 32), index_lo, signs, seven_signs, scale);
  c.index[1] = index_hi;
  return c;
}

// A group of IQ1: a kIQ1SGrid entry (int8 -1, 0, 1) plus the offset +-1/8.
inline Code8 offset_code(uint64_t entry, uint32_t index, bool negative_offset, float scale) {
  Code8 c;
  c.entry = entry;
  c.index[0] = index;
  c.index[1] = 0;
  c.signs = 0;
  c.seven_signs = false;
  c.offset = 0.125f - 0.25f * float(int(negative_offset));  // arithmetic, not a branch on random bits
  c.scale = scale;
  return c;
}

template <int type>
struct Lattice;

// IQ2_XXS: sub-block j (32 weights) is qs[4j .. 4j + 4): its bytes 0..3 index kIQ2XXSGrid for groups
// 4j .. 4j + 3; the uint32 qs[4j + 2] | qs[4j + 3] << 16 holds the groups' 7-bit sign indices
// (bits 7l ..) and the scale l_j (bits 28-31): scale d * (0.5 + l_j) / 4.
template <>
struct Lattice<kTypeIQ2_XXS> {
  typedef BlockIQ2XXS Block;
  enum : int { kEntries = 256, kWidth = 8 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ2XXSGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) { return b->d; }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const int j = r >> 2, l = r & 3;
    const uint32_t index = (uint32_t(b->qs[4 * j + (l >> 1)]) >> (8 * (l & 1))) & 0xffu;
    const uint32_t aux = uint32_t(b->qs[4 * j + 2]) | (uint32_t(b->qs[4 * j + 3]) << 16);
    return signed_code(kIQ2XXSGrid[index], index, (aux >> (7 * l)) & 127u, true, d * (0.5f + float(aux >> 28)) * 0.25f);
  }
};

// IQ2_XS: group r is qs[r]: a 9-bit index into kIQ2XSGrid and a 7-bit sign index (bits 9-15); the
// scale of weights 16s .. 16s + 16 is d * (0.5 + l_s) / 4, l_s nibble s % 2 of scales[s / 2].
template <>
struct Lattice<kTypeIQ2_XS> {
  typedef BlockIQ2XS Block;
  enum : int { kEntries = 512, kWidth = 8 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ2XSGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) { return b->d; }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const uint32_t v = b->qs[r];
    const uint32_t l = (uint32_t(b->scales[r >> 2]) >> (4 * ((r >> 1) & 1))) & 0xfu;
    return signed_code(kIQ2XSGrid[v & 511u], v & 511u, v >> 9, true, d * (0.5f + float(l)) * 0.25f);
  }
};

// IQ2_S: group r's 10-bit index into kIQ2SGrid is qs[r] with bits 2(r % 4), 2(r % 4) + 1 of
// qh[r / 4] on top; its 8 sign bits are qs[32 + r]; scales as IQ2_XS's.
template <>
struct Lattice<kTypeIQ2_S> {
  typedef BlockIQ2S Block;
  enum : int { kEntries = 1024, kWidth = 8 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ2SGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) { return b->d; }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const uint32_t index = uint32_t(b->qs[r]) | (((uint32_t(b->qh[r >> 2]) >> (2 * (r & 3))) & 3u) << 8);
    const uint32_t l = (uint32_t(b->scales[r >> 2]) >> (4 * ((r >> 1) & 1))) & 0xfu;
    return signed_code(kIQ2SGrid[index], index, b->qs[32 + r], false, d * (0.5f + float(l)) * 0.25f);
  }
};

// IQ3_XXS: group r is entries qs[2r], qs[2r + 1] of kIQ3XXSGrid (4 weights each); sub-block j's
// little-endian uint32 at qs[64 + 4j] holds the 7-bit sign indices of its 4 groups (bits 7l ..)
// and the scale l_j (bits 28-31): scale d * (0.5 + l_j) / 2.
template <>
struct Lattice<kTypeIQ3_XXS> {
  typedef BlockIQ3XXS Block;
  enum : int { kEntries = 256, kWidth = 4 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ3XXSGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) { return b->d; }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const int j = r >> 2, l = r & 3;
    const uint32_t aux = uint32_t(b->qs[64 + 4 * j]) | (uint32_t(b->qs[64 + 4 * j + 1]) << 8) |
                         (uint32_t(b->qs[64 + 4 * j + 2]) << 16) | (uint32_t(b->qs[64 + 4 * j + 3]) << 24);
    const uint32_t lo = b->qs[2 * r], hi = b->qs[2 * r + 1];
    return signed_code(kIQ3XXSGrid[lo], kIQ3XXSGrid[hi], lo, hi, (aux >> (7 * l)) & 127u, true,
                       d * (0.5f + float(aux >> 28)) * 0.5f);
  }
};

// IQ3_S: entry i (0..63, 4 weights) of kIQ3SGrid is qs[i] | (bit i % 8 of qh[i / 8]) << 8; group r
// is entries 2r, 2r + 1, its sign bits signs[r]; the scale of sub-block j (32 weights) is
// d * (1 + 2 l_j), l_j nibble j % 2 of scales[j / 2].
template <>
struct Lattice<kTypeIQ3_S> {
  typedef BlockIQ3S Block;
  enum : int { kEntries = 512, kWidth = 4 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ3SGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) { return b->d; }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const uint32_t high = uint32_t(b->qh[r >> 2]) >> (2 * (r & 3));
    const uint32_t lo = uint32_t(b->qs[2 * r]) | ((high & 1u) << 8);
    const uint32_t hi = uint32_t(b->qs[2 * r + 1]) | (((high >> 1) & 1u) << 8);
    const uint32_t l = (uint32_t(b->scales[r >> 3]) >> (4 * ((r >> 2) & 1))) & 0xfu;
    return signed_code(kIQ3SGrid[lo], kIQ3SGrid[hi], lo, hi, b->signs[r], false, d * float(1 + 2 * int(l)));
  }
};

// IQ1_S: sub-block j (32 weights) has qh[j]: bits 3l .. 3l + 2 are the top of group 4j + l's 11-bit
// index into kIQ1SGrid (qs[4j + l] the low 8), bits 12-14 the scale l_j (d * (2 l_j + 1)), bit 15
// the offset's sign.
template <>
struct Lattice<kTypeIQ1_S> {
  typedef BlockIQ1S Block;
  enum : int { kEntries = 2048, kWidth = 8 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ1SGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) { return b->d; }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const uint32_t h = b->qh[r >> 2];
    const uint32_t index = uint32_t(b->qs[r]) | (((h >> (3 * (r & 3))) & 7u) << 8);
    return offset_code(kIQ1SGrid[index], index, (h & 0x8000u) != 0, d * float(2 * int((h >> 12) & 7u) + 1));
  }
};

// IQ1_M: group r's nibble of qh[r / 2] (the low one for even r) holds the top 3 bits of its index
// into kIQ1SGrid and the offset's sign (bit 3); the scale of weights 16s .. 16s + 16 is
// d * (2 l_s + 1), l_s bits 3(s % 4) .. +2 of the little-endian uint16 at scales[2(s / 4)]; d's f16
// bits are the top nibbles of those four uint16, the first one lowest.
template <>
struct Lattice<kTypeIQ1_M> {
  typedef BlockIQ1M Block;
  enum : int { kEntries = 2048, kWidth = 8 };  // the codebook: entries of kWidth values
  static uint64_t grid(uint32_t i) { return kIQ1SGrid[i]; }
  template <typename B>
  static uint32_t d_bits(B b) {
    uint32_t bits = 0;
    for (int u = 0; u < 4; ++u) bits |= (uint32_t(b->scales[2 * u + 1]) >> 4) << (4 * u);
    return bits;
  }
  template <typename B>
  static Code8 code(B b, int r, float d) {
    const uint32_t nib = (uint32_t(b->qh[r >> 1]) >> (4 * (r & 1))) & 0xfu;
    const uint32_t index = uint32_t(b->qs[r]) | ((nib & 7u) << 8);
    const int s = r >> 1;
    const uint32_t word = uint32_t(b->scales[2 * (s >> 2)]) | (uint32_t(b->scales[2 * (s >> 2) + 1]) << 8);
    const uint32_t l = (word >> (3 * (s & 3))) & 7u;
    return offset_code(kIQ1SGrid[index], index, (nib & 8u) != 0, d * float(2 * int(l) + 1));
  }
};

}  // namespace gguf
}  // namespace torch_qmm
