// Q4_K / Q6_K at small M: the chunk technique of chunk.h applied to GGUF super-blocks, with
// AVX-512 float32 FMAs (gguf_f32.cpp), AVX512-BF16 dot products (gguf_chunked.cpp) or AVX2 + FMA
// (gguf_avx2.cpp). gguf_qmm.cpp routes here.
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
  bool x_in_range = false;  // QmmArgs::x_in_range
  bool x_in_subnormal_range = false;  // XRows::in_subnormal_range
};

// The chunk multiplier that takes these operands, or null: "f32-q4k" / "f32-q6k" (AVX-512
// float32 FMAs, gguf_f32.cpp; "f32-panel-q4k" / "f32-panel-q6k" where the panel kernels take
// rows), "bf16x1/2/3" (AVX512_BF16 dot products, this file's .cpp: M up to the type's max_rows for
// the bfloat16 terms of x, not avoided; "bf16x1-panel-q4k" / "-q6k" where the bfloat16 panel
// kernels take rows) or "avx2-q4k" / "avx2-q6k" (AVX2 + FMA, gguf_avx2.cpp); Q4_K or Q6_K, x in
// range, the float32 kernels up to kGgufF32MaxRows rows (kGgufPanelMaxRows where the panel kernels
// take rows), the AVX2 ones up to kGgufAvx2MaxRows. Which goes first: gguf_chunked.cpp,
// gguf_chunked_multiplier.
const char* gguf_chunked_multiplier(const GgufArgs& a, int64_t ggml_type);
void gguf_chunked(const GgufArgs& a, int64_t ggml_type, float* y);

// Rows of x up to which the float32 GGUF chunk kernels serve a call: the AVX-512 ones beat the
// GEMM route to about 48 rows on the Xeon measured (Q6_K by 7% at 32; benchmarks/README.md,
// "Float32 kernels past 15 rows"); the AVX2 ones stop where the GEMM route starts.
constexpr int64_t kGgufF32MaxRows = 32;
// Rows of x one call of the panel kernels (gguf_panel.cpp) takes at most.
constexpr int64_t kGgufPanelMaxRows = 128;
constexpr int64_t kGgufAvx2MaxRows = 15;
// Each: its name where it serves (TORCH_QMM_CPU_NO_F32_CHUNKS / _NO_AVX2_CHUNKS unset), else null.
const char* gguf_f32_multiplier(const GgufArgs& a, int64_t ggml_type);
void gguf_f32(const GgufArgs& a, int64_t ggml_type, float* y);
const char* gguf_avx2_multiplier(const GgufArgs& a, int64_t ggml_type);
void gguf_avx2(const GgufArgs& a, int64_t ggml_type, float* y);
// The panel kernels (gguf_panel.cpp): Q4_K / Q6_K with float32 FMAs whose lanes are 16 rows of x,
// for 1 to kGgufPanelMaxRows rows. Inside the AVX-512 float32 family (gguf_f32.cpp, panel_rows) they
// take the whole groups of 16 rows of a call and a last group of 14-15, the chunk kernels the rest;
// the family is then named "f32-panel-q4k" / "f32-panel-q6k". Built with AVX-512 F/BW/VL;
// TORCH_QMM_CPU_NO_PANEL=1 steps them aside (the float32 chunk kernels then take every row).
bool gguf_panel_built();
bool gguf_panel_avoided();
void gguf_panel(const GgufArgs& a, int64_t ggml_type, float* y);
// The bfloat16 panel kernels (gguf_panel.cpp): Q4_K / Q6_K for bfloat16 x (one exact term) with
// AVX512_BF16 dot products, lanes again 16 rows of x, for 1 to kGgufPanelMaxRows rows; gguf_chunked
// gives them whole groups of 16 rows and a last group of 14-15 ahead of every other family
// ("bf16x1-panel-q4k" / "bf16x1-panel-q6k"), unless TORCH_QMM_CPU_NO_PANEL=1 or the bfloat16
// kernels are avoided.
bool gguf_panel_bf16_built();
void gguf_panel_bf16(const GgufArgs& a, int64_t ggml_type, float* y);
// Rows of a call of M rows the panel kernels take: whole groups of 16, and a last group from
// kGgufPanelMinGroupRows rows (a group costs them as much for 1 row as for 16; below 14 the chunk
// kernels cost less for those rows).
constexpr int64_t kGgufPanelMinGroupRows = 14;
inline int64_t gguf_panel_group_rows(int64_t M) {
  const int64_t last = M % 16;
  return M - last + (last >= kGgufPanelMinGroupRows ? last : 0);
}

}  // namespace cpu
}  // namespace torch_qmm
