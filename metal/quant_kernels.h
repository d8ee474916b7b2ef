// Every quantized-mode kernel family, and the macros that instantiate one (mode, dtype, group
// size, bits) cell of all of them. metal/quant.metal lists the cells; nothing else instantiates
// kernels.
//
// Kernel names (metal/kernel_names.h): {mode}_{kernel}_{dtype}_gs_{G}_b_{B}, mode the name of a
// QuantMode (the cells of metal/quant.metal), dtype in {float, float16_t, bfloat16_t}. {kernel} is a routing-table row's kernel
// (csrc/plan.cpp), which plan::kernel_name spells the same way.
//
//   kernel          function       header               used for
//   qmv_fast        qmv_fast       quant_qmv.h         M = 1, transpose=True, aligned shapes
//   qmv_bounded     qmv_bounded    quant_qmv.h         M = 1, transpose=True
//   qmm_t_bm{2,4,8} qmm_t_small    quant_qmm_small.h   small M, transpose=True
//   qmm_t_mma{16,32} qmm_mma       quant_mma.h         larger M, transpose=True
//   qvm_bounded     qvm_bounded    quant_qvm.h         small M, transpose=False
//   qmm_n_mma32     qmm_mma        quant_mma.h         larger M, transpose=False
//   gather_qmv      gather_qmv     quant_gather.h      gather_qmm, transpose=True (decode)
//   gather_qmm_mma32 gather_qmm_mma quant_gather.h     gather_qmm, many rows per expert
//   gather_qmm_n_mma32 gather_qmm_mma quant_gather.h   gather_qmm, transpose=False
//   dequantize_rows dequantize_rows quant_quantize.h      dequantize
//   quantize_rows   quantize_rows  quant_quantize.h       quantize
//
// Each kernel is templated on T and the format policy F = QuantFormat<mode, T, G, bits>
// (metal/quant_format.h): one body per kernel, every mode.
#pragma once

#include "quant_common.h"
#include "quant_gather.h"
#include "quant_mma.h"
#include "quant_qmm_small.h"
#include "quant_qmv.h"
#include "quant_quantize.h"
#include "quant_qvm.h"

// A build may hold a single bit width (metalsim compiles one library per width to bound compile
// time: -DTORCH_QMM_ONLY_BITS=4). 0 = all widths (the MPS build).
#ifndef TORCH_QMM_ONLY_BITS
#define TORCH_QMM_ONLY_BITS 0
#endif
#define AFFINE_WANT_BITS(b) (TORCH_QMM_ONLY_BITS == 0 || TORCH_QMM_ONLY_BITS == (b))

// One cell: prefix (the mode's name), its QuantMode, the element type and its name, G, bits.
#define QUANT_INSTANTIATE_CELL(prefix, mode, type, tname, gs, bits)                                         \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmv_fast, tname, KERNEL_CELL(gs, bits)), qmv_fast, type,             \
                     QuantFormat<mode, type, gs, bits>)                                                      \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmv_bounded, tname, KERNEL_CELL(gs, bits)), qmv_bounded, type,       \
                     QuantFormat<mode, type, gs, bits>)                                                      \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmm_t_bm2, tname, KERNEL_CELL(gs, bits)), qmm_t_small, type,         \
                     QuantFormat<mode, type, gs, bits>, 2)                                                   \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmm_t_bm4, tname, KERNEL_CELL(gs, bits)), qmm_t_small, type,         \
                     QuantFormat<mode, type, gs, bits>, 4)                                                   \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmm_t_bm8, tname, KERNEL_CELL(gs, bits)), qmm_t_small, type,         \
                     QuantFormat<mode, type, gs, bits>, 8)                                                   \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmm_t_mma16, tname, KERNEL_CELL(gs, bits)), qmm_mma, type,           \
                     QuantFormat<mode, type, gs, bits>, 16, true)                                            \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmm_t_mma32, tname, KERNEL_CELL(gs, bits)), qmm_mma, type,           \
                     QuantFormat<mode, type, gs, bits>, 32, true)                                            \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qvm_bounded, tname, KERNEL_CELL(gs, bits)), qvm_bounded, type,       \
                     QuantFormat<mode, type, gs, bits>)                                                      \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, qmm_n_mma32, tname, KERNEL_CELL(gs, bits)), qmm_mma, type,           \
                     QuantFormat<mode, type, gs, bits>, 32, false)                                           \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, gather_qmv, tname, KERNEL_CELL(gs, bits)), gather_qmv, type,         \
                     QuantFormat<mode, type, gs, bits>)                                                      \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, gather_qmm_mma32, tname, KERNEL_CELL(gs, bits)), gather_qmm_mma,     \
                     type, QuantFormat<mode, type, gs, bits>, true)                                          \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, gather_qmm_n_mma32, tname, KERNEL_CELL(gs, bits)), gather_qmm_mma,   \
                     type, QuantFormat<mode, type, gs, bits>, false)                                         \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, dequantize_rows, tname, KERNEL_CELL(gs, bits)), dequantize_rows,     \
                     type, QuantFormat<mode, type, gs, bits>)                                                \
  KERNEL_INSTANTIATE(KERNEL_NAME(prefix, quantize_rows, tname, KERNEL_CELL(gs, bits)), quantize_rows, type,   \
                     QuantFormat<mode, type, gs, bits>)

// dtype level of the nesting mode -> bits -> group size -> dtype.
#define QUANT_INSTANTIATE_DTYPES(prefix, mode, gs, bits)          \
  QUANT_INSTANTIATE_CELL(prefix, mode, float, float, gs, bits)    \
  QUANT_INSTANTIATE_CELL(prefix, mode, half, float16_t, gs, bits) \
  QUANT_INSTANTIATE_CELL(prefix, mode, bfloat, bfloat16_t, gs, bits)
#define AFFINE_INSTANTIATE_DTYPES(gs, bits) QUANT_INSTANTIATE_DTYPES(affine, MODE_AFFINE, gs, bits)
