// The format policies of the quantized-mode kernels: what a packed code means, the scale (and
// bias) of its group, and how a group is quantized. Every kernel body (quant_qmv.h,
// quant_qmm_small.h, quant_mma.h, quant_qvm.h, quant_quantize.h) is written once against
//
//   QuantFormat<mode, T, G, bits>        mode: QuantMode (qmm_params.h), T: x / w element type
//     enum G, BITS                       values per group, bits per code
//     enum HAS_BIAS                      1: w = s * q + b (affine); 0: w = s * q, biases unbound
//     enum X_PRESCALE                    2 / 4: qmv reads codes with a mask, x pre-scaled
//                                        (load_x_prescaled in quant_common.h); 0: decode8 first
//     scale_t                            element of the scales buffer: T, or uint8_t (a code)
//     decode8(p, q)                      the 8 values of one unit (`bits` bytes at p): integer codes
//                                        (affine) or element values (fp modes), as floats
//     scale(scales, g), bias(biases, g)  the group's scale / bias as float, exact
//     weight(s, q, b)                    one weight in float32 (qmm): fma(s, q, b) or s * q
//     dequantize(scales, biases, g, q)   the weights of the dequantize op, rounded as that op rounds
//     quantize_group(src, out, scales, biases, gi)   one group of G values of w -> codes and scale
//
// The fp modes (docs/formats.md; torch_qmm/reference_fp.py is the exact reference):
//   mxfp4  e2m1 codes, e8m0 scale per 32     nvfp4  e2m1 codes, e4m3 scale per 16
//   mxfp8  e4m3 codes, e8m0 scale per 32
// quantize_group follows MLX's CPU quantizer (mlx 0.32.4) step by step, bit for bit: arithmetic
// in T (each step computed in float32 and rounded to T, which for + - * / of T values gives the
// correctly rounded T result: float32 has more than 2p + 2 bits for half and bfloat), the e8m0
// exponent ceil(log2(amax / element_max)) without clamping, e2m1 ties to the first table entry.
#pragma once

#include <metal_stdlib>

#define TORCH_QMM_METAL 1
#include "qmm_params.h"

using namespace metal;

// ---- Integer codes (affine) --------------------------------------------------------------------

// Decodes the 8 codes of one unit (`bits` bytes at p) as floats (exact: codes < 256).
template <int bits>
inline void decode8(const device uint8_t* p, thread float* q) {
  if (bits == 8) {
    const device uint32_t* w = (const device uint32_t*)p;  // unit offset is 8*u bytes: aligned
    for (int h = 0; h < 2; ++h) {
      const uint32_t v = w[h];
      for (int i = 0; i < 4; ++i) q[4 * h + i] = float((v >> (8 * i)) & 0xffu);
    }
  } else if (bits == 4) {
    const uint32_t v = *(const device uint32_t*)p;  // 4-byte unit: aligned
    for (int i = 0; i < 8; ++i) q[i] = float((v >> (4 * i)) & 0xfu);
  } else if (bits == 2) {
    const uint32_t v = *(const device uint16_t*)p;  // 2-byte unit: aligned
    for (int i = 0; i < 8; ++i) q[i] = float((v >> (2 * i)) & 0x3u);
  } else {
    // 3/5/6 bits: two halves of 4 values (4*bits <= 24 bits); read only the unit's own bytes.
    for (int h = 0; h < 2; ++h) {
      const int bit0 = 4 * bits * h;
      const int first = bit0 / 8;
      const int last = (bit0 + 4 * bits - 1) / 8;
      uint32_t v = 0;
      for (int j = first; j <= last; ++j) v |= uint32_t(p[j]) << (8 * (j - first));
      v >>= (bit0 % 8);
      for (int i = 0; i < 4; ++i) q[4 * h + i] = float((v >> (bits * i)) & ((1u << bits) - 1u));
    }
  }
}

// ---- Small-float codecs (fp modes) -------------------------------------------------------------

// e2m1: sign | 2 exponent bits | 1 mantissa bit; code 8 is -0. Encoding picks the first entry
// of this order among the nearest (MLX's CPU rule: ties go to the smaller magnitude, -0 and
// small negatives to code 0).
constant float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// e4m3 ("fn"): sign | 4 exponent bits (bias 7) | 3 mantissa bits, subnormals m * 2^-9, no
// infinities, 0x7F / 0xFF NaN, largest finite 448.
inline float e4m3_value(uint c) {
  const uint e = (c >> 3) & 0xfu, m = c & 7u;
  float v = e == 0 ? float(m) * (1.0f / 512.0f) : as_type<float>(((e + 120u) << 23) | (m << 20));
  if ((c & 0x7fu) == 0x7fu) v = as_type<float>(0x7fc00000u);
  return (c & 0x80u) ? -v : v;
}

// Round to nearest even on 3 mantissa bits, subnormals on the 2^-9 grid; |x| >= 448 (and NaN)
// saturate to 0x7E with x's sign bit, so the NaN pattern is never produced.
inline uint e4m3_encode(float x) {
  const uint sign = (as_type<uint>(x) >> 31) << 7;
  const float a = fabs(x);
  if (!(a < 448.0f)) return sign | 0x7eu;
  if (a < 1.0f / 64.0f) return sign | uint(rint(a * 512.0f));  // 8 (the first normal) when it rounds up
  const uint bits = as_type<uint>(a);                          // a normal float32 here
  const int e = int(bits >> 23) - 127;
  const float frac = as_type<float>((bits & 0x7fffffu) | 0x3f800000u) - 1.0f;  // exact, in [0, 1)
  // A mantissa rounding up to 8 carries into the exponent: (e + 7) * 8 + 8 == (e + 8) * 8.
  return sign | uint((e + 7) * 8 + int(rint(frac * 8.0f)));
}

// e8m0: a biased exponent byte b meaning 2^(b - 127); b = 255 is 2^128 = +inf (as MLX decodes it).
inline float e8m0_value(uint b) { return b == 0 ? as_type<float>(0x00400000u) : as_type<float>(b << 23); }

// ceil(log2(s)) exactly for s > 0 (a power of two gives its own exponent), 0 for s == 0.
inline int ceil_log2(float s) {
  if (!(s > 0.0f)) return 0;
  int bias = 0;
  if (s < 1.1754944e-38f) {  // subnormal: scale into the normal range exactly
    s *= 18446744073709551616.0f;  // 2^64
    bias = 64;
  }
  const uint bits = as_type<uint>(s);
  const int e = int(bits >> 23) - 127;
  return ((bits & 0x7fffffu) ? e + 1 : e) - bias;
}

// The e2m1 code of q (a value of type D: distances |q - v| are rounded to D, the first nearest
// entry wins); non-finite q gives code 0.
template <typename D>
inline uint e2m1_encode(float q) {
  if (!isfinite(q)) return 0u;
  uint best = 0;
  float best_d = fabs(float(static_cast<D>(q - kE2M1Values[0])));
  for (uint c = 1; c < 16; ++c) {
    const float d = fabs(float(static_cast<D>(q - kE2M1Values[c])));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

enum FpElement : int { FP_E2M1 = 0, FP_E4M3 = 1 };
enum FpScale : int { FP_SCALE_E8M0 = 0, FP_SCALE_E4M3 = 1 };

// The fp-mode policy (see the top of this file), from the element and scale encodings.
template <int element, int scale_kind, typename T, int G_, int bits_>
struct FpFormat {
  static_assert((element == FP_E2M1 && bits_ == 4) || (element == FP_E4M3 && bits_ == 8),
                "e2m1 codes are 4 bits, e4m3 codes 8");
  enum : int { G = G_, BITS = bits_, HAS_BIAS = 0, X_PRESCALE = 0 };
  enum : int { ELEMENT_MAX = element == FP_E2M1 ? 6 : 448 };
  typedef uint8_t scale_t;

  static void decode8(const device uint8_t* p, thread float* q) {
    if (element == FP_E2M1) {
      const uint32_t v = *(const device uint32_t*)p;  // 4-byte unit: aligned
      for (int i = 0; i < 8; ++i) q[i] = kE2M1Values[(v >> (4 * i)) & 0xfu];
    } else {
      const device uint32_t* w = (const device uint32_t*)p;  // 8-byte unit: aligned
      for (int h = 0; h < 2; ++h) {
        const uint32_t v = w[h];
        for (int i = 0; i < 4; ++i) q[4 * h + i] = e4m3_value((v >> (8 * i)) & 0xffu);
      }
    }
  }
  static float scale(const device uint8_t* scales, uint g) {
    return scale_kind == FP_SCALE_E8M0 ? e8m0_value(scales[g]) : e4m3_value(scales[g]);
  }
  static float bias(const device T*, uint) { return 0.0f; }
  // Element values times a power of two or an e4m3 value: the float32 product is exact (at most
  // 4 + 4 significant bits), or +-inf / NaN from an e8m0 byte of 255 or a NaN code.
  static float weight(float s, float q, float) { return s * q; }
  // MLX's dequantize rounds an e8m0 scale to T first (float16: 2^-25 and below -> 0, 2^16 -> inf).
  static T dequantize(const device uint8_t* scales, const device T*, uint g, float q) {
    const float s = scale_kind == FP_SCALE_E8M0 ? float(static_cast<T>(e8m0_value(scales[g]))) : e4m3_value(scales[g]);
    return static_cast<T>(s * q);
  }

  // One group: amax, the scale code, then each element's code; codes packed 32 / bits per word.
  static void quantize_group(const device T* src, device uint32_t* out, device uint8_t* scales, device T*, uint gi) {
    float amax = 0.0f;
    for (int j = 0; j < G; ++j) amax = max(amax, fabs(float(src[j])));
    const float s = float(static_cast<T>(amax / float(ELEMENT_MAX)));
    float divisor;
    if (scale_kind == FP_SCALE_E8M0) {
      const int n = ceil_log2(s);
      scales[gi] = uint8_t(uint(n + 127) & 0xffu);
      divisor = ldexp(1.0f, n);
    } else {
      const uint code = e4m3_encode(s);  // s >= 0
      scales[gi] = uint8_t(code);
      divisor = e4m3_value(code);  // 0 for code 0: the quotients are +-inf / NaN -> code 0
    }
    constexpr int PER_WORD = 32 / bits_;
    for (int w = 0; w < G / PER_WORD; ++w) {
      uint32_t word = 0;
      for (int i = 0; i < PER_WORD; ++i) {
        const float q = float(static_cast<T>(float(src[w * PER_WORD + i]) / divisor));
        // nvfp4 measures e2m1 distances in float32, mxfp4 in T (MLX's CPU quantizer).
        const uint c = element == FP_E4M3 ? e4m3_encode(q)
                       : scale_kind == FP_SCALE_E4M3 ? e2m1_encode<float>(q)
                                                     : e2m1_encode<T>(q);
        word |= c << (bits_ * i);
      }
      out[w] = word;
    }
  }
};

// ---- The policies by mode ----------------------------------------------------------------------
template <int mode, typename T, int G, int bits>
struct QuantFormat;

template <typename T, int G_, int bits_>
struct QuantFormat<MODE_AFFINE, T, G_, bits_> {
  enum : int { G = G_, BITS = bits_, HAS_BIAS = 1, X_PRESCALE = (bits_ == 2 || bits_ == 4) ? bits_ : 0 };
  typedef T scale_t;

  static void decode8(const device uint8_t* p, thread float* q) { ::decode8<bits_>(p, q); }
  static float scale(const device T* scales, uint g) { return float(scales[g]); }
  static float bias(const device T* biases, uint g) { return float(biases[g]); }
  // fma: one rounding, the float32 value nearest s*q + b (the float64 reference rounded); the
  // CPU op's `s * q + b` compiles to the same fma with -march=native (GCC contracts by default).
  static float weight(float s, float q, float b) { return fma(s, q, b); }
  // The dequantize op rounds as mlx.core.dequantize: in T, the product first, then the sum,
  // T(T(s * q) + b) (the float32 sum of two T values rounds to T as T arithmetic would). The
  // product goes through a volatile so that no compiler fuses it with the sum (Metal compiles with
  // fast math by default, which allows contraction; metalsim's -ffp-contract=off forbids it).
  static T dequantize(const device T* scales, const device T* biases, uint g, float q) {
    volatile float product = float(static_cast<T>(float(scales[g]) * q));
    return static_cast<T>(product + float(biases[g]));
  }

  // MLX's algorithm step by step in float32 (see csrc/cpu/quantize.cpp):
  //   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|; the larger-
  //   magnitude extreme `edge` is kept exact: q0 = rint(edge / scale), if q0 != 0 then
  //   scale = edge / q0, bias = edge (else bias = 0); q = clamp(rint((w - bias) / scale), 0, 2^bits-1).
  // rint rounds half to even in Metal as in C. Non-finite weights, and groups whose range
  // max - min overflows float32, are refused by the host before the launch (a kernel cannot raise).
  static void quantize_group(const device T* src, device uint32_t* out, device T* scales, device T* biases, uint gi) {
    constexpr int bits = bits_;
    float w_max = -numeric_limits<float>::infinity();
    float w_min = numeric_limits<float>::infinity();
    for (int j = 0; j < G; ++j) {
      const float v = float(src[j]);
      w_max = max(w_max, v);
      w_min = min(w_min, v);
    }
    const float n_bins = float((1 << bits) - 1);
    const bool min_is_edge = abs(w_min) > abs(w_max);
    float scale = max((w_max - w_min) / n_bins, 1e-7f);
    scale = min_is_edge ? scale : -scale;
    const float edge = min_is_edge ? w_min : w_max;
    const float q0 = rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = edge / q0;
      bias = edge;
    }

    // Pack the group's codes into its own words, least-significant bits first.
    uint32_t cur = 0;
    int used = 0;
    int word = 0;
    for (int j = 0; j < G; ++j) {
      const uint32_t q = uint32_t(clamp(rint((float(src[j]) - bias) / scale), 0.0f, n_bins));
      cur |= q << used;
      used += bits;
      if (used >= 32) {
        out[word++] = cur;
        used -= 32;
        cur = used > 0 ? q >> (bits - used) : 0u;
      }
    }
    scales[gi] = static_cast<T>(scale);
    biases[gi] = static_cast<T>(bias);
  }
};

template <typename T, int G, int bits>
struct QuantFormat<MODE_MXFP4, T, G, bits> : FpFormat<FP_E2M1, FP_SCALE_E8M0, T, G, bits> {};
template <typename T, int G, int bits>
struct QuantFormat<MODE_NVFP4, T, G, bits> : FpFormat<FP_E2M1, FP_SCALE_E4M3, T, G, bits> {};
template <typename T, int G, int bits>
struct QuantFormat<MODE_MXFP8, T, G, bits> : FpFormat<FP_E4M3, FP_SCALE_E8M0, T, G, bits> {};
