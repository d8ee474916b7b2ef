// Argument checks of gguf_qmm, shared by every backend and by its Meta kernel (csrc/meta.cpp);
// shapes are read as c10::SymInt, as in validate.h.
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_qmm {

// Checks x [..., K], blocks uint8 [N, K/256 * block_bytes(ggml_type)], ggml_type, N, K.
void check_gguf_qmm(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K);

// check_gguf_qmm, and ggml_type one of the types with int8-activation kernels (Q4_K, Q6_K).
void check_gguf_int8_activations(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                                 int64_t K);

}  // namespace torch_qmm
