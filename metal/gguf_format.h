// GGUF K-quant blocks and IQ4_XS's, as llama.cpp writes them (its block_q2_K / q3_K / q4_K / q5_K /
// q6_K / iq4_xs structs):
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
// Decode order and bit placement follow llama.cpp's dequantize_row_q2_K / q3_K / q4_K / q5_K / q6_K /
// iq4_xs.
#pragma once

#ifndef TORCH_QMM_METAL
#include <cstdint>
#endif

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
  kTypeIQ4_NL = 20,
  kTypeIQ4_XS = 23,
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
    default: return 0;
  }
}

inline bool is_native_gguf_type(int64_t t) { return block_bytes(t) != 0; }

// For messages: the native types as "id (name)".
inline const char* native_gguf_types() {
  return "10 (Q2_K), 11 (Q3_K), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K), 23 (IQ4_XS)";
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

}  // namespace gguf
}  // namespace torch_qmm
