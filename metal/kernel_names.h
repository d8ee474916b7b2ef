// Kernel host names and explicit instantiation, for every library of metal/ (the one Metal
// spelling; the host's is plan::kernel_name in csrc/plan.cpp):
//
//   {prefix}_{kernel}_{dtype}_{cell}
//     prefix: the format family: affine, mxfp4, nvfp4, mxfp8 (the quantized modes), gguf
//     kernel: the routing-table row's kernel, e.g. qmv_fast, qmm_t_bm4, qmm_mma32
//     dtype : float, float16_t, bfloat16_t
//     cell  : gs_{G}_b_{B} (KERNEL_CELL) for the quantized modes, the GGUF type (q2_K, q3_K, q4_K, q5_K, q6_K, iq4_XS, iq2_XXS, iq2_XS, iq2_S, iq3_XXS, iq3_S, iq1_S, iq1_M)
//
//   e.g. affine_qmv_fast_float16_t_gs_64_b_4, mxfp4_qmm_t_mma32_bfloat16_t_gs_32_b_4,
//        gguf_qmm_bm8_float16_t_q6_K
#pragma once

#define KERNEL_STR_(x) #x
#define KERNEL_STR(x) KERNEL_STR_(x)
#define KERNEL_NAME_(prefix, kernel, tname, cell) KERNEL_STR(prefix##_##kernel##_##tname##_##cell)
// Two levels so that `cell` (e.g. KERNEL_CELL(64, 4)) is expanded before it is pasted.
#define KERNEL_NAME(prefix, kernel, tname, cell) KERNEL_NAME_(prefix, kernel, tname, cell)
#define KERNEL_CELL_(gs, bits) gs_##gs##_b_##bits
#define KERNEL_CELL(gs, bits) KERNEL_CELL_(gs, bits)

// Explicit instantiation of a templated [[kernel]] under its host name (the MLX pattern).
#define KERNEL_INSTANTIATE(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
