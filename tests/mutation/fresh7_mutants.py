"""A seventh independent audit list (python -m tests.mutation --fresh7): realistic single bugs
written from the product sources alone (csrc/, metal/, torch_qmm/), by someone who had not read
the tests, none of them a bug of an earlier list: on the device, the mxfp8 element maximum, the
affine quantizer's edge test, word flush, rounding and scale index, the dequantize product, the
qmv SIMD-group rows, the qvm x stride and reduction slots, the mma fragment rows, stored rows and
transpose=False loader, the gather_qmv run start, the Q4_K slice's x offsets and the small-M GGUF
x stride; the planner's gather parameters and qmv threads; the GGUF x dtype, the index device,
the qmm fake's shape and the nvfp4 element maximum; the CPU fp quantizer's finiteness test, the
dequantize sum, the gather copy stride and the 4-bit decoder; the activation setting on other
devices and across threads, QuantLinear's sizes, the MoE bias shape, two tensor-parallel splits;
and the mxfp4, mlx / mlx_lm, GGUF, llama, transformers, CLI and mse interop and quantizer code.

Selections are two or three test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 7")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

METAL_FP = _files("tests/test_metal_fp.py", "tests/test_metal_edges.py")
METAL_QUANT = _files("tests/test_metal_ops.py", "tests/test_metal_edges.py")
METAL_QMV = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_MMA = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_GATHER = _files("tests/test_metal_gather.py", "tests/test_fresh4_metal_gather.py")
METAL_GGUF = _files("tests/test_metal_gguf.py", "tests/test_routes_metal.py")
PLAN_GATHER = _files("tests/test_metal_gather.py", "tests/test_metal_plan.py")
PLAN_QMV = _files("tests/test_routes_metal.py", "tests/test_metal_plan.py")
GGUF_CHECKS = _files("tests/test_gguf_qmm.py", "tests/test_errors.py", "tests/test_hardening_ops.py")
GATHER_CHECKS = _files("tests/test_gather_qmm.py", "tests/test_errors.py")
FAKES = _files("tests/test_fakes.py", "tests/test_compile.py")
SPEC = _files("tests/test_fp_modes.py", "tests/test_spec_ops.py")
CPU_FP_QUANT = _files("tests/test_hardening_ops.py", "tests/test_fp_modes.py", "tests/test_quantize.py")
DEQUANTIZE = _files("tests/test_quantize.py", "tests/test_format_arguments.py")
CPU_GATHER = _files("tests/test_gather_qmm.py", "tests/test_nn_moe.py")
CPU = _files("tests/test_routes_cpu.py", "tests/test_cpu_kernels.py", "tests/test_qmm.py")
ACTIVATIONS_DEVICE = _files("tests/test_cpu_actq.py", "tests/test_hardening_ops.py")
ACTIVATIONS = _files("tests/test_cpu_actq.py", "tests/test_qmm.py")
NN_ARGS = _files("tests/test_nn.py", "tests/test_errors.py")
MOE = _files("tests/test_nn_moe.py", "tests/test_moe_models.py")
DISTRIBUTED = _files("tests/test_distributed.py", "tests/test_distributed_moe.py")
DISTRIBUTED_MOE = _files("tests/test_distributed_moe.py", "tests/test_distributed.py")
MXFP4 = _files("tests/test_moe_gpt_oss_mxfp4.py", "tests/test_hostile_files.py")
MLX_LM_MOE = _files("tests/test_moe_mlx_lm.py", "tests/test_interop_mlx_lm.py")
MLX_MOE = _files("tests/test_moe_mlx_lm.py", "tests/test_interop_mlx.py")
GGUF_INTEROP = _files("tests/test_interop_gguf.py", "tests/test_hostile_files.py")
GGUF_HOSTILE = _files("tests/test_hostile_files.py", "tests/test_interop_gguf.py")
LLAMA = _files("tests/test_interop_gguf_llama.py", "tests/test_cli_convert.py")
TRANSFORMERS = _files("tests/test_interop_transformers.py", "tests/test_quantizers_methods.py")
CLI = _files("tests/test_cli_convert.py", "tests/test_interop_cli.py")
QUANTIZERS = _files("tests/test_quantizers.py", "tests/test_quantizers_methods.py")

MUTANTS: list[Mutant] = [
    # ---- Metal kernels (no rebuild) -------------------------------------------------------------
    Mutant("m7-mxfp8-element-max-fnuz-240", "metal/quant_format.h",
           "enum : int { ELEMENT_MAX = element == FP_E2M1 ? 6 : 448 };",
           "enum : int { ELEMENT_MAX = element == FP_E2M1 ? 6 : 240 };", METAL_FP,
           "the device mxfp8 quantizer divides amax by e4m3fnuz's largest value (240) instead of e4m3fn's "
           "448: the e8m0 scale comes out one exponent too high for most groups"),
    Mutant("m7-affine-quantize-q0-positive-only", "metal/quant_format.h",
           "    if (q0 != 0.0f) {\n      scale = edge / q0;",
           "    if (q0 > 0.0f) {\n      scale = edge / q0;", METAL_QUANT,
           "device affine quantize: the edge's code q0 is never positive (scale and edge have opposite "
           "signs), so the exact-edge step is skipped: bias 0 and the unadjusted scale for every group"),
    Mutant("m7-affine-quantize-word-flush-past-32", "metal/quant_format.h",
           "      if (used >= 32) {\n        out[word++] = cur;",
           "      if (used > 32) {\n        out[word++] = cur;", METAL_QUANT,
           "device affine quantize: a word filled exactly (bits 2, 4, 8; and 3/5/6 where a code ends on "
           "the boundary) is not flushed: the next code is shifted by 32 and the words shift"),
    Mutant("m7-affine-quantize-round-half-away", "metal/quant_format.h",
           "const uint32_t q = uint32_t(clamp(rint((float(src[j]) - bias) / scale), 0.0f, n_bins));",
           "const uint32_t q = uint32_t(clamp(round((float(src[j]) - bias) / scale), 0.0f, n_bins));",
           METAL_QUANT,
           "device affine quantize rounds codes half away from zero (Metal's round) instead of half to "
           "even (MLX's rint): differs only on exact ties (suspected nearly equivalent on random weights)"),
    Mutant("m7-quantize-scales-at-row-local-group", "metal/quant_quantize.h",
           "wq + row * (K * bits / 32) + g * (G * bits / 32), scales, biases, gi);",
           "wq + row * (K * bits / 32) + g * (G * bits / 32), scales, biases, g);", METAL_QUANT,
           "device quantize writes each group's scale (and bias) at its index within the row: every row "
           "past the first overwrites row 0's scales and leaves its own unset"),
    Mutant("m7-dequantize-product-unrounded", "metal/quant_format.h",
           "volatile float product = float(static_cast<T>(float(scales[g]) * q));",
           "volatile float product = float(scales[g]) * q;", METAL_QUANT,
           "device affine dequantize sums s * q + b without rounding the product to T first (MLX rounds "
           "it): an ulp off for float16 / bfloat16 (the CPU twin of this bug is c5's; this is the kernel)"),
    Mutant("m7-qmv-simdgroup-rows-stride-of-tg", "metal/quant_qmv.h",
           "const uint row0 = tg * QMV_ROWS_PER_TG + simd_gid * QMV_ROWS_PER_SIMDGROUP;",
           "const uint row0 = tg * QMV_ROWS_PER_TG + simd_gid * QMV_ROWS_PER_TG;", METAL_QMV,
           "qmv: SIMD-group 1 starts 8 rows in instead of 4: rows 8t+4..8t+7 are never computed and it "
           "writes the next threadgroup's rows (past y at the end)"),
    Mutant("m7-qvm-x-row-stride-n", "metal/quant_qvm.h",
           "      const float xk = float(x[m * K + k]);\n      F::decode8(wq + k * row_bytes + n * bits / 8, q);\n"
           "      const float xs",
           "      const float xk = float(x[m * N + k]);\n      F::decode8(wq + k * row_bytes + n * bits / 8, q);\n"
           "      const float xs", METAL_QMV,
           "qvm (transpose=False, M <= 3): rows of x past the first are read at a stride of N instead of K "
           "(right only when N == K) in the hoisted loop"),
    Mutant("m7-qvm-reduction-reads-slot-s", "metal/quant_qvm.h",
           "for (int s = 1; s < QVM_SIMDGROUPS; ++s) v += red[((s - 1) * SIMD_WIDTH + lane) * C + i];",
           "for (int s = 1; s < QVM_SIMDGROUPS; ++s) v += red[(s * SIMD_WIDTH + lane) * C + i];", METAL_QMV,
           "qvm's reduction reads SIMD-group s's partial sums from slot s instead of s - 1: group 1's part is "
           "lost and the last read is past the threadgroup buffer"),
    Mutant("m7-mma-frag-row-from-lane-mod-4", "metal/mma_tile.h",
           "return FragCoord{(qid & 4) + ((lane / 2) % 4), (qid & 2) * 2 + (lane % 2) * 2};",
           "return FragCoord{(qid & 4) + (lane % 4), (qid & 2) * 2 + (lane % 2) * 2};", METAL_MMA,
           "the 8x8 fragment's row of a lane is taken from lane % 4 instead of (lane / 2) % 4: x, W and y "
           "elements land in the wrong places of every mma route"),
    Mutant("m7-mma-store-rows-not-live", "metal/mma_tile.h",
           "    if (!rows.live(tm)) continue;\n    const uint gm = rows.y_row(tm);",
           "    const uint gm = rows.y_row(tm);", METAL_MMA,
           "the mma tile stores its rows past M (zeros) into y: out of bounds for the last tile of dense "
           "routes, and for gather the rows of other experts' runs are overwritten"),
    Mutant("m7-mma-loader-rows-n-for-transpose-false", "metal/quant_mma.h",
           "const QuantWLoader<T, F, transpose> wl{wq, scales, biases, transpose ? p.N : p.K, qlen * F::BITS / 8, "
           "qlen / F::G};",
           "const QuantWLoader<T, F, transpose> wl{wq, scales, biases, p.N, qlen * F::BITS / 8, qlen / F::G};",
           METAL_MMA,
           "qmm_n_mma32 (transpose=False) bounds W's packed rows by N instead of K: rows of W past N are "
           "zeroed when K > N, and rows past K are read (clamped to row N-1) when N > K"),
    Mutant("m7-gather-qmv-run-start-ignores-order", "metal/quant_gather.h",
           "if (i > 0 && expert_at(rhs, order, i - 1) == e) return;",
           "if (i > 0 && uint(rhs[i - 1]) == e) return;", METAL_GATHER,
           "gather_qmv decides whether a pair starts its run from rhs in pair order, not in the sorted order: "
           "with unsorted rhs some runs are computed by nobody (and others twice)"),
    Mutant("m7-q4k-slice-x-offset-chunk-step", "metal/gguf_qmm.h",
           "return 64 * (iq + 2 * (j / 2)) + 32 * (j % 2) + 8 * ir;",
           "return 64 * (iq + (j / 2)) + 32 * (j % 2) + 8 * ir;", METAL_GGUF,
           "qmv / bm Q4_K: runs 2 and 3 of a lane read x of chunk iq + 1 while their weights are those of "
           "chunk iq + 2"),
    Mutant("m7-gguf-small-x-row-stride-n", "metal/gguf_qmm.h",
           "const device T* xr = xb + m * K;", "const device T* xr = xb + m * N;", METAL_GGUF,
           "gguf bm2/4/8: rows of x past the first of a block are read at a stride of N instead of K"),
    # ---- Planner (C++: rebuild) -------------------------------------------------------------------
    Mutant("p7-plan-gather-params-experts-as-pairs", "csrc/plan.cpp",
           "l.params = param_words(GatherParams{u32(p.M), u32(p.N), u32(p.K), u32(p.pairs)});",
           "l.params = param_words(GatherParams{u32(p.M), u32(p.N), u32(p.K), u32(p.experts)});", PLAN_GATHER,
           "gather_qmm's kernel parameters carry the number of experts where the number of pairs belongs: "
           "runs and tiles end at the wrong pair (rows lost when pairs > experts)"),
    Mutant("p7-plan-qmv-one-simdgroup", "csrc/plan.cpp",
           "constexpr Geometry kQmv = Geometry::tiled(1, QMV_ROWS_PER_TG, QMV_SIMDGROUPS * SIMD_WIDTH);",
           "constexpr Geometry kQmv = Geometry::tiled(1, QMV_ROWS_PER_TG, SIMD_WIDTH);", PLAN_QMV,
           "qmv_fast / qmv_bounded launch one SIMD-group per threadgroup: rows 8t+4..8t+7 are never computed"),
    # ---- Validation, format table, fakes (C++: rebuild) -------------------------------------------
    Mutant("v7-gguf-x-dtype-unchecked", "csrc/gguf_validate.cpp",
           '  check_float_dtype(op, "x", x);\n  TORCH_CHECK_VALUE(x.dim() >= 1 && x.sym_size(-1) == K',
           "  TORCH_CHECK_VALUE(x.dim() >= 1 && x.sym_size(-1) == K", GGUF_CHECKS,
           "gguf_qmm accepts x of any dtype (float64, integers): a dispatch error or a wrong kernel later "
           "instead of the TypeError naming 'x'"),
    Mutant("v7-gather-index-device-unchecked", "csrc/validate.cpp",
           "  TORCH_CHECK_VALUE(idx->device() == x.device(), op, \": argument '\", arg, \"' is on \", idx->device(),\n"
           "                    \" but 'x' is on \", x.device());\n",
           "", GATHER_CHECKS,
           "gather_qmm indices on another device than x pass the check (read on the wrong device, or a "
           "RuntimeError later instead of the ValueError naming the index)"),
    Mutant("v7-meta-qmm-last-dim-k", "csrc/meta.cpp",
           "  (void)K;\n  return at::empty_symint(with_last(x, N), x.options());",
           "  (void)N;\n  return at::empty_symint(with_last(x, K), x.options());", FAKES,
           "the fake qmm gives [..., K] instead of [..., N] (right only for square W)"),
    Mutant("v7-format-nvfp4-element-max-448", "csrc/format_spec.cpp",
           "{{16}, 1},          4,  16, 6.0f},", "{{16}, 1},          4,  16, 448.0f},", SPEC,
           "the nvfp4 row of the format table gives e4m3's maximum (its scale type's) as the element "
           "maximum: CPU nvfp4 scales come out 2^6 too small and the codes saturate"),
    # ---- CPU kernels (C++: rebuild) ----------------------------------------------------------------
    Mutant("c7-quantize-fp-non-finite-unchecked", "csrc/cpu/quantize.cpp",
           "        const float v = float(src[j]);\n        if (!std::isfinite(v)) non_finite.store(true, "
           "std::memory_order_relaxed);\n        amax = std::max(amax, std::fabs(v));",
           "        const float v = float(src[j]);\n        amax = std::max(amax, std::fabs(v));", CPU_FP_QUANT,
           "the CPU fp quantizers no longer flag NaN / Inf weights: quantize(mode='mxfp4') of non-finite w "
           "returns codes instead of the ValueError (affine still refuses)"),
    Mutant("c7-dequantize-sum-not-rounded-to-scales-dtype", "csrc/cpu/quantize.cpp",
           "out[r * cols + c] = O(S(product + float(biases[r * groups + c / group_size])));",
           "out[r * cols + c] = O(product + float(biases[r * groups + c / group_size]));", DEQUANTIZE,
           "affine dequantize with dtype wider than the scales' (float16 scales, dtype=float32) keeps the "
           "float32 sum instead of rounding it to the scales' dtype first (MLX's arithmetic); equivalent "
           "when dtype is the scales'"),
    Mutant("c7-gather-y-copy-source-stride-n", "csrc/cpu/gather_qmm.cpp",
           "src + (j * M + m) * n, sizeof(float) * n);", "src + (j * M + m) * N, sizeof(float) * n);", CPU_GATHER,
           "gather_qmm on CPU copies a work item's rows of y from a row stride of N instead of the slice's n: "
           "wrong (and reads past the slice) whenever transpose=True splits N into several slices"),
    Mutant("c7-decode-4bit-nibbles-swapped", "csrc/cpu/decode.h",
           "      v0 = codes_to_float(b & 15);\n      v1 = codes_to_float(b >> 4);",
           "      v0 = codes_to_float(b >> 4);\n      v1 = codes_to_float(b & 15);", CPU,
           "the 4-bit block decoder puts the high nibbles (odd codes) in v0 and the low ones in v1, against "
           "the codec order natural() describes: every 4-bit fused / GEMM route pairs codes with wrong x"),
    # ---- Python ops, modules, distributed (no rebuild) ----------------------------------------------
    Mutant("p7-int8-setting-applies-on-metal", "torch_qmm/ops.py",
           'applies = mode == "affine" and transpose and x.device.type == "cpu"',
           'applies = mode == "affine" and transpose', ACTIVATIONS_DEVICE,
           "inside activation_quantization('int8') an affine quantized_matmul on a non-CPU device raises "
           "the int8 op's device error instead of running exactly"),
    Mutant("p7-activation-setting-not-thread-local", "torch_qmm/activations.py",
           "_state = threading.local()", '_state = type("_Setting", (), {})()', ACTIVATIONS,
           "the activation setting is a module global: a block in one thread turns int8 on for every "
           "thread (and a new thread starts in the block's setting)"),
    Mutant("p7-quantlinear-zero-features-accepted", "torch_qmm/nn.py",
           "if type(v) is not int or v <= 0:", "if type(v) is not int or v < 0:", NN_ARGS,
           "QuantLinear(0, n) / QuantSwitchLinear with 0 experts or features is built (an empty layer) "
           "instead of refused with a ValueError naming the size"),
    Mutant("p7-switch-from-float-bias-shape-unchecked", "torch_qmm/nn_moe.py",
           "        if bias is not None and tuple(bias.shape) != (e, out):\n"
           "            raise ValueError(f\"argument 'bias' must have shape [{e}, {out}], got {list(bias.shape)}\")\n"
           "        module = quantized_from(",
           "        module = quantized_from(", MOE,
           "QuantSwitchLinear.from_float with a bias [out] (one for all experts) broadcasts it into [E, out] "
           "silently, or fails in copy_ with a RuntimeError, instead of the ValueError naming 'bias'"),
    Mutant("p7-tp-rowwise-split-input-sharded", "torch_qmm/distributed/plan.py",
           'if kind == "rowwise_split_input":  # the input comes replicated (after a colwise_gather_output)\n'
           "        return QuantRowwiseParallel(input_layouts=Replicate(), stage=stage)",
           'if kind == "rowwise_split_input":  # the input comes replicated (after a colwise_gather_output)\n'
           "        return QuantRowwiseParallel(stage=stage)", DISTRIBUTED,
           "a transformers plan's 'rowwise_split_input' takes its input as already sharded: after a "
           "colwise_gather_output layer each rank multiplies the whole input with its slice of W"),
    Mutant("p7-tp-experts-gate-up-split-as-plain-rows", "torch_qmm/distributed/experts.py",
           "    gate, up = split_gate_up(t, interleaved)\n    start, n = rows_of_rank(gate.shape[1], rank, world)\n"
           "    return join_gate_up(gate.narrow(1, start, n), up.narrow(1, start, n), interleaved).contiguous()",
           "    start, n = rows_of_rank(t.shape[1], rank, world)\n    return t.narrow(1, start, n).contiguous()",
           DISTRIBUTED_MOE,
           "a tensor-parallel rank takes a plain row chunk of gate_up: right for interleaved rows (gpt-oss), "
           "but for gate-then-up rows rank 0 gets only gate rows and the last rank only up rows"),
    # ---- Interop and quantizers (no rebuild) --------------------------------------------------------
    Mutant("i7-mxfp4-float-tensor-shape-checked-late", "torch_qmm/interop/mxfp4_blocks.py",
           "    for k in rest:\n        if ckpt.shape(k) != tuple(state[k].shape):\n"
           "            raise ValueError(f\"{_file_of(ckpt, k)}: tensor {k!r} has shape {list(ckpt.shape(k))}, "
           "the model expects \"\n                             f\"{list(state[k].shape)}\")\n",
           "    for k in rest:\n", MXFP4,
           "an mxfp4 checkpoint whose float tensor has the wrong shape gets past the checks: copy_ then "
           "fails with a RuntimeError (or broadcasts) after the model was already changed"),
    Mutant("i7-mlx-attribute-map-read-backwards", "torch_qmm/interop/mlx.py",
           'for alias, canonical in (aliases or {}).items():',
           'for canonical, alias in (aliases or {}).items():', MLX_LM_MOE,
           "save_mlx reads transformers' attribute_map the wrong way round: the aliases mlx_lm reads "
           "(Qwen3-MoE's num_experts) are not written to config.json"),
    Mutant("i7-mlx-float-experts-split-ignores-interleave", "torch_qmm/interop/mlx_experts.py",
           "        gate, up = split_gate_up(fused, layout.interleaved)\n        out[f\"{prefix}.gate_proj.{leaf}\"]",
           "        gate, up = split_gate_up(fused, False)\n        out[f\"{prefix}.gate_proj.{leaf}\"]", MLX_MOE,
           "float experts with interleaved gate/up rows (gpt-oss) are saved for mlx_lm as if the gate rows "
           "came first: mlx_lm's gate_proj holds half gate and half up rows"),
    Mutant("i7-gguf-q4_0-nibbles-interleaved", "torch_qmm/interop/gguf.py",
           "return np.concatenate([qs & 0xF, qs >> 4], axis=-1)",
           "return np.stack([qs & 0xF, qs >> 4], axis=-1).reshape(*qs.shape[:-1], -1)", GGUF_INTEROP,
           "to_affine reads a 32-weight block's nibbles as weights 2j / 2j+1 instead of j / j+16 (GGUF's "
           "order): Q4_0, Q4_1, Q5_0 and Q5_1 weights permuted within every block"),
    Mutant("i7-gguf-q4k-blocks-dmin-unchecked", "torch_qmm/gguf_blocks.py",
           "12: slice(0, 4),", "12: slice(0, 2),", GGUF_HOSTILE,
           "to_blocks checks Q4_K's d but not its dmin: a NaN / Inf dmin (a corrupt file) is accepted"),
    Mutant("i7-llama-k-unpermute-with-q-heads", "torch_qmm/interop/gguf_llama.py",
           'else (n_kv, "num_key_value_heads")',
           'else (n_head, "num_key_value_heads")', LLAMA,
           "the K projection's llama.cpp permutation is undone with the query head count: wrong K rows "
           "for every model with grouped-query attention (n_kv < n_head)"),
    Mutant("i7-transformers-saved-bits-collapsed-to-first", "torch_qmm/interop/transformers.py",
           "cfg.bits = next(iter(got.values())) if len(set(got.values())) == 1 else got",
           "cfg.bits = next(iter(got.values()))", TRANSFORMERS,
           "after per-layer bits (a mapping or MixedBits) the saved config records the first layer's bits "
           "for all: reloading builds layers of the wrong width"),
    Mutant("i7-cli-fp-mode-with-gptq-accepted", "torch_qmm/interop/cli_convert.py",
           '    if args.mode != "affine" and args.method != "rtn":\n'
           '        raise UsageError(f"--method {args.method} writes the affine format; --mode {args.mode} is '
           'quantized with "\n                         "--method rtn")\n',
           "", CLI,
           "convert --mode mxfp4 --method gptq is accepted instead of refused (gptq / awq write the affine "
           "format)"),
    Mutant("q7-mse-candidates-scored-before-rounding", "torch_qmm/quantizers/mse.py",
           "        s, b = stored(s, dtype), stored(b, dtype)\n        q = codes(g, s, b, bits)",
           "        q = codes(g, s, b, bits)", QUANTIZERS,
           "mse scores each candidate with its float32 scale and bias instead of the values rounded to the "
           "storage dtype: for float16 / bfloat16 the chosen group can decode worse than RTN"),
]
