// Facts shared by the host planner (csrc/plan.cpp, C++17) and the Metal kernels (metal/*.h):
// buffer indices, the constant-argument struct, tile and thread-mapping constants. One fact,
// one place (the ggml-metal pattern): change a constant here and both sides follow.
//
// Compiled by two compilers. Metal sources define TORCH_QMM_METAL before including this file;
// host C++ does not. Constants are enumerators (identical meaning in C++ and MSL, no address
// space), helpers are constexpr functions.
//
// Shapes (STYLE.md): x [M, K], W [N, K] (transpose=True) or [K, N] (transpose=False), y [M, N].
#pragma once

#ifndef TORCH_QMM_METAL
#include <cstdint>
#endif

#ifndef TORCH_QMM_METAL
namespace torch_qmm {
#endif

// ---- Quantization modes: the values of Mode in csrc/format_spec.h (MLX's mode strings) ------
// Template argument of the kernels' format policy (metal/quant_format.h).
enum QuantMode : int { MODE_AFFINE = 0, MODE_MXFP4 = 1, MODE_NVFP4 = 2, MODE_MXFP8 = 3 };

// ---- Buffer indices (setBuffer / setBytes index), the same for every affine kernel ----------
//   qmm       : wq, scales, biases, x (in),  y (out)
//   dequantize: wq, scales, biases, out w (DENSE)
//   quantize  : wq, scales, biases (all out), w (DENSE, in)
//   gather_qmm: as qmm (W stacked per expert), + lhs, rhs (int32 [pairs]), order (int32 [pairs])
// The fp modes have no biases: BUF_BIASES is left unbound and never read.
enum AffineBuffer : int {
  BUF_WQ = 0,
  BUF_SCALES = 1,
  BUF_BIASES = 2,
  BUF_DENSE = 3,  // x (qmm), w (quantize input), w (dequantize output)
  BUF_Y = 4,      // y (qmm output)
  BUF_PARAMS = 5,  // AffineParams (GatherParams for gather_qmm) via setBytes
  BUF_LHS = 6,     // gather_qmm: x batch of each pair
  BUF_RHS = 7,     // gather_qmm: expert of each pair
  BUF_ORDER = 8    // gather_qmm: the pairs, those of one expert adjacent (metal/quant_gather.h)
};

// The small constant arguments of every quantized-mode kernel (setBytes at BUF_PARAMS).
// qmm: x [M, K], y [M, N]; W [N, K] or [K, N]. (De)quantize: W [N, K] quantized along K, M unused.
struct AffineParams {
  uint32_t M;
  uint32_t N;
  uint32_t K;
  uint32_t pad;  // keeps the struct 16 bytes on both sides
};

// gather_qmm (setBytes at BUF_PARAMS): x [x_batch * M, K], W [experts][N, K] or [experts][K, N],
// y [pairs * M, N]; pair i computes y rows i*M .. from x rows lhs[i]*M .. and expert rhs[i].
struct GatherParams {
  uint32_t M;      // rows of x per pair
  uint32_t N;
  uint32_t K;
  uint32_t pairs;
};

// ---- Geometry constants -------------------------------------------------------------------
enum AffineGeometry : int {
  SIMD_WIDTH = 32,

  // qmv (M = 1, transpose=True), after MLX qmv_fast: 2 SIMD-groups x 4 W rows = 8 outputs / TG.
  QMV_SIMDGROUPS = 2,
  QMV_ROWS_PER_SIMDGROUP = 4,
  QMV_ROWS_PER_TG = QMV_SIMDGROUPS * QMV_ROWS_PER_SIMDGROUP,

  // Small M (transpose=True): same 8 W rows per TG; each lane decodes 8 values of 4 rows per
  // K-block of 256 and reuses them for BM_ROWS in {2, 4, 8} rows of x.
  BM_SIMDGROUPS = 2,
  BM_ROWS_PER_SIMDGROUP = 4,
  BM_COLS_PER_TG = BM_SIMDGROUPS * BM_ROWS_PER_SIMDGROUP,  // outputs (y columns) per TG
  BM_VALUES_PER_THREAD = 8,
  BM_BLOCK_K = BM_VALUES_PER_THREAD * SIMD_WIDTH,

  // simdgroup-matrix tiles: BM in {16, 32} rows of x, BN = 32 columns of y, BK = 32.
  // Each SIMD-group owns a 16x16 sub-tile of y (2x2 fragments of 8x8).
  MMA_BN = 32,
  MMA_BK = 32,
  MMA_SUBTILE = 16,
  MMA_FRAG = 8,
  MMA_UNIT = 8,  // values of W dequantized (or of x copied) per thread per step

  // qvm (transpose=False, small M): each lane owns 8 consecutive y columns, the SIMD-groups of
  // a TG split K and reduce through threadgroup memory.
  QVM_SIMDGROUPS = 4,
  QVM_COLS_PER_LANE = 8,
  QVM_COLS_PER_TG = QVM_COLS_PER_LANE * SIMD_WIDTH,

  // Elementwise kernels: 8 values (= `bits` bytes, byte aligned) per thread.
  DEQ_VALUES_PER_THREAD = 8,
  DEQ_THREADS_PER_TG = 256,
  QUANT_THREADS_PER_TG = 64,  // one thread per group

  // gather_qmv (metal/quant_gather.h): the qmm_t_small threadgroup (8 W rows, 2 SIMD-groups)
  // over a run of one expert's rows, GATHER_ROWS rows of x at a time.
  GATHER_ROWS = 8,
  // gather_qmm_mma32 is taken when pairs * M >= this x experts, rhs sorted or not (MLX's
  // gather_qmm_rhs dispatch: B / E >= 4): fewer rows per expert leave its tile rows mostly idle.
  GATHER_MMA_MIN_ROWS_PER_EXPERT = 4
};

// Values of x each lane holds per K-block in qmv (16 for bits <= 5, else 8): one or two
// decode units; the K-block is 32 lanes x this. qmv_fast needs K % qmv_block_k(bits) == 0.
constexpr int qmv_values_per_thread(int bits) { return bits <= 5 ? 16 : 8; }
constexpr int qmv_block_k(int bits) { return qmv_values_per_thread(bits) * SIMD_WIDTH; }

// Threads of an MMA tile: one SIMD-group per 16x16 sub-tile (BM=32: 2x2 -> 128, BM=16: 1x2 -> 64).
constexpr int mma_threads(int bm) { return (bm / MMA_SUBTILE) * (MMA_BN / MMA_SUBTILE) * SIMD_WIDTH; }

// Row stride (elements) of the x tile in threadgroup memory: BK + 16 bytes of padding, so that
// consecutive rows start in different banks (MLX's BK_padded = BK + 16 / sizeof(T)):
// float -> 36, half/bfloat -> 40. The W tile is float32 (see metal/quant_mma.h): stride 36.
constexpr int mma_tile_ld(int elem_bytes) { return MMA_BK + 16 / elem_bytes; }

#ifndef TORCH_QMM_METAL
}  // namespace torch_qmm
#endif
