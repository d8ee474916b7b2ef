// Facts of the GGUF kernels shared by the host planner (csrc/plan.cpp) and the Metal kernels
// (metal/gguf_qmm.h): buffer indices, the constant-argument struct, the thread mapping. The
// block layouts themselves are in metal/gguf_format.h. Same conventions as metal/qmm_params.h
// (enumerators and constexpr functions; Metal sources define TORCH_QMM_METAL first).
//
// Shapes (STYLE.md): x [M, K], W [N, K] as GGUF blocks uint8 [N, K/256 * block bytes], y [M, N].
#pragma once

#include "gguf_format.h"
#include "qmm_params.h"

#ifndef TORCH_QMM_METAL
namespace torch_qmm {
#endif

// ---- Buffer indices (setBuffer / setBytes index) of every gguf kernel ------------------------
enum GGUFBuffer : int {
  GGUF_BUF_BLOCKS = 0,  // W as GGUF blocks (in)
  GGUF_BUF_X = 1,       // x (in)
  GGUF_BUF_Y = 2,       // y (out)
  GGUF_BUF_PARAMS = 3   // GGUFParams via setBytes
};

// The constant arguments of every gguf kernel (setBytes at GGUF_BUF_PARAMS).
struct GGUFParams {
  uint32_t M;
  uint32_t N;
  uint32_t K;
  uint32_t blocks_per_row;  // K / 256: super-blocks in one row of W
};

// ---- Geometry ------------------------------------------------------------------------------
// Every gguf kernel (qmv and the small-M bm2/4/8) uses one thread mapping: 2 SIMD-groups x 4 W
// rows = 8 columns of y per threadgroup; the lanes of a SIMD-group split into teams of
// 8 (Q4_K, Q5_K, the i-quants) or 16 (Q2_K, Q3_K, Q6_K) lanes, each team walking its own super-blocks
// (metal/gguf_qmm.h).
enum GGUFGeometry : int {
  GGUF_SIMDGROUPS = 2,
  GGUF_ROWS_PER_SIMDGROUP = 4,
  GGUF_COLS_PER_TG = GGUF_SIMDGROUPS * GGUF_ROWS_PER_SIMDGROUP  // columns of y (rows of W) per TG
};

#ifndef TORCH_QMM_METAL
}  // namespace torch_qmm
#endif
