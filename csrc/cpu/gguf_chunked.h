// Q4_K / Q6_K at small M: the chunk technique of chunk.h applied to GGUF super-blocks, on
// AVX512-BF16 (gguf_chunked.cpp) or AVX2 + FMA (gguf_avx2.cpp). gguf_qmm.cpp routes here.
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
// Then, on AVX2 + FMA (gguf_avx2.cpp), "avx2-q4k" / "avx2-q6k" up to kGgufAvx2MaxRows rows (x in
// range, TORCH_QMM_CPU_NO_AVX2_CHUNKS unset).
const char* gguf_chunked_multiplier(const GgufArgs& a, int64_t ggml_type);
void gguf_chunked(const GgufArgs& a, int64_t ggml_type, float* y);

// Rows of x up to which the AVX2 GGUF chunk kernels serve a call (below the GEMM route).
constexpr int64_t kGgufAvx2MaxRows = 15;
const char* gguf_avx2_multiplier(const GgufArgs& a, int64_t ggml_type);
void gguf_avx2(const GgufArgs& a, int64_t ggml_type, float* y);

}  // namespace cpu
}  // namespace torch_qmm
