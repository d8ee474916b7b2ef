// Instantiations only (kernel bodies: metal/gguf_qmm.h, metal/gguf_mma.h), nested ggml type -> dtype -> variant.
// Kernel names gguf_{kernel}_{dtype}_{type} (metal/kernel_names.h; plan::kernel_name in
// csrc/plan.cpp); routes in csrc/plan.cpp's routing table.
#include "gguf_mma.h"
#include "gguf_qmm.h"

#define GGUF_INSTANTIATE_CELL(type_id, tname_type, T, tname)                                         \
  KERNEL_INSTANTIATE(KERNEL_NAME(gguf, qmv, tname, tname_type), gguf_qmv, T, type_id)                 \
  KERNEL_INSTANTIATE(KERNEL_NAME(gguf, qmm_bm2, tname, tname_type), gguf_qmm_small, T, type_id, 2)    \
  KERNEL_INSTANTIATE(KERNEL_NAME(gguf, qmm_bm4, tname, tname_type), gguf_qmm_small, T, type_id, 4)    \
  KERNEL_INSTANTIATE(KERNEL_NAME(gguf, qmm_bm8, tname, tname_type), gguf_qmm_small, T, type_id, 8)    \
  KERNEL_INSTANTIATE(KERNEL_NAME(gguf, qmm_mma32, tname, tname_type), gguf_qmm_mma, T, type_id)

#define GGUF_INSTANTIATE_DTYPES(type_id, tname_type)          \
  GGUF_INSTANTIATE_CELL(type_id, tname_type, float, float)    \
  GGUF_INSTANTIATE_CELL(type_id, tname_type, half, float16_t) \
  GGUF_INSTANTIATE_CELL(type_id, tname_type, bfloat, bfloat16_t)

GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeQ2_K, q2_K)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeQ3_K, q3_K)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeQ4_K, q4_K)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeQ5_K, q5_K)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeQ6_K, q6_K)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ4_XS, iq4_XS)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ2_XXS, iq2_XXS)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ2_XS, iq2_XS)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ2_S, iq2_S)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ3_XXS, iq3_XXS)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ3_S, iq3_S)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ1_S, iq1_S)
GGUF_INSTANTIATE_DTYPES(torch_qmm::gguf::kTypeIQ1_M, iq1_M)
