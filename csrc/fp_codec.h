// Scalar codecs of the fp formats' elements and scales (docs/formats.md), as MLX's CPU path
// rounds them; torch_qmm/reference_fp.py is the float64 statement of the same rules. Portable
// C++17 without torch.
//   e2m1  4 bits: sign | 2 exponent bits | 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}
//   e4m3  8 bits, the "fn" variant: bias 7, subnormals m * 2^-9, 0x7F / 0xFF NaN, max 448
//   e8m0  8 bits, scales only: b means 2^(b - 127) (255 decodes to 2^128 = inf in float32)
#pragma once

#include <cmath>
#include <cstdint>

#include "format_spec.h"

namespace torch_qmm {
namespace fp {

inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float e2m1_value(uint32_t code) { return kE2M1Values[code & 15u]; }

// The nearest table value to q, the distances |q - v| rounded by `round` (to the dtype MLX
// computes them in); ties go to the first table entry (the smaller magnitude, and +0 for small
// negative q); values beyond 6 saturate; NaN and +-inf give code 0.
template <typename Round>
uint32_t e2m1_encode(float q, Round round) {
  uint32_t best = 0;
  float best_d = std::fabs(round(q - kE2M1Values[0]));
  for (uint32_t c = 1; c < 16; ++c) {
    const float d = std::fabs(round(q - kE2M1Values[c]));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

inline float e4m3_value(uint32_t code) {
  const uint32_t e = (code >> 3) & 15u, m = code & 7u;
  float v = (code & 0x7Fu) == 0x7Fu ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), int(e) - 10);
  return (code & 0x80u) ? -v : v;
}

// Round to nearest even on 3 mantissa bits, subnormals on the 2^-9 grid; |x| >= 448, inf and NaN
// saturate to 0x7E (448) with x's sign bit, so the NaN codes are never produced.
inline uint32_t e4m3_encode(float x) {
  const float a = std::fabs(x);
  const uint32_t sign = std::signbit(x) ? 0x80u : 0u;
  if (!(a < 448.0f)) return sign | 0x7Eu;
  if (a < 0x1p-6f) return sign | uint32_t(std::nearbyint(a * 512.0f));  // may round up to 8: 2^-6
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // A mantissa rounding up to 8 carries into the exponent field.
  return sign | uint32_t((e + 6) * 8 + int(std::nearbyint((2.0f * m - 1.0f) * 8.0f)));
}

inline float e8m0_value(uint32_t code) { return std::ldexp(1.0f, int(code & 0xFFu) - 127); }

// n = ceil(log2(s)) exactly for s > 0 (an exact power of two gives its own exponent); 0 for s == 0.
inline int e8m0_exponent(float s) {
  if (!(s > 0.0f)) return 0;
  int e;
  const float m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? e - 1 : e;
}

// (n + 127) mod 256: MLX's CPU path does not clamp, so exponents below -127 wrap.
inline uint32_t e8m0_encode(int n) { return uint32_t(n + 127) & 0xFFu; }

// The value of a stored code of a format's element (not for Element::kUint).
inline float element_value(Element e, uint32_t code) {
  switch (e) {
    case Element::kE2M1: return e2m1_value(code);
    case Element::kE4M3: return e4m3_value(code);
    default: return NAN;
  }
}

// A quotient q (already rounded as MLX rounds it) to its element code; `round` rounds
// intermediate distances to the dtype MLX computes them in.
template <typename Round>
uint32_t element_encode(Element e, float q, Round round) {
  switch (e) {
    case Element::kE2M1: return e2m1_encode(q, round);
    case Element::kE4M3: return e4m3_encode(q);
    default: return 0;
  }
}

// The value of a stored scale code (not for ScaleKind::kFloat).
inline float scale_value(ScaleKind s, uint32_t code) {
  return s == ScaleKind::kE8M0 ? e8m0_value(code) : e4m3_value(code);
}

}  // namespace fp
}  // namespace torch_qmm
