"""A ninth independent audit list (python -m tests.mutation --fresh9): realistic single bugs written
from the product sources alone (torch_qmm/, csrc/; by someone who had not read the tests that
cover them), none of them a bug of an earlier list, concentrated on the code written or changed
since 50e19e7: the pure-torch Q4_K / Q6_K decode (torch_qmm/gguf_blocks.py), gguf_qmm's backward
(W decoded a slice of rows at a time), the forward-mode tangents quantized_matmul, gather_qmm,
gguf_matmul and the backward rules carry and the checks of tangents on frozen operands; in C++
(each in a .cpp file that rebuilds alone: no mutant in chunk_driver.h, chunk.h or gguf_x.h) the one
pass over x (x_rows.cpp: its finite / in-range flags and the 16-bit conversion), the flag's use in
qmm.cpp, gguf_qmm.cpp and gather_qmm.cpp (per group) and its consumers (avx2_chunked.cpp,
gguf_avx2.cpp), the AVX-512 GGUF kernels' prepared x (gguf_f32.cpp, gguf_chunked.cpp) and the
bfloat16 GEMM route's rule (qmm.cpp's route_for, bf16_gemm.cpp: AVX512_BF16 without AMX only where
no chunk kernel serves; TORCH_QMM_CPU_NO_BF16_GEMM).

Selections are two test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 9")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

GGUF_BLOCKS = _files("tests/test_gguf_qmm_backward.py", "tests/test_gguf_qmm.py")
GGUF_BACKWARD = _files("tests/test_gguf_qmm_backward.py", "tests/test_autograd_higher_order.py")
FORWARD = _files("tests/test_autograd_higher_order.py", "tests/test_qmm.py")
FORWARD_GATHER = _files("tests/test_autograd_higher_order.py", "tests/test_gather_qmm.py")
FORWARD_GGUF = _files("tests/test_autograd_higher_order.py", "tests/test_gguf_qmm_backward.py")
FORWARD_INT8 = _files("tests/test_autograd_higher_order.py", "tests/test_cpu_actq.py")
FORWARD_INT8_GGUF = _files("tests/test_autograd_higher_order.py", "tests/test_cpu_actq_gguf.py")
X_ROWS = _files("tests/test_cpu_x_rows.py", "tests/test_cpu_kernels.py")
X_ROWS_INT8 = _files("tests/test_cpu_x_rows.py", "tests/test_cpu_actq.py")
BF16_ROUTE = _files("tests/test_cpu_bf16_gemm.py", "tests/test_routes_cpu.py")
GGUF_RANGE = _files("tests/test_cpu_x_rows.py", "tests/test_cpu_gguf_chunked.py")
GATHER_RANGE = _files("tests/test_gather_qmm.py", "tests/test_cpu_x_rows.py")
AVX2_RANGE = _files("tests/test_cpu_avx2_exact.py", "tests/test_cpu_x_rows.py")
GGUF_AVX2 = _files("tests/test_cpu_gguf_chunked.py", "tests/test_cpu_x_rows.py")
GGUF_F32 = _files("tests/test_cpu_gguf_float32.py", "tests/test_cpu_gguf_chunked.py")
GGUF_BF16 = _files("tests/test_cpu_gguf_chunked.py", "tests/test_cpu_gguf_float32.py")

MUTANTS: list[Mutant] = [
    # ---- gguf_blocks.py: pure-torch Q4_K / Q6_K decode ------------------------------------------
    Mutant("b9-q4k-scale-high-bits-shift-4", "torch_qmm/gguf_blocks.py",
           "sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)",
           "sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 4) & 0x30)], dim=-1)", GGUF_BLOCKS,
           "the 6-bit scales of Q4_K sub-blocks 4-7 take bits 4-5 of bytes 0-3 as their top bits "
           "instead of bits 6-7: those sub-blocks' scales are wrong wherever a low scale byte is >= 16"),
    Mutant("b9-q4k-min-high-bits-from-scale-bytes", "torch_qmm/gguf_blocks.py",
           "mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)",
           "mn = torch.cat([hi & 0x3F, (mix >> 4) | ((lo >> 2) & 0x30)], dim=-1)", GGUF_BLOCKS,
           "the mins of Q4_K sub-blocks 4-7 take their top 2 bits from the scale bytes 0-3 "
           "(llama.cpp's q[j-4], the scales' source) instead of bytes 4-7"),
    Mutant("b9-q4k-nibbles-swapped", "torch_qmm/gguf_blocks.py",
           "q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, sb, 8, 32)",
           "q = torch.cat([qs >> 4, qs & 0x0F], dim=3).reshape(rows, sb, 8, 32)", GGUF_BLOCKS,
           "Q4_K sub-block 2c takes chunk c's high nibbles and 2c+1 its low ones"),
    Mutant("b9-q4k-offset-times-d", "torch_qmm/gguf_blocks.py",
           "offset = (dmin * mn.float()).unsqueeze(-1)",
           "offset = (d * mn.float()).unsqueeze(-1)", GGUF_BLOCKS,
           "the Q4_K mins are scaled by the super-block's d instead of dmin"),
    Mutant("b9-q6k-scales-unsigned", "torch_qmm/gguf_blocks.py",
           "sc = b[..., 192:208].view(torch.int8).float()  # [rows, sb, 16]",
           "sc = b[..., 192:208].float()  # [rows, sb, 16]", GGUF_BLOCKS,
           "the Q6_K sub-block scales are read as uint8: a negative scale s becomes 256 + s"),
    Mutant("b9-q6k-high-bit-pairs-1-2-swapped", "torch_qmm/gguf_blocks.py",
           "qh = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=3)",
           "qh = torch.cat([qh & 3, (qh >> 4) & 3, (qh >> 2) & 3, qh >> 6], dim=3)", GGUF_BLOCKS,
           "Q6_K's high 2 bits of chunks 1 and 2 (of each half) are taken from each other's bit pairs"),
    Mutant("b9-dequantize-rows-width-unchecked", "torch_qmm/gguf_blocks.py",
           "if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block_bytes != 0:",
           "if blocks.dtype != torch.uint8 or blocks.dim() != 2:", GGUF_BLOCKS,
           "a row width that is not a whole number of super-blocks is not refused with the "
           "ValueError naming the layout (the reshape fails with torch's RuntimeError instead)"),
    # ---- ops.py: gguf_qmm's backward --------------------------------------------------------------
    Mutant("g9-gguf-dx-last-partial-slice-dropped", "torch_qmm/ops.py",
           "    for n0 in range(0, N, step):",
           "    for n0 in range(0, N // step * step, step):", GGUF_BACKWARD,
           "gguf_qmm's dx sums whole slices of rows of W only: the last partial slice (all of W "
           "when N < the slice) adds nothing"),
    Mutant("g9-gguf-dx-accumulates-in-x-dtype", "torch_qmm/ops.py",
           "    dx = torch.zeros(lead.numel(), K, dtype=torch.float32, device=grad.device)",
           "    dx = torch.zeros(lead.numel(), K, dtype=grad.dtype, device=grad.device)", GGUF_BACKWARD,
           "gguf_qmm's dx accumulates in the gradient's dtype instead of float32 (bfloat16 / "
           "float16 x: the float32 slices' products do not go into it)"),
    # ---- ops.py: forward-mode tangents --------------------------------------------------------------
    Mutant("t9-dual-level-zero-read-as-none", "torch_qmm/ops.py",
           "    return _fwAD._current_level < 0",
           "    return _fwAD._current_level <= 0", FORWARD,
           "level 0 (the first dual level, the one forward_ad.dual_level and torch.func.jvp open "
           "outside any other) is read as no level: every tangent is dropped and no frozen "
           "operand's tangent is refused"),
    Mutant("t9-qmm-backward-tangent-of-primal-grad", "torch_qmm/ops.py",
           "grad_x = _carry_tangent(lambda t: _ops.qmm(t, wq, scales, biases, mode, bits, group_size, not transpose), grad)",
           "grad_x = _carry_tangent(lambda t: _ops.qmm(grad, wq, scales, biases, mode, bits, group_size, not transpose), grad)",
           FORWARD,
           "qmm's backward multiplies the primal gradient for the tangent too (a closure bug): "
           "forward-over-reverse (Hessian-vector products) gives the gradient's product, not the "
           "tangent's"),
    Mutant("t9-gather-forward-tangent-dropped", "torch_qmm/ops.py",
           "    return _carry_tangent(lambda t: _run(_ops.gather_qmm, t, w, scales, biases, lhs_indices, rhs_indices, mode, bits,\n"
           "                                         group_size, transpose, sorted_indices), x)",
           "    return _run(_ops.gather_qmm, x, w, scales, biases, lhs_indices, rhs_indices, mode, bits,\n"
           "                group_size, transpose, sorted_indices)", FORWARD_GATHER,
           "gather_qmm calls the op directly: a dual x's tangent is dropped (jvp zero, no error)"),
    Mutant("t9-gather-frozen-tangents-w-only", "torch_qmm/ops.py",
           "    _check_frozen_tangents(\"gather_qmm\", w=w, scales=scales, biases=biases)",
           "    _check_frozen_tangents(\"gather_qmm\", w=w)", FORWARD_GATHER,
           "gather_qmm checks only w for a tangent: a tangent on the float scales or biases is "
           "silently dropped instead of refused"),
    Mutant("t9-qmm-frozen-check-after-int8", "torch_qmm/ops.py",
           "    _check_frozen_tangents(\"qmm\", wq=wq, scales=scales, biases=biases)\n    if _affine_activations(",
           "    if _affine_activations(", FORWARD,
           "quantized_matmul no longer checks the frozen operands' tangents before the exact call "
           "(dropped with the move of the int8 branch): a tangent on scales / biases is dropped"),
    Mutant("t9-qmm-int8-tangent-not-refused", "torch_qmm/ops.py",
           "        if _has_tangent(x):\n            raise _int8_no_grad_error(op)\n",
           "", FORWARD_INT8,
           "quantized_matmul (and gather_qmm) with activations='int8' take a dual x and drop its tangent "
           "(a zero jvp) instead of raising as its gradient does"),
    Mutant("t9-gguf-int8-tangent-not-refused", "torch_qmm/ops.py",
           "        if _has_tangent(x):\n            raise _int8_no_grad_error(\"gguf_qmm_int8_activations\")\n",
           "", FORWARD_INT8_GGUF,
           "gguf_matmul with activations='int8' takes a dual x and drops its tangent"),
    Mutant("t9-gguf-forward-tangent-dropped", "torch_qmm/ops.py",
           "    return _carry_tangent(lambda t: _run(_ops.gguf_qmm, t, blocks, ggml_type, N, K), x)",
           "    return _run(_ops.gguf_qmm, x, blocks, ggml_type, N, K)", FORWARD_GGUF,
           "gguf_matmul calls the op directly: a dual x's tangent is dropped (jvp zero)"),
    # ---- C++ (each rebuilds the C++ scratch copy: --only-cpp), cheapest rebuilds first ----------
    Mutant("x9-flags-reduced-with-and", "csrc/cpu/x_rows.cpp",
           "[](int a, int b) { return a | b; });",
           "[](int a, int b) { return a & b; });",
           X_ROWS,
           "the per-thread flags are combined with & (from 0): past one work item (8192 values, 2+ "
           "threads) x is always reported finite and in range, so a tiny / huge value reaches the "
           "chunk kernels"),
    Mutant("x9-16bit-x-not-made-contiguous", "csrc/cpu/x_rows.cpp",
           "    xr = xr.contiguous();\n    r.xf = at::empty({M, K}, xr.options().dtype(at::kFloat));",
           "    r.xf = at::empty({M, K}, xr.options().dtype(at::kFloat));", X_ROWS,
           "16-bit x is read through its data pointer without being made contiguous: a transposed "
           "or strided bfloat16 / float16 x is converted in storage order, its rows scrambled"),
    Mutant("x9-in-range-is-the-finite-flag", "csrc/cpu/x_rows.cpp",
           "  r.in_range = !(flags & kOutOfRange);",
           "  r.in_range = !(flags & kNotFinite);", X_ROWS,
           "x's in-range flag is the finite one: finite x with a nonzero |x| below 2^-98 (or above "
           "2^100) reaches the chunk kernels, whose scaled x loses it"),
    Mutant("x9-inf-counted-finite", "csrc/cpu/x_rows.cpp",
           "inf_or_nan |= uint32_t((u & 0x7f800000u) == 0x7f800000u);",
           "inf_or_nan |= uint32_t((u & 0x7fffffffu) > 0x7f800000u);", X_ROWS_INT8,
           "the finite flag looks for NaN only: x with an Inf passes as finite, and the int8-"
           "activation ops quantize it instead of taking the exact path"),
    Mutant("r9-route-ignores-chunk-kernels", "csrc/cpu/qmm.cpp",
           "if (cpu::bf16_gemm_taken(a, transpose, chunked)) return Route::kBf16Gemm;",
           "if (cpu::bf16_gemm_taken(a, transpose, false)) return Route::kBf16Gemm;", BF16_ROUTE,
           "route_for tells bf16_gemm_taken that no chunk kernel serves: with AVX512_BF16 and no "
           "AMX the bfloat16 GEMM takes every call of M >= 16 with bfloat16 x, the chunk kernels' too"),
    Mutant("r9-gguf-in-range-flag-not-passed", "csrc/cpu/gguf_qmm.cpp",
           "  a.x_in_range = xr.in_range;\n",
           "", GGUF_RANGE,
           "gguf_qmm's kernel arguments never get x's in-range flag (GgufArgs::x_in_range stays "
           "false): no GGUF call takes a chunk kernel"),
    Mutant("r9-gather-range-of-first-row-per-pair", "csrc/cpu/gather_qmm.cpp",
           "gr.start * M * K, gr.count * M * K);",
           "gr.start * M * K, gr.count * K);", GATHER_RANGE,
           "each group's in-range flag looks at its first count rows of x, not count * M: with "
           "M > 1 a tiny value in a later row of a pair reaches the chunk kernels"),
    Mutant("r9-force-bf16-gemm-overrides-no-bf16-gemm", "csrc/cpu/bf16_gemm.cpp",
           "  if (!transpose || a.M < kBf16GemmMinRows || a.x_bf16_terms != 1 || a.avoid_bf16 ||\n"
           "      env_on(\"TORCH_QMM_CPU_NO_BF16_GEMM\"))\n    return false;\n"
           "  if (env_on(\"TORCH_QMM_CPU_FORCE_BF16_GEMM\")) return true;\n",
           "  if (env_on(\"TORCH_QMM_CPU_FORCE_BF16_GEMM\")) return true;\n"
           "  if (!transpose || a.M < kBf16GemmMinRows || a.x_bf16_terms != 1 || a.avoid_bf16 ||\n"
           "      env_on(\"TORCH_QMM_CPU_NO_BF16_GEMM\"))\n    return false;\n",
           BF16_ROUTE,
           "TORCH_QMM_CPU_FORCE_BF16_GEMM is read before the route's conditions: forced, the "
           "bfloat16 GEMM takes transpose=False, M < 16, float32 x and NO_BF16 / NO_BF16_GEMM calls"),
    Mutant("r9-avx2-range-checked-for-fp-modes", "csrc/cpu/avx2_chunked.cpp",
           "if (name != nullptr && a.mode == Mode::kAffine && !a.x_in_range) return nullptr;",
           "if (name != nullptr && a.mode != Mode::kAffine && !a.x_in_range) return nullptr;", AVX2_RANGE,
           "the AVX2 kernels check x's range for the fp modes instead of affine: affine x below "
           "2^-98 (scaled down to 2^-24 by the multiplier) reaches them"),
    Mutant("r9-gguf-avx2-range-unchecked", "csrc/cpu/gguf_avx2.cpp",
           "  if (!a.x_in_range) return nullptr;\n  for (const Avx2Names& n : kAvx2Names)",
           "  for (const Avx2Names& n : kAvx2Names)", GGUF_AVX2,
           "the AVX2 GGUF kernels no longer check x's range: x below 2^-98 (met as x * 2^-s) is "
           "flushed or rounded there"),
    Mutant("k9-f32-q6k-x-gather-stride-of-q4k", "csrc/cpu/gguf_f32.cpp",
           "        const float* base = x + 128 * h + 64 * p;",
           "        const float* base = x + 128 * h + 32 * p;", GGUF_F32,
           "the AVX-512 float32 Q6_K kernel gathers nibble p's 64 x values from 32 p on (Q4_K's "
           "stride) instead of 64 p: the high-nibble half meets the wrong x"),
    Mutant("k9-bf16-q4k-sums-of-q6k", "csrc/cpu/gguf_chunked.cpp",
           "    _mm512_storeu_ps(xs, gguf_x::q4k_sums(x));",
           "    _mm512_storeu_ps(xs, gguf_x::q6k_sums(x));", GGUF_BF16,
           "the bfloat16 Q4_K kernels' x sums are Q6_K's (32 times the sums of 16, in lanes 0-15): "
           "the hoisted mins meet the wrong sums"),
    Mutant("r9-bf16-gemm-where-chunks-serve", "csrc/cpu/bf16_gemm.cpp",
           "return bf16_matrix_units() && (bf16_matrix_tiles() || !chunk_serves);",
           "return bf16_matrix_units() && (bf16_matrix_tiles() || chunk_serves);", BF16_ROUTE,
           "the AVX512_BF16-only rule inverted: the bfloat16 GEMM takes the calls a chunk kernel "
           "serves and leaves the others to the float32 GEMM"),
]
