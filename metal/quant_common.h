// Shared device helpers of the quantized-mode kernels (affine and the fp modes): kernel arguments,
// dots over decoded units. What a code means is the format policy's (metal/quant_format.h).
//
// Packed layout (csrc/format.h): each packed row of W is one little-endian bit stream; element k
// occupies bits [k*bits, (k+1)*bits). Eight consecutive values therefore take exactly `bits`
// bytes and start on a byte boundary when their first index is a multiple of 8 -- the decode
// unit used everywhere below:
//
//   bytes:  | b0 | b1 | ... | b(bits-1) |        bits = 3:  q0 q1 q2 | q2 q3 q4 q5 | q5 q6 q7
//   values:   q0 .. q7, q_i = bits [i*bits, (i+1)*bits) of the unit
//
// Group sizes (16, 32, 64, 128) are multiples of 16, so a unit (and a 16-value qmv slice) never
// straddles a group: one scale (and one bias) per unit.
#pragma once

#include <metal_stdlib>

#define TORCH_QMM_METAL 1
#include "kernel_names.h"
#include "qmm_params.h"
#include "quant_format.h"
#include "row_map.h"

using namespace metal;

// The arguments of every quantized-mode qmm [[kernel]] (templated on T and the format policy F),
// written once: the buffers at their AffineBuffer indices (qmm_params.h), then the thread
// positions the bodies take. `biases` is read only where F::HAS_BIAS (fp modes leave it
// unbound). A wrapper that needs more (the mma tile: thread_index_in_threadgroup) lists it after
// these.
#define QMM_ARGS                                                                                      \
  const device uint8_t* wq [[buffer(BUF_WQ)]], const device typename F::scale_t* scales [[buffer(BUF_SCALES)]], \
      const device T* biases [[buffer(BUF_BIASES)]], const device T* x [[buffer(BUF_DENSE)]],        \
      device T* y [[buffer(BUF_Y)]], constant AffineParams& p [[buffer(BUF_PARAMS)]],                \
      uint3 tgid [[threadgroup_position_in_grid]], uint simd_gid [[simdgroup_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]]

// ---- qmv dot (after MLX load_vector / qdot) --------------------------------------------------
// x is loaded once per K-block into registers, pre-scaled for integer codes of bits 2 and 4
// (F::X_PRESCALE) so that a code is read with a mask and no shift: (w & 0x00f0) * (x / 16) ==
// q * x exactly (powers of two).

// Loads n values of x as float into xt (pre-scaled for bits 2/4; else as they are); returns their
// raw sum.
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

// sum_i w_i * x_i over n values (n a multiple of 8), w_i = F::weight(s, q_i, b), weight by weight:
// what the hoisted forms below fall back to where they are not finite. There (Inf/NaN in x, s or
// b, or an overflow) the hoisted value need not be the one IEEE arithmetic on the dequantized
// weights gives (F.linear's: +Inf in x against weights of both signs is NaN, an Inf bias against
// x of both signs too); done weight by weight it is. Finite results keep the hoisted form.
// (isfinite holds its meaning because the executor compiles with MTLMathModeSafe, as metalsim
// with -fno-fast-math.)
template <typename F, typename T, int n>
inline float qdot_by_weight(const device uint8_t* w, const device T* x, float s, float b) {
  float acc = 0.0f;
  float q[8];
  for (int u = 0; u < n / 8; ++u) {
    F::decode8(w + u * F::BITS, q);
    for (int i = 0; i < 8; ++i) acc += F::weight(s, q[i], b) * float(x[8 * u + i]);
  }
  return acc;
}

// s * sum_i(q_i * x_i) (+ b * sum_i(x_i) where F::HAS_BIAS) over n values (n a multiple of 8): the
// hoist saves a multiply(-add) per weight. xt comes from load_x_prescaled<T, F::X_PRESCALE, n> of
// x; where the result is not finite, qdot_by_weight.
template <typename F, typename T, int n>
inline float qdot(const device uint8_t* w, const thread float* xt, const device T* x, float s, float b,
                  float xsum) {
  float acc = 0.0f;
  if (F::X_PRESCALE == 4) {
    const device uint16_t* ws = (const device uint16_t*)w;
    for (int i = 0; i < n / 4; ++i) {
      const uint32_t v = ws[i];
      acc += xt[4 * i] * float(v & 0x000fu) + xt[4 * i + 1] * float(v & 0x00f0u) +
             xt[4 * i + 2] * float(v & 0x0f00u) + xt[4 * i + 3] * float(v & 0xf000u);
    }
  } else if (F::X_PRESCALE == 2) {
    for (int i = 0; i < n / 4; ++i) {
      const uint32_t v = w[i];
      acc += xt[4 * i] * float(v & 0x03u) + xt[4 * i + 1] * float(v & 0x0cu) + xt[4 * i + 2] * float(v & 0x30u) +
             xt[4 * i + 3] * float(v & 0xc0u);
    }
  } else {
    float q[8];
    for (int u = 0; u < n / 8; ++u) {
      F::decode8(w + u * F::BITS, q);
      for (int i = 0; i < 8; ++i) acc += q[i] * xt[8 * u + i];
    }
  }
  const float hoisted = F::HAS_BIAS ? s * acc + b * xsum : s * acc;
  return isfinite(hoisted) ? hoisted : qdot_by_weight<F, T, n>(w, x, s, b);
}

// sum_i q_i * x_i for 8 decoded values and 8 raw values of x.
inline float dot8(const thread float* q, const thread float* x) {
  float acc = 0.0f;
  for (int i = 0; i < 8; ++i) acc += q[i] * x[i];
  return acc;
}

// s * dot8(q, x) (+ b * xsum where F::HAS_BIAS; xsum = the sum of the 8 x); where that is not
// finite, the 8 weights one by one (see qdot_by_weight).
template <typename F>
inline float group_dot8(const thread float* q, const thread float* x, float s, float b, float xsum) {
  const float hoisted = F::HAS_BIAS ? s * dot8(q, x) + b * xsum : s * dot8(q, x);
  if (isfinite(hoisted)) return hoisted;
  float acc = 0.0f;
  for (int i = 0; i < 8; ++i) acc += F::weight(s, q[i], b) * x[i];
  return acc;
}
