// Instantiations only (kernel bodies: metal/gguf_qmm.h, metal/gguf_mma.h), nested ggml type -> dtype -> variant.
// Kernel names gguf_{qmv|qmm}_{type}[_bm{R}|_mma32]_{dtype}: GGUF_NAME in gguf_qmm.h, gguf_kernel_name()
// in csrc/plan.cpp; routes in csrc/plan.cpp's routing table.
#include "gguf_mma.h"
#include "gguf_qmm.h"

#define GGUF_INSTANTIATE_CELL(type_id, tname_type, T, tname)                                             \
  GGUF_INSTANTIATE(GGUF_NAME(gguf_qmv, tname_type, , tname), gguf_qmv, T, type_id)                        \
  GGUF_INSTANTIATE(GGUF_NAME(gguf_qmm, tname_type, _bm2, tname), gguf_qmm_small, T, type_id, 2)           \
  GGUF_INSTANTIATE(GGUF_NAME(gguf_qmm, tname_type, _bm4, tname), gguf_qmm_small, T, type_id, 4)           \
  GGUF_INSTANTIATE(GGUF_NAME(gguf_qmm, tname_type, _bm8, tname), gguf_qmm_small, T, type_id, 8)           \
  GGUF_INSTANTIATE(GGUF_NAME(gguf_qmm, tname_type, _mma32, tname), gguf_qmm_mma, T, type_id)

#define GGUF_INSTANTIATE_DTYPES(type_id, tname_type)          \
  GGUF_INSTANTIATE_CELL(type_id, tname_type, float, float)    \
  GGUF_INSTANTIATE_CELL(type_id, tname_type, half, float16_t) \
  GGUF_INSTANTIATE_CELL(type_id, tname_type, bfloat, bfloat16_t)

GGUF_INSTANTIATE_DTYPES(12, q4_K)  // torch_qmm::gguf::kTypeQ4_K
GGUF_INSTANTIATE_DTYPES(14, q6_K)  // torch_qmm::gguf::kTypeQ6_K
