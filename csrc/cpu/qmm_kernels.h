// CPU qmm kernels: the interface between the op (qmm.cpp) and the three kernel families.
//
//   fused (qmm_fused.cpp)  affine, small M: each 32-code block of W is decoded in registers,
//                          dequantized (w = s*q + b) and multiplied into up to 4 rows of x at
//                          once; W is never written to memory.
//   chunked (chunk_driver.h; multipliers in chunk.h, chunk_avx2.h) small M: chunks of 64 or
//                          32 bytes decoded without shuffles of W, each decoded once per 4 rows
//                          of x: affine on AVX-512 (qmm_chunked.cpp; bfloat16 dot products where
//                          the CPU has them), affine 4-bit and the fp modes on AVX2
//                          (avx2_chunked.cpp).
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
  // Whether x passes chunk::x_in_range (chunk_driver.h), which the chunk kernels need; found once
  // per call with x (x_rows.h). False keeps a call off them.
  bool x_in_range = false;
};

// qmm's route (qmm.cpp, route_for: chunked, fused or GEMM by mode, M and transpose) for x
// float32 [M, K] in natural order, contiguous (a.x is set to xf's data); y [M, N] float32, possibly a
// transposed view. For callers that prepare their own operands (gather_qmm.cpp).
at::Tensor qmm_float(QmmArgs a, at::Tensor xf, bool transpose);

// 1 for bfloat16 x and 2 for float16 x (both exact); for float32 x, what
// torch.set_float32_matmul_precision allows, as for PyTorch's own float32 matmuls: "highest" 3
// (exact), "high" 2 (16 significant bits), "medium" 1 (8 bits).
int x_bf16_terms_for(at::ScalarType x_dtype);
// Whether the environment asks for float32-only kernels (QmmArgs::avoid_bf16).
bool avoid_bf16();
// Whether the AVX-512 float32-FMA multipliers go before the bfloat16 dot products (vdpbf16ps)
// for x they both take exactly (float32 x as 3 terms, bfloat16 x as 1): on Intel cores, where
// one vdpbf16ps costs more than the 32 / 16 FMAs' worth of work it replaces (an AVX-512 + AMX
// Xeon: 1.1-1.6x at M = 1-8; benchmarks/README.md, "Routes on an AVX-512 Xeon"); not on AMD
// (Zen 4 measured faster with the bfloat16 products). TORCH_QMM_CPU_FMA_FIRST=1 / 0 decides
// instead (tests reach both orders on any CPU).
bool float32_fma_first();
// Whether y[0 .. n) holds no Inf or NaN.
bool all_finite(const float* y, int64_t n);

// Rows of x from which the GEMM family is used (affine_qmm both transpose modes, and gguf_qmm):
// the fused kernels re-decode W for every 4 rows; past ~16 rows a BLAS GEMM on decoded tiles
// wins (benchmarks/README.md).
constexpr int64_t kGemmMinRows = 16;

// The chunk kernels (driver: chunk_driver.h), transpose=True, small M, x in natural order;
// y [M, N] float32 row-major. qmm_t_chunked_multiplier names the multiplier they would use, or
// is null where none applies (then qmm_t_chunked must not be called):
//   affine on AVX-512, bits 2/3/4/5/6/8 (qmm_chunked.cpp): "bf16x3", "bf16x2", "bf16x1" (x as
//     that many bfloat16 terms, up to chunked_max_rows rows), "f32" (float32 FMAs, bits 4 and
//     8 up to f32_affine_max_rows rows: first for float32 x, and for 16-bit x where
//     float32_fma_first(), which also keeps bits 4 and 8 from the bfloat16 ones at any M);
//     K of at least one chunk, x in range (chunk::x_in_range);
//   then, on AVX2 + FMA (avx2_chunked.cpp), K of at least one chunk of the multiplier
//     (chunk_avx2.h): "avx2-u3" / "avx2-u4" / "avx2-u5" / "avx2-u6" / "avx2-u8" (affine 3, 4, 5, 6,
//     8 bits, up to avx2_affine_max_rows rows, x in range), and
//     for the fp modes one multiplier per element encoding ("avx2-e2m1": mxfp4, nvfp4), up to
//     fp_chunked_max_rows rows.
const char* qmm_t_chunked_multiplier(const QmmArgs& a);
void qmm_t_chunked(const QmmArgs& a, float* y);

// Rows of x up to which the AVX2 chunk kernels serve a call (benchmarks/README.md).
constexpr int64_t avx2_affine_max_rows = kGemmMinRows - 1;
// Rows of x up to which the AVX-512 float32 affine multiplier serves a call: about where it stops
// beating the GEMM route on the Xeon measured (benchmarks/README.md, "Float32 kernels past 15
// rows"); 8-bit decodes twice the work per code.
constexpr int64_t f32_affine_max_rows(int bits) { return bits == 8 ? 16 : 24; }
constexpr int64_t fp_chunked_max_rows = 16;
// TORCH_QMM_CPU_NO_AVX2_CHUNKS=1: the AVX2 chunk kernels (affine, fp, GGUF) step aside (A/B
// against the fused / generic routes: python -m torch_qmm bench --peers no_avx2_chunks).
bool avx2_chunks_avoided();
// Whether the AVX2 GGUF kernels take code fields as the bits of subnormal floats (gguf_avx2.cpp,
// Fields<true>) for x in their range: TORCH_QMM_CPU_SUBNORMAL_FIELDS=1 or 0 says; unset, on AMD
// CPUs (Zen: measured on Zen 3 with no slowdown for subnormal operands), and not on others, where
// some take a microcode assist on them.
bool subnormal_fields_enabled();
// TORCH_QMM_CPU_NO_F32_CHUNKS=1: the AVX-512 float32 chunk kernels (affine, GGUF) step aside, so
// that the AVX2 ones serve as on CPUs without AVX-512.
bool f32_chunks_avoided();
const char* avx2_chunked_multiplier(const QmmArgs& a);
void avx2_chunked(const QmmArgs& a, float* y);

// Rows of x up to which the AVX-512 affine chunk kernels beat the fused / GEMM routes, by bits
// and bfloat16 terms of x (measured against TORCH_QMM_CPU_NO_BF16=1 on 14336x5120:
// benchmarks/README.md, "Where the chunk kernels stop"). Bits 8 decode 4 planes per 64 codes
// (twice the work per code of 4-bit), so they stop earlier.
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
