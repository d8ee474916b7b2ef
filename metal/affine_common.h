// Shared device helpers of the affine kernels: kernel naming and arguments, decoding packed
// values, dots.
//
// Packed layout (MLX's affine format, csrc/format.h): each packed row of W is one little-endian
// bit stream; element k occupies bits [k*bits, (k+1)*bits). Eight consecutive values therefore
// take exactly `bits` bytes and start on a byte boundary when their first index is a multiple of
// 8 -- the decode unit used everywhere below:
//
//   bytes:  | b0 | b1 | ... | b(bits-1) |        bits = 3:  q0 q1 q2 | q2 q3 q4 q5 | q5 q6 q7
//   values:   q0 .. q7, q_i = bits [i*bits, (i+1)*bits) of the unit
//
// Group sizes (32, 64, 128) are multiples of 16, so a unit (and a 16-value qmv slice) never
// straddles a group: one scale and one bias per unit.
#pragma once

#include <metal_stdlib>

#define TORCH_QMM_METAL 1
#include "qmm_params.h"

using namespace metal;

// ---- Kernel names: {family}_{variant}_{dtype}_gs_{G}_b_{B} ---------------------------------
// Must match kernel_name() in csrc/plan.cpp (the one host spelling).
#define AFFINE_STR_(x) #x
#define AFFINE_STR(x) AFFINE_STR_(x)
#define AFFINE_NAME(family, variant, tname, gs, bits) AFFINE_STR(family##_##variant##_##tname##_gs_##gs##_b_##bits)

// Explicit instantiation of a templated [[kernel]] under its host name (the MLX pattern).
#define AFFINE_INSTANTIATE(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

// The arguments of every affine qmm [[kernel]] (templated on T), written once: the buffers at
// their AffineBuffer indices (qmm_params.h), then the thread positions the bodies take. A wrapper
// that needs more (the mma tile: thread_index_in_threadgroup) lists it after these.
#define AFFINE_QMM_ARGS                                                                              \
  const device uint8_t* wq [[buffer(BUF_WQ)]], const device T* scales [[buffer(BUF_SCALES)]],        \
      const device T* biases [[buffer(BUF_BIASES)]], const device T* x [[buffer(BUF_DENSE)]],        \
      device T* y [[buffer(BUF_Y)]], constant AffineParams& p [[buffer(BUF_PARAMS)]],                \
      uint3 tgid [[threadgroup_position_in_grid]], uint simd_gid [[simdgroup_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]]

// ---- Decoding --------------------------------------------------------------------------------

// Decodes the 8 values of one unit (`bits` bytes at p) as floats (exact: codes < 256).
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

// ---- qmv dot (after MLX load_vector / qdot) --------------------------------------------------
// x is loaded once per K-block into registers, pre-scaled for bits 2 and 4 so that a code is
// read with a mask and no shift: (w & 0x00f0) * (x / 16) == q * x exactly (powers of two).

// Loads n values of x as float into xt (pre-scaled for bits 2/4); returns their raw sum.
template <typename T, int bits, int n>
inline float load_x_prescaled(const device T* x, thread float* xt) {
  float sum = 0.0f;
  for (int i = 0; i < n; i += 4) {
    const float x0 = float(x[i]), x1 = float(x[i + 1]), x2 = float(x[i + 2]), x3 = float(x[i + 3]);
    sum += x0 + x1 + x2 + x3;
    if (bits == 4) {
      xt[i] = x0;
      xt[i + 1] = x1 / 16.0f;
      xt[i + 2] = x2 / 256.0f;
      xt[i + 3] = x3 / 4096.0f;
    } else if (bits == 2) {
      xt[i] = x0;
      xt[i + 1] = x1 / 4.0f;
      xt[i + 2] = x2 / 16.0f;
      xt[i + 3] = x3 / 64.0f;
    } else {
      xt[i] = x0;
      xt[i + 1] = x1;
      xt[i + 2] = x2;
      xt[i + 3] = x3;
    }
  }
  return sum;
}

// sum_i (s*q_i + b) * x_i over n values (n a multiple of 8), weight by weight: what the hoisted
// forms below fall back to where they are not finite. There (Inf/NaN in x, s or b, or an
// overflow) the hoisted value need not be the one IEEE arithmetic on the dequantized weights
// gives (F.linear's: +Inf in x against weights of both signs is NaN, an Inf bias against x of
// both signs too); done weight by weight it is. Finite results keep the hoisted form. (isfinite
// holds its meaning because the executor compiles with MTLMathModeSafe, as metalsim with
// -fno-fast-math.)
template <typename T, int bits, int n>
inline float qdot_by_weight(const device uint8_t* w, const device T* x, float s, float b) {
  float acc = 0.0f;
  float q[8];
  for (int u = 0; u < n / 8; ++u) {
    decode8<bits>(w + u * bits, q);
    for (int i = 0; i < 8; ++i) acc += fma(s, q[i], b) * float(x[8 * u + i]);
  }
  return acc;
}

// s * sum_i(q_i * x_i) + b * sum_i(x_i) over n values (n a multiple of 8): the bias hoist
// saves one multiply-add per weight. xt comes from load_x_prescaled<T, bits, n> of x; where the
// result is not finite, qdot_by_weight.
template <typename T, int bits, int n>
inline float qdot(const device uint8_t* w, const thread float* xt, const device T* x, float s, float b,
                  float xsum) {
  float acc = 0.0f;
  if (bits == 4) {
    const device uint16_t* ws = (const device uint16_t*)w;
    for (int i = 0; i < n / 4; ++i) {
      const uint32_t v = ws[i];
      acc += xt[4 * i] * float(v & 0x000fu) + xt[4 * i + 1] * float(v & 0x00f0u) +
             xt[4 * i + 2] * float(v & 0x0f00u) + xt[4 * i + 3] * float(v & 0xf000u);
    }
  } else if (bits == 2) {
    for (int i = 0; i < n / 4; ++i) {
      const uint32_t v = w[i];
      acc += xt[4 * i] * float(v & 0x03u) + xt[4 * i + 1] * float(v & 0x0cu) + xt[4 * i + 2] * float(v & 0x30u) +
             xt[4 * i + 3] * float(v & 0xc0u);
    }
  } else {
    float q[8];
    for (int u = 0; u < n / 8; ++u) {
      decode8<bits>(w + u * bits, q);
      for (int i = 0; i < 8; ++i) acc += q[i] * xt[8 * u + i];
    }
  }
  const float hoisted = s * acc + b * xsum;
  return isfinite(hoisted) ? hoisted : qdot_by_weight<T, bits, n>(w, x, s, b);
}

// sum_i q_i * x_i for 8 decoded values and 8 raw values of x.
inline float dot8(const thread float* q, const thread float* x) {
  float acc = 0.0f;
  for (int i = 0; i < 8; ++i) acc += q[i] * x[i];
  return acc;
}

// s * dot8(q, x) + b * xsum (xsum = the sum of the 8 x); where that is not finite, the 8
// weights one by one (see qdot_by_weight).
inline float affine_dot8(const thread float* q, const thread float* x, float s, float b, float xsum) {
  const float hoisted = s * dot8(q, x) + b * xsum;
  if (isfinite(hoisted)) return hoisted;
  float acc = 0.0f;
  for (int i = 0; i < 8; ++i) acc += fma(s, q[i], b) * x[i];
  return acc;
}
