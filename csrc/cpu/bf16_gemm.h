// Large-M qmm on bfloat16 matrix units (bf16_gemm.cpp): W decoded to bfloat16 tiles and
// multiplied by torch's GEMM (oneDNN: AMX or AVX512_BF16 kernels), taken only where the caller
// allows bfloat16 products (bfloat16 x, or float32 x under
// torch.set_float32_matmul_precision("medium")) and the CPU has such units.
#pragma once

#include <ATen/core/Tensor.h>

#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {

// Rows of x from which the route is taken (as the float32 GEMM route: kGemmMinRows). On the
// AVX-512 + AMX Xeon measured (benchmarks/README.md, "Routes on an AVX-512 Xeon"), 4096x4096 with
// bfloat16 x: 2.4 ms at M = 16 against the bf16x1 chunk kernel's 3.5 ms at M = 15.
constexpr int64_t kBf16GemmMinRows = kGemmMinRows;

// Whether the CPU has bfloat16 matrix units (AMX-BF16 or AVX512_BF16, as torch reports them).
bool bf16_matrix_units();
// Whether they include AMX-BF16 tiles, not only AVX512_BF16 vector instructions.
bool bf16_matrix_tiles();
// Whether qmm takes the route for `a` (transpose=True only): M >= kBf16GemmMinRows, x allowed in
// bfloat16 (QmmArgs::x_bf16_terms == 1), neither TORCH_QMM_CPU_NO_BF16 nor _NO_BF16_GEMM set, and
// TORCH_QMM_CPU_FORCE_BF16_GEMM=1 (tests reach the route on any CPU that way) or:
// - AMX-BF16 tiles: before the chunk kernels;
// - AVX512_BF16 vector instructions only (e.g. Zen 4): where no chunk kernel serves `a`
//   (`chunk_serves`). There torch's GEMM runs the same vdpbf16ps the bfloat16 chunk kernels do
//   and, with W decoded to memory first, loses to them and to the AVX2 fp-mode kernels wherever
//   those serve: 4096x14336, bfloat16 x, 2 threads, M = 16: affine 4-bit 7.1 ms against 19.3,
//   8-bit 13.6 against 21.0, mxfp4 21.1 against 52.9 (benchmarks/README.md, "The bfloat16 GEMM
//   route on Zen 4").
bool bf16_gemm_taken(const QmmArgs& a, bool transpose, bool chunk_serves);
// y [M, N] bfloat16 (float32 accumulation, rounded once) = bfloat16(x) @ bfloat16(W).T, W [N, K]
// (transpose=True) given by `a`, whose x is in the order the GEMM decoders expect (decode_tile.h:
// codec order for affine, natural for the fp modes), as for qmm_t_gemm.
at::Tensor qmm_t_bf16_gemm(const QmmArgs& a);

}  // namespace cpu
}  // namespace torch_qmm
