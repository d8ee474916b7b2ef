// CPU affine_qmm kernels: the interface between the op (qmm.cpp) and the two kernel families.
//
//   fused (qmm_fused.cpp)  small M: each 32-code block of W is decoded in registers, dequantized
//                          (w = s*q + b) and multiplied into up to 4 rows of x at once;
//                          W is never written to memory.
//   chunked (qmm_chunked.cpp, chunk.h) any bits on AVX-512 up to chunked_max_rows: 64-byte
//                          (or 32-code) chunks, shuffle-free decode, bfloat16 dot products where the CPU has
//                          them; each W chunk decoded once per 4 rows of x.
//   gemm  (qmm_gemm.cpp)   large M: W is decoded in cache-sized float32 tiles by each thread,
//                          which multiplies its own tiles with a single-threaded BLAS GEMM
//                          (no barrier between decode and GEMM, bounded scratch).
//
// Shapes: x [M, K], W [N, K] (transpose) or [K, N] (!transpose), y [M, N]. Accumulation is
// float32. Lanes along the quantized axis are in codec order (decode.h): the op permutes x's
// columns for transpose=True; the kernels un-permute y's columns for transpose=False.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "../format_spec.h"

namespace torch_qmm {
namespace cpu {

struct QmmArgs {
  Mode mode = Mode::kAffine;  // the format (csrc/format_spec.h)
  const float* x;        // [M, K] float32, row stride K; codec-ordered columns when transpose (affine)
  const uint8_t* wq;     // packed rows (N rows of K codes, or K rows of N codes)
  const void* scales;    // [rows, cols / group_size] in `dtype`; uint8 codes for the fp modes
  const void* biases;    // as scales (affine); nullptr for the fp modes
  at::ScalarType dtype;  // of scales / biases (kByte for the fp modes)
  int64_t M, N, K;
  int bits, group_size;
  // How many bfloat16 terms a kernel that multiplies in bfloat16 may split each x into
  // (qmm_chunked.cpp): x_bf16_terms_for() below. 3 = float32 exactness required.
  int x_bf16_terms = 3;
  // Use only float32 arithmetic, as on CPUs without AVX512_BF16 (TORCH_QMM_CPU_NO_BF16=1,
  // so that tests reach those kernels on any machine).
  bool avoid_bf16 = false;
};

// 1 for bfloat16 x and 2 for float16 x (both exact); for float32 x, what
// torch.set_float32_matmul_precision allows, as for PyTorch's own float32 matmuls: "highest" 3
// (exact), "high" 2 (16 significant bits), "medium" 1 (8 bits).
int x_bf16_terms_for(at::ScalarType x_dtype);
// Whether the environment asks for float32-only kernels (QmmArgs::avoid_bf16).
bool avoid_bf16();
// Whether y[0 .. n) holds no Inf or NaN.
bool all_finite(const float* y, int64_t n);

// Rows of x from which the GEMM family is used (both transpose modes). Measured on a 2-core
// AVX-512 machine (benchmarks/): the fused kernels reach ~80% of the FMA peak for a few rows,
// but re-decode W for every 4 rows; past ~16 rows a BLAS GEMM on decoded tiles wins.
constexpr int64_t kGemmMinRows = 16;

// y [M, N] float32 row-major.
// Bits 2/3/4/5/6/8, small to medium M (qmm_chunked.cpp, AVX-512), x in natural order.
// qmm_t_chunked_tile names the chunk multiplier it would use ("bf16x3", "bf16x2", "bf16x1": x
// as that many bfloat16 terms; "f32": 4-bit, M = 1, without AVX512_BF16), or is null where it
// does not apply (M above chunked_max_rows, K below one chunk, no AVX-512, x out of range): then
// qmm_t_chunked must not be called.
const char* qmm_t_chunked_tile(const QmmArgs& a);
void qmm_t_chunked(const QmmArgs& a, float* y);

// Rows of x up to which the chunk kernels beat the fused / GEMM routes, by bits and bfloat16
// terms of x. Measured on 14336x5120 (2-core Zen 4; python -m torch_qmm bench, with and without
// TORCH_QMM_CPU_NO_BF16=1; benchmarks/README.md), chunked against fused/GEMM ms:
//   bits 2, 4: 3 terms (float32 x) up to M=32 (4-bit: 38 / 36 at 32, 74 / 62 at 64); 2
//     (float16) up to 128 (106 / 110; equal at 256); 1 (bfloat16) at every M measured (4-bit:
//     127 / 222 at 256).
//   bits 8 (4 planes per 64 codes: twice the work per code): 3 terms at M=1 only (3.2 / 3.4;
//     5.1 / 4.8 at 2); 2 up to M=2 (4.0 / 6.5; 7.5 / 6.7 at 4); 1 up to 32 (35 / 37; 69 / 61
//     at 64).
//   bits 3, 5, 6 (bit streams, 32-code chunks): 3 and 2 terms up to M=16 (3-bit float32 24.5 /
//     26.2, 5-bit 24.0 / 23.9; 47.8 / 36.7 at 32); 1 up to 32 (38 / 66, 38 / 44, 40 / 43), not
//     measured beyond. M=1: 2.6-3.8 against 4.0-5.5.
inline int64_t chunked_max_rows(int bits, int x_bf16_terms) {
  if (bits == 8) return x_bf16_terms >= 3 ? 1 : x_bf16_terms == 2 ? 2 : 32;
  if (bits == 3 || bits == 5 || bits == 6) return x_bf16_terms >= 2 ? 16 : 32;
  return x_bf16_terms >= 3 ? 32 : x_bf16_terms == 2 ? 128 : std::numeric_limits<int64_t>::max();
}

void qmm_t_fused(const QmmArgs& a, float* y);
void qmm_n_fused(const QmmArgs& a, float* y);

// Returns y [M, N] float32 (may be a transposed view). Every mode; for the fp modes x and y
// are in natural order (no codec order).
at::Tensor qmm_t_gemm(const QmmArgs& a);
at::Tensor qmm_n_gemm(const QmmArgs& a);

}  // namespace cpu
}  // namespace torch_qmm
