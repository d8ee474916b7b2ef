// Every affine kernel family, and the macros that instantiate one (dtype, group size, bits)
// cell of all of them. metal/affine.metal lists the cells; nothing else instantiates kernels.
//
// Kernel names: {family}_{variant}_{dtype}_gs_{G}_b_{B}, dtype in {float, float16_t, bfloat16_t}.
// Must match the route table and kernel_name() in csrc/plan.cpp.
//
//   family          variant          header               used for
//   affine_qmv      fast, bounded    affine_qmv.h         M = 1, transpose=True
//   affine_qmm_t    bm2, bm4, bm8    affine_qmm_small.h   small M, transpose=True
//   affine_qmm_t    mma16, mma32     affine_mma.h         larger M, transpose=True
//   affine_qvm      bounded          affine_qvm.h         small M, transpose=False
//   affine_qmm_n    mma32            affine_mma.h         larger M, transpose=False
//   affine_dequantize rows           affine_quant.h       affine_dequantize
//   affine_quantize rows             affine_quant.h       affine_quantize
#pragma once

#include "affine_common.h"
#include "affine_mma.h"
#include "affine_qmm_small.h"
#include "affine_qmv.h"
#include "affine_quant.h"
#include "affine_qvm.h"

// A build may hold a single bit width (metalsim compiles one library per width to bound compile
// time: -DTORCH_QMM_ONLY_BITS=4). 0 = all widths (the MPS build).
#ifndef TORCH_QMM_ONLY_BITS
#define TORCH_QMM_ONLY_BITS 0
#endif
#define AFFINE_WANT_BITS(b) (TORCH_QMM_ONLY_BITS == 0 || TORCH_QMM_ONLY_BITS == (b))

#define AFFINE_INSTANTIATE_CELL(type, tname, gs, bits)                                                      \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmv, fast, tname, gs, bits), affine_qmv_fast, type, gs, bits)        \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmv, bounded, tname, gs, bits), affine_qmv_bounded, type, gs, bits)  \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmm_t, bm2, tname, gs, bits), affine_qmm_t_small, type, gs, bits, 2)  \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmm_t, bm4, tname, gs, bits), affine_qmm_t_small, type, gs, bits, 4)  \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmm_t, bm8, tname, gs, bits), affine_qmm_t_small, type, gs, bits, 8)  \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmm_t, mma16, tname, gs, bits), affine_qmm_mma, type, gs, bits, 16,   \
                     true)                                                                                   \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmm_t, mma32, tname, gs, bits), affine_qmm_mma, type, gs, bits, 32,   \
                     true)                                                                                   \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qvm, bounded, tname, gs, bits), affine_qvm_bounded, type, gs, bits)  \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_qmm_n, mma32, tname, gs, bits), affine_qmm_mma, type, gs, bits, 32,   \
                     false)                                                                                  \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_dequantize, rows, tname, gs, bits), affine_dequantize_rows, type, gs, \
                     bits)                                                                                   \
  AFFINE_INSTANTIATE(AFFINE_NAME(affine_quantize, rows, tname, gs, bits), affine_quantize_rows, type, gs, bits)

// dtype level of the nesting bits -> group size -> dtype.
#define AFFINE_INSTANTIATE_DTYPES(gs, bits)          \
  AFFINE_INSTANTIATE_CELL(float, float, gs, bits)    \
  AFFINE_INSTANTIATE_CELL(half, float16_t, gs, bits) \
  AFFINE_INSTANTIATE_CELL(bfloat, bfloat16_t, gs, bits)
