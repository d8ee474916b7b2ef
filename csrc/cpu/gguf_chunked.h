// Q4_K / Q6_K at small M on AVX512-BF16 (gguf_chunked.cpp): the chunk technique of chunk.h
// applied to GGUF super-blocks. gguf_qmm.cpp routes here.
#pragma once

#include <cstdint>

namespace torch_qmm {
namespace cpu {

struct GgufArgs {
  const float* x;         // [M, K] float32, natural order
  const uint8_t* blocks;  // [N, K / 256 * block bytes] super-blocks
  int64_t M, N, K;
  int x_bf16_terms;       // QmmArgs::x_bf16_terms
  bool avoid_bf16;        // QmmArgs::avoid_bf16
};

// "bf16x1/2/3" when a chunk kernel takes these operands (Q4_K or Q6_K, M up to the type's
// max_rows for the bfloat16 terms of x, AVX512_BF16 built and not avoided, x in range), else null.
const char* gguf_chunked_multiplier(const GgufArgs& a, int64_t ggml_type);
void gguf_chunked(const GgufArgs& a, int64_t ggml_type, float* y);

}  // namespace cpu
}  // namespace torch_qmm
