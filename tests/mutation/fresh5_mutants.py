"""A fifth independent audit list (python -m tests.mutation --fresh5): realistic single bugs written
from the product sources alone (csrc/, metal/, torch_qmm/), by someone who had not read the tests,
none of them a bug of an earlier list: the gather row map and run bounds, the small-M store bound,
the 4-bit qmv mask, the fp quantizers' scale codes, the GGUF slice and mma loaders, the mma x
fragment; the planner's gather grid and kernel names; the dequantize dtype, quantize rank, gather
x batch, format table and meta checks; the CPU fused / gemm / decode / gather / dequantize /
GGUF / int8-activation / bf16-GEMM kernels; the activation setting, the int8 transpose check, the
MoE switch's sort, bias and gate/up join, the tensor-parallel group check; and the GGUF, mxfp4
and mlx_lm interop.

Selections are two or three test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 5")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

METAL_GATHER = _files("tests/test_metal_gather.py", "tests/test_fresh4_metal_gather.py")
METAL_SMALL = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_MMA = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_FP = _files("tests/test_metal_fp.py", "tests/test_metal_edges.py")
METAL_QUANT = _files("tests/test_metal_ops.py", "tests/test_metal_edges.py")
METAL_GGUF = _files("tests/test_metal_gguf.py", "tests/test_routes_metal.py")
PLAN = _files("tests/test_metal_plan.py", "tests/test_routes_metal.py")
PLAN_GATHER = _files("tests/test_metal_gather.py", "tests/test_metal_plan.py")
ERRORS = _files("tests/test_errors.py", "tests/test_hardening_ops.py", "tests/test_fakes.py")
SPEC = _files("tests/test_spec_errors.py", "tests/test_mode_defaults.py", "tests/test_spec_ops.py")
FAKES = _files("tests/test_fakes.py", "tests/test_compile.py")
GATHER_CHECKS = _files("tests/test_gather_qmm.py", "tests/test_errors.py")
GGUF_CHECKS = _files("tests/test_gguf_qmm.py", "tests/test_errors.py")
CPU = _files("tests/test_routes_cpu.py", "tests/test_cpu_kernels.py", "tests/test_qmm.py")
CPU_NONFINITE = _files("tests/test_hardening_ops.py", "tests/test_routes_cpu.py", "tests/test_qmm.py")
CPU_GATHER = _files("tests/test_gather_qmm.py", "tests/test_nn_moe.py")
CPU_QUANT = _files("tests/test_quantize.py", "tests/test_cpu_kernels.py")
CPU_GGUF = _files("tests/test_gguf_qmm.py", "tests/test_cpu_gguf_chunked.py")
ACTQ = _files("tests/test_cpu_actq.py", "tests/test_cpu_actq_gguf.py")
BF16 = _files("tests/test_cpu_bf16_gemm.py")
ACTIVATIONS = _files("tests/test_cpu_actq.py", "tests/test_cpu_actq_gguf.py", "tests/test_qmm.py")
MOE = _files("tests/test_nn_moe.py", "tests/test_moe_models.py")
NN = _files("tests/test_nn.py", "tests/test_errors.py")
DISTRIBUTED = _files("tests/test_distributed.py", "tests/test_distributed_moe.py")
GGUF_INTEROP = _files("tests/test_interop_gguf.py", "tests/test_interop_gguf_q4k_affine.py")
MXFP4 = _files("tests/test_moe_gpt_oss_mxfp4.py", "tests/test_hostile_files.py")
MLX_LM = _files("tests/test_interop_mlx_lm.py", "tests/test_moe_mlx_lm.py")

MUTANTS: list[Mutant] = [
    # ---- Python ops and modules (no rebuild) ---------------------------------------------------
    Mutant("p5-activations-nested-exit-resets-to-exact", "torch_qmm/activations.py",
           "        _state.kind = previous", "        _state.kind = None", ACTIVATIONS,
           "leaving an inner activation_quantization block turns the setting off instead of restoring "
           "the outer one (an inner None block ends int8 for the rest of the outer block)"),
    Mutant("p5-gguf-matmul-ignores-activation-setting", "torch_qmm/ops.py",
           '    if kind is None and x.device.type == "cpu" and has_int8:\n'
           '        kind = _activations.current_activations()\n',
           "", ACTIVATIONS,
           "gguf_matmul ignores activation_quantization('int8'): only an explicit argument selects int8"),
    Mutant("p5-int8-transpose-false-not-refused", "torch_qmm/ops.py",
           "        if not transpose:\n            raise ValueError(\"argument 'transpose' must be True with "
           "activations='int8', got False\")\n", "", ACTIVATIONS,
           "quantized_matmul(..., transpose=False, activations='int8') runs the int8 kernel as if "
           "transpose were True (a shape error from the op, or W read transposed) instead of refusing"),
    Mutant("p5-switch-bias-not-unsqueezed", "torch_qmm/nn_moe.py",
           "y = y + self.bias[indices.long()].unsqueeze(-2).to(y.dtype)",
           "y = y + self.bias[indices.long()].to(y.dtype)", MOE,
           "QuantSwitchLinear's bias [..., out] broadcast against y [..., M, out] without the M axis"),
    Mutant("p5-switch-sorted-x-by-expert-slot", "torch_qmm/nn_moe.py",
           "x = x.reshape(-1, 1, x.shape[-1])[order // k]", "x = x.reshape(-1, 1, x.shape[-1])[order % k]",
           MOE, "with >= 64 pairs the sorted pairs take the x row of their top-k slot instead of their token"),
    Mutant("p5-switch-unsort-gathers", "torch_qmm/nn_moe.py",
           "y = torch.empty_like(y).index_copy_(0, order, y).reshape(*indices.shape, -1)",
           "y = y[order].reshape(*indices.shape, -1)", MOE,
           "the sorted results are permuted by `order` again instead of scattered back (the inverse)"),
    Mutant("p5-join-gate-up-interleaved-wrong-dim", "torch_qmm/nn_moe.py",
           "return torch.stack((gate, up), dim=2).flatten(1, 2)",
           "return torch.stack((gate, up), dim=1).flatten(1, 2)", MOE + _files("tests/test_moe_mlx_lm.py"),
           "joining interleaved gate / up rows concatenates them (gate block, up block) instead of alternating"),
    Mutant("p5-quantlinear-int8-with-fp-mode-accepted", "torch_qmm/nn.py",
           '    if activations is not None and mode != "affine":', "    if False:", NN,
           "QuantLinear(mode='mxfp4', activations='int8') is built (and fails only at the first call)"),
    Mutant("p5-distributed-whole-groups-per-shard-unchecked", "torch_qmm/distributed/partition.py",
           "    if cols % (world * group_size) != 0:", "    if cols % group_size != 0:", DISTRIBUTED,
           "a tensor-parallel split of the quantized axis is accepted when a shard would cut a group"),
    # ---- interop (no rebuild) --------------------------------------------------------------------
    Mutant("i5-gguf-q8_0-bias-127", "torch_qmm/interop/gguf.py",
           "        return 8, b, d, -128.0 * d", "        return 8, b, d, -127.0 * d", GGUF_INTEROP,
           "Q8_0 -> affine: codes are offset by 128 but the bias undoes only 127 (every weight off by d)"),
    Mutant("i5-q4k-affine-bias-sign", "torch_qmm/interop/gguf.py",
           "        return d * sc, -(dmin * mn)", "        return d * sc, (dmin * mn)",
           GGUF_INTEROP, "q4_k_to_affine: the sub-block min is added instead of subtracted"),
    Mutant("i5-mxfp4-blocks-dtype-unchecked", "torch_qmm/interop/mxfp4_blocks.py",
           '            if ckpt.dtype_name(k) != "U8":', "            if False:", MXFP4,
           "an mxfp4 checkpoint storing blocks / scales in another dtype (I8, F16) is copied in with a "
           "value conversion instead of refused"),
    Mutant("i5-mlx-lm-config-rope-theta-dropped", "torch_qmm/interop/mlx.py",
           '    out["rope_theta"] = rope["rope_theta"]\n', "", MLX_LM,
           "config.json for mlx_lm gets no top-level rope_theta: mlx_lm builds the rotary embedding "
           "with its default base (10000)"),
    # ---- Metal kernels (no rebuild) -------------------------------------------------------------
    Mutant("m5-gather-y-row-ignores-order", "metal/row_map.h",
           "uint y_row(uint r) const { return uint(order[r / M]) * M + r % M; }",
           "uint y_row(uint r) const { return r; }", METAL_GATHER,
           "gathered rows are written at their sorted position, not back to their pair (unsorted rhs)"),
    Mutant("m5-gather-rows-live-ignores-lo", "metal/row_map.h",
           "bool live(uint r) const { return r >= lo && r < hi; }", "bool live(uint r) const { return r < hi; }",
           METAL_GATHER,
           "a run's tile also computes (and stores) the tile's earlier rows with its expert: a 32-row "
           "tile holding two experts keeps only the last run's results"),
    Mutant("m5-gather-qmv-run-end-stops-before-last-pair", "metal/quant_gather.h",
           "while (end < p.pairs && expert_at(rhs, order, end) == e) ++end;",
           "while (end + 1 < p.pairs && expert_at(rhs, order, end) == e) ++end;", METAL_GATHER,
           "gather_qmv: a run reaching the last pair stops one pair short, and that pair (not the first "
           "of its run) is computed by nobody"),
    Mutant("m5-gather-expert-codes-ignore-bits", "metal/quant_gather.h",
           "wq + e * (codes / 8 * F::BITS)", "wq + e * (codes / 8)", METAL_GATHER,
           "expert e's packed codes start e * N*K bytes in, right only for 8 bits"),
    Mutant("m5-gather-mma-tile-end-in-pairs", "metal/quant_gather.h",
           "const uint tile_end = min((tgid.y + 1) * BM, p.pairs * M);",
           "const uint tile_end = min((tgid.y + 1) * BM, p.pairs);", METAL_GATHER,
           "gather mma: the tile's row limit counts pairs, not rows: with M > 1 the rows past `pairs` "
           "are never computed"),
    Mutant("m5-small-store-past-n", "metal/quant_qmm_small.h",
           "if (lane == 0 && rows.live(m0 + m) && n0 + r < N)", "if (lane == 0 && rows.live(m0 + m) && n0 + r <= N)",
           METAL_SMALL,
           "bm2/4/8 (and gather_qmv) also store column N (a zero sum) into the next row's column 0 "
           "(past y for the last row) when N % 4 != 0"),
    Mutant("m5-qdot-4bit-mask-high-nibble", "metal/quant_common.h",
           "xt[4 * i + 3] * float(v & 0xf000u);", "xt[4 * i + 3] * float(v & 0xff00u);", METAL_SMALL,
           "qmv's 4-bit dot masks the 4th code of a 16-bit word with 0xff00 (adds the 3rd code / 16)"),
    Mutant("m5-mma-a-frag-second-element-next-row", "metal/mma_tile.h",
           "A[i].thread_elements()[1] = float(xs[r * LDX + c + 1]);",
           "A[i].thread_elements()[1] = float(xs[(r + 1) * LDX + c]);", METAL_MMA,
           "the x fragment's second element of a lane is taken from the next row instead of the next column"),
    Mutant("m5-e8m0-encode-exponent-bias-128", "metal/quant_format.h",
           "scales[gi] = uint8_t(uint(n + 127) & 0xffu);", "scales[gi] = uint8_t(uint(n + 128) & 0xffu);",
           METAL_FP, "the fp quantizers write the e8m0 scale one exponent too high (codes divided by 2^n)"),
    Mutant("m5-nvfp4-quantize-divides-by-unrounded-scale", "metal/quant_format.h",
           "      divisor = e4m3_value(code);", "      divisor = s;", METAL_FP,
           "nvfp4 quantize divides by the scale before its e4m3 rounding instead of the stored scale's value"),
    Mutant("m5-affine-quantize-bias-always-min", "metal/quant_format.h",
           "      bias = edge;\n", "      bias = w_min;\n", METAL_QUANT + _files("tests/test_routes_metal.py"),
           "affine quantize on the device takes the group minimum as bias even where the maximum is the "
           "edge (negative scale): codes and bias disagree"),
    Mutant("m5-gguf-q4k-run-subblock-index", "metal/gguf_qmm.h",
           "q4k_scale_min(int(2 * c) + nib, b->scales)", "q4k_scale_min(int(c) + nib, b->scales)", METAL_GGUF,
           "qmv / bm Q4_K: a run's scale/min is read for sub-block c + nib instead of 2c + nib"),
    Mutant("m5-q6k-slice-ql-half-by-t-lt-2", "metal/gguf_qmm.h",
           "const uint32_t lo = t % 2 == 0 ? a : c;", "const uint32_t lo = t < 2 ? a : c;", METAL_GGUF,
           "qmv / bm Q6_K: runs 1 and 2 read the other 32 bytes of ql"),
    Mutant("m5-gguf-mma-q4k-min-uses-d", "metal/gguf_mma.h",
           "const float m = float(as_type<half>(b->dmin)) * float(sm.min);",
           "const float m = float(as_type<half>(b->d)) * float(sm.min);", METAL_GGUF,
           "the mma32 Q4_K loader scales the sub-block min by d instead of dmin"),
    Mutant("m5-gguf-mma-q6k-ql-offset-by-t-div-2", "metal/gguf_mma.h",
           "(b->ql + 64 * h + 32 * (t % 2) + l)", "(b->ql + 64 * h + 32 * (t / 2) + l)", METAL_GGUF,
           "the mma32 Q6_K loader picks the 32-byte half of ql by t / 2 instead of t % 2"),
    # ---- planner (csrc/plan.cpp, --cpp) ---------------------------------------------------------
    Mutant("p5-plan-gather-runs-grid-by-row-tiles", "csrc/plan.cpp",
           "l.threadgroups = {ceil_div(p.N, g.cols), u32(p.pairs), 1};",
           "l.threadgroups = {ceil_div(p.N, g.cols), ceil_div(p.pairs, g.rows), 1};", PLAN_GATHER,
           "gather_qmv's grid has ceil(pairs / 8) rows of threadgroups, one per pair expected: the runs "
           "starting at later pairs are never computed"),
    Mutant("p5-plan-bm8-runs-bm4-kernel", "csrc/plan.cpp",
           'Cond::kAny, "qmm_t_bm8", bm(8)', 'Cond::kAny, "qmm_t_bm4", bm(8)', PLAN,
           "the qmm_t_bm8 route launches the 4-row kernel on the 8-row grid: rows 4..7 of each block unset"),
    # ---- validation and fakes (--cpp) -----------------------------------------------------------
    Mutant("v5-dequantize-dtype-unchecked", "csrc/validate.cpp",
           "TORCH_CHECK_TYPE(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op,\n"
           "                   \": argument 'dtype' must be",
           "TORCH_CHECK_TYPE(true, op,\n                   \": argument 'dtype' must be", ERRORS,
           "dequantize(dtype=torch.float64 / an integer dtype) gets past the check (float64 output, or a "
           "dispatch RuntimeError) instead of a TypeError"),
    Mutant("v5-quantize-scalar-accepted", "csrc/validate.cpp",
           "TORCH_CHECK_VALUE(w.dim() >= 2, op, \": argument 'w' must have at least 2 dimensions",
           "TORCH_CHECK_VALUE(w.dim() >= 0, op, \": argument 'w' must have at least 2 dimensions", ERRORS,
           "quantize(0-d w) passes the rank check and fails on its last dimension with an IndexError"),
    Mutant("v5-gather-x-batch-includes-m", "csrc/validate.cpp",
           "return {M, N, K, product(x.sym_sizes().slice(0, x.dim() - 2)),",
           "return {M, N, K, product(x.sym_sizes().slice(0, x.dim() - 1)),", GATHER_CHECKS,
           "gather_qmm's x batch counts the M rows too: lhs indices up to x_batch * M pass the range check "
           "and the CPU op reshapes x wrongly when M > 1"),
    Mutant("v5-format-affine-bits-count-short", "csrc/format_spec.cpp",
           "{{2, 3, 4, 5, 6, 8}, 6}", "{{2, 3, 4, 5, 6, 8}, 5}", SPEC,
           "the affine row's bit-width count leaves out 8: 8-bit affine is refused everywhere"),
    Mutant("v5-meta-quantize-fp-scales-dtype", "csrc/meta.cpp",
           "const auto scale_options = f.scale == ScaleKind::kFloat ? w.options() : w.options().dtype(at::kByte);",
           "const auto scale_options = w.options();", FAKES,
           "the fake quantize of an fp mode gives float scales (the real op: uint8 codes)"),
    Mutant("v5-gguf-n-zero-refused", "csrc/gguf_validate.cpp",
           "TORCH_CHECK_VALUE(N >= 0, op,", "TORCH_CHECK_VALUE(N > 0, op,", GGUF_CHECKS,
           "gguf_qmm with N = 0 raises instead of returning an empty result"),
    # ---- CPU kernels (--cpp) ---------------------------------------------------------------------
    Mutant("c5-fused-k-chunk-end-unclamped", "csrc/cpu/qmm_fused.cpp",
           "const int64_t ke = std::min(blocks, kb + chunk);", "const int64_t ke = kb + chunk;", CPU,
           "M >= 3 fused (transpose=True): the last K chunk runs a whole 1024 codes, past the row's end "
           "(next row's codes, scales and x) unless K % 1024 == 0"),
    Mutant("c5-nspan-group-of-span-start", "csrc/cpu/qmm_fused.cpp",
           "const int64_t g = k * groups + (c0 + 32 * j) / a.group_size;",
           "const int64_t g = k * groups + c0 / a.group_size;", CPU,
           "transpose=False fused: both 32-column blocks of a 64-column span use the span's first group "
           "(wrong for group_size 32)"),
    Mutant("c5-n-fused-trailing-span-dropped", "csrc/cpu/qmm_fused.cpp",
           "const int64_t spans = (a.N + 63) / 64;", "const int64_t spans = a.N / 64;", CPU,
           "transpose=False fused: N % 64 == 32 leaves the last 32 columns unwritten"),
    Mutant("c5-fused-nonfinite-not-redone", "csrc/cpu/qmm.cpp",
           "cpu::qmm_t_fused(a, yf.data_ptr<float>());\n    if (cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return yf;",
           "cpu::qmm_t_fused(a, yf.data_ptr<float>());\n    return yf;", CPU_NONFINITE,
           "the hoisted fused result is kept where it is not finite (Inf in x against weights of both "
           "signs: hoisted +-Inf where F.linear gives NaN)"),
    Mutant("c5-n-gemm-codec-order-ignored", "csrc/cpu/qmm_gemm.cpp",
           "for (int64_t m = 0; m < a.M; ++m) dst[m * a.N + n] = src[p * a.M + m];",
           "for (int64_t m = 0; m < a.M; ++m) dst[m * a.N + p] = src[p * a.M + m];", CPU,
           "transpose=False gemm, 4 bits: y's columns left in codec order (even/odd interleave)"),
    Mutant("c5-gather-scale-row-bytes-as-float32", "csrc/cpu/gather_qmm.cpp",
           "srow_bytes = scales.size(-1) * scales.element_size();", "srow_bytes = scales.size(-1) * 4;", CPU_GATHER,
           "gather_qmm's expert offset into scales / biases assumes 4-byte elements: wrong for float16, "
           "bfloat16 and the fp modes' uint8 codes"),
    Mutant("c5-dequantize-product-not-rounded", "csrc/cpu/quantize.cpp",
           "const float product = float(S(s * double(unpack_element(row, c, bits))));",
           "const float product = float(s * double(unpack_element(row, c, bits)));", CPU_QUANT,
           "affine dequantize sums s * q + b with the product unrounded to the scales' dtype (MLX rounds "
           "it first): off by an ulp for float16 / bfloat16"),
    Mutant("c5-q4k-decode-high-nibble-min-of-low", "csrc/cpu/gguf_qmm.cpp",
           "yc[l + 32] = d2 * float(q[l] >> 4) - m2;", "yc[l + 32] = d2 * float(q[l] >> 4) - m1;", CPU_GGUF,
           "the CPU Q4_K decoder gives the odd sub-blocks the even sub-block's min"),
    Mutant("c5-q6k-decode-third-run-high-bits", "csrc/cpu/gguf_qmm.cpp",
           "const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;",
           "const int q3 = int((ql[l] >> 4) | (((qh[l] >> 2) & 3) << 4)) - 32;", CPU_GGUF,
           "the CPU Q6_K decoder takes the third run's 2 high bits from bits 2-3 of qh (the second run's)"),
    Mutant("c5-int8x-u4-gs32-scale-lanes-swapped", "csrc/cpu/actq_qmm.cpp",
           "_mm256_set_m128(_mm_set1_ps(w.scale(g0 + 1)), _mm_set1_ps(w.scale(g0)))",
           "_mm256_set_m128(_mm_set1_ps(w.scale(g0)), _mm_set1_ps(w.scale(g0 + 1)))", ACTQ,
           "int8 activations, 4 bits, group_size 32: the two groups of a 64-code chunk get each other's scale"),
    Mutant("c5-int8x-scale-divides-by-128", "csrc/cpu/actq_x.h",
           "const float d = amax / 127.0f;", "const float d = amax / 128.0f;", ACTQ,
           "x's int8 scale is max|x| / 128: the largest value rounds to 128 and is clamped to 127"),
    Mutant("c5-bf16-gemm-biases-not-sliced", "csrc/cpu/bf16_gemm.cpp",
           "decode(a.K, n0 + r, 1, 0, a.K, row.data());", "decode(a.K, n0, 1, 0, a.K, row.data());", BF16,
           "the bf16 GEMM decodes the first W row of a tile (its scales and biases too) for every row of it"),
    Mutant("c5-spread8-unit-offset-in-words", "csrc/cpu/decode.h",
           "std::memcpy(&w, raw + i * BITS, 8);", "std::memcpy(&w, raw + i * 8, 8);", CPU,
           "3/5/6-bit decode without AVX-512: unit i of a block is read at byte 8i instead of BITS * i"),
]
