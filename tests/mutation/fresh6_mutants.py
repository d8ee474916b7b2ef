"""A sixth independent audit list (python -m tests.mutation --fresh6): realistic single bugs written
from the product sources alone (csrc/, metal/, torch_qmm/), by someone who had not read the tests,
none of them a bug of an earlier list: the qmv group index and 2-bit mask, the weight-by-weight
fallback's x, the qvm reduction, the mma sub-tile origin, B fragment and transpose=False loader,
the gather_qmv row step, the e2m1 / e4m3 encoders, the affine quantizer's bins and word carry, the
mxfp8 packing, the Q4_K / Q6_K slices and the mma Q6_K scale index; the planner's gather threshold
and dequantize grid; the biases device, index broadcast and range, format table, gather fake and
dequantize default checks; the CPU fp quantizer, gather rows, bf16 GEMM tiles, non-finite test,
fp routing and 2-bit decode; the activation setting and argument, the fp QuantLinear buffers, the
MoE gate/up split and scales check, the tensor-parallel bias, the scale dtype of a format; and the
mxfp4, mlx_lm, GGUF, transformers and tokenizer interop.

Selections are two or three test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 6")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

METAL_QMV = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_NONFINITE = _files("tests/test_hardening_ops.py", "tests/test_metal_edges.py", "tests/test_routes_metal.py")
METAL_QVM = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_MMA = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_GATHER = _files("tests/test_metal_gather.py", "tests/test_fresh4_metal_gather.py")
METAL_FP = _files("tests/test_metal_fp.py", "tests/test_metal_edges.py")
METAL_QUANT = _files("tests/test_metal_ops.py", "tests/test_metal_edges.py", "tests/test_routes_metal.py")
METAL_GGUF = _files("tests/test_metal_gguf.py", "tests/test_routes_metal.py")
PLAN_GATHER = _files("tests/test_metal_gather.py", "tests/test_metal_plan.py")
PLAN_DEQUANTIZE = _files("tests/test_metal_ops.py", "tests/test_metal_plan.py")
ERRORS = _files("tests/test_errors.py", "tests/test_hardening_ops.py", "tests/test_format_arguments.py")
GATHER_CHECKS = _files("tests/test_gather_qmm.py", "tests/test_errors.py")
SPEC = _files("tests/test_spec_ops.py", "tests/test_fp_modes.py", "tests/test_spec_errors.py")
FAKES = _files("tests/test_fakes.py", "tests/test_compile.py")
DEQUANTIZE_DEFAULT = _files("tests/test_quantize.py", "tests/test_format_arguments.py", "tests/test_spec_ops.py")
CPU_FP_QUANT = _files("tests/test_fp_modes.py", "tests/test_quantize.py", "tests/test_spec_ops.py")
CPU_GATHER = _files("tests/test_gather_qmm.py", "tests/test_nn_moe.py")
BF16 = _files("tests/test_cpu_bf16_gemm.py")
CPU_NONFINITE = _files("tests/test_hardening_ops.py", "tests/test_routes_cpu.py")
CPU_FP_ROUTES = _files("tests/test_fp_modes.py", "tests/test_routes_cpu.py", "tests/test_cpu_fp_chunked.py")
CPU = _files("tests/test_routes_cpu.py", "tests/test_cpu_kernels.py", "tests/test_qmm.py")
ACTIVATIONS = _files("tests/test_cpu_actq.py", "tests/test_qmm.py")
OP_ARGUMENTS = _files("tests/test_errors.py", "tests/test_cpu_actq.py", "tests/test_format_arguments.py")
NN_FP = _files("tests/test_nn.py", "tests/test_fp_modes.py", "tests/test_nn_dtypes.py")
MOE_SPLIT = _files("tests/test_moe_mlx_lm.py", "tests/test_distributed_moe.py", "tests/test_moe_gpt_oss_mxfp4.py")
MOE = _files("tests/test_nn_moe.py", "tests/test_moe_models.py", "tests/test_fresh4_moe_formats.py")
DISTRIBUTED = _files("tests/test_distributed_moe.py", "tests/test_distributed.py")
FORMAT_TABLE = _files("tests/test_metal_fp.py", "tests/test_fp_modes.py")
MXFP4 = _files("tests/test_moe_gpt_oss_mxfp4.py", "tests/test_hostile_files.py")
MLX_LM = _files("tests/test_interop_mlx_lm.py", "tests/test_interop_mlx.py")
GGUF_INTEROP = _files("tests/test_interop_gguf.py", "tests/test_hostile_files.py")
TRANSFORMERS = _files("tests/test_interop_transformers.py", "tests/test_user_convert.py")
TOKENIZER = _files("tests/test_interop_gguf_llama.py", "tests/test_cli_convert.py", "tests/test_interop_cli.py")

MUTANTS: list[Mutant] = [
    # ---- Python ops and modules (no rebuild) ---------------------------------------------------
    Mutant("p6-activation-quantization-default-exact", "torch_qmm/activations.py",
           'def activation_quantization(kind: str | None = "int8"):',
           "def activation_quantization(kind: str | None = None):", ACTIVATIONS,
           "activation_quantization() without an argument is an exact block instead of int8"),
    Mutant("p6-int8-setting-ignores-mode", "torch_qmm/ops.py",
           'applies = mode == "affine" and transpose and x.device.type == "cpu"',
           'applies = transpose and x.device.type == "cpu"', ACTIVATIONS,
           "inside activation_quantization('int8') an fp-mode quantized_matmul is sent to the int8 op "
           "(which refuses the mode) instead of staying exact"),
    Mutant("p6-quantized-matmul-activations-unchecked", "torch_qmm/ops.py",
           "    _activations.check_activations(activations)\n    _check_frozen_tangents(\"qmm\",",
           "    _check_frozen_tangents(\"qmm\",", OP_ARGUMENTS,
           "quantized_matmul(activations='int4') (a typo) runs exact instead of raising a ValueError "
           "naming 'activations'"),
    Mutant("p6-quantlinear-fp-scales-in-compute-dtype", "torch_qmm/nn.py",
           "scale_dtype = dtype if fmt.has_biases else torch.uint8", "scale_dtype = dtype", NN_FP,
           "an fp-mode QuantLinear / QuantSwitchLinear registers float scales: the uint8 codes are "
           "copied in as float values and the op refuses float scales for the mode"),
    Mutant("p6-split-gate-up-interleaved-swapped", "torch_qmm/nn_moe.py",
           "return t[:, 0::2], t[:, 1::2]", "return t[:, 1::2], t[:, 0::2]", MOE_SPLIT,
           "interleaved gate_up rows (gpt-oss) split with gate and up exchanged: the mlx_lm export and "
           "each tensor-parallel rank's part put the up rows where the gate rows belong"),
    Mutant("p6-switch-from-quantized-scales-kind-unchecked", "torch_qmm/nn_moe.py",
           "if scales.is_floating_point() != module.scales.is_floating_point():", "if False:", MOE,
           "QuantSwitchLinear.from_quantized accepts float scales for an fp mode (or uint8 for affine) "
           "and converts them by value instead of refusing them"),
    Mutant("p6-sharded-column-split-bias-on-every-rank", "torch_qmm/distributed/experts.py",
           "bias=local(self.bias) if self.tp_split == 1 or first else None,", "bias=local(self.bias),",
           DISTRIBUTED,
           "a QuantSwitchLinear split along its columns (a partial sum) adds its bias on every rank: the "
           "all-reduced output holds world_size times the bias"),
    Mutant("p6-format-scale-dtype-coded-only-e8m0", "torch_qmm/formats.py",
           'return None if self.scale == "float" else torch.uint8',
           'return torch.uint8 if self.scale == "e8m0" else None', FORMAT_TABLE,
           "Format.scale_dtype is None for e4m3 scales: nvfp4 quantize on the Metal device allocates its "
           "scale codes in w's float dtype"),
    # ---- interop (no rebuild) --------------------------------------------------------------------
    Mutant("i6-mxfp4-blocks-shape-unchecked", "torch_qmm/interop/mxfp4_blocks.py",
           "if ckpt.shape(blocks_key) != want_blocks or ckpt.shape(scales_key) != tuple(layer.scales.shape):",
           "if ckpt.shape(scales_key) != tuple(layer.scales.shape):", MXFP4,
           "an mxfp4 checkpoint whose blocks have the wrong shape passes the check and fails in the copy "
           "(a RuntimeError, not a ValueError naming the file and the tensor)"),
    Mutant("i6-mlx-lm-rope-type-key-ignored", "torch_qmm/interop/mlx.py",
           'rope_type = rope.get("rope_type", rope.get("type", "default"))',
           'rope_type = rope.get("type", "default")', MLX_LM,
           "config.json for mlx_lm reads only the old 'type' key: a rope_parameters with rope_type "
           "'llama3' / 'yarn' is written as rope_scaling None (plain rotary embedding in mlx_lm)"),
    Mutant("i6-gguf-q8_0-codes-read-unsigned", "torch_qmm/interop/gguf.py",
           "codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)",
           "codes = (b[..., 2:].astype(np.int16) + 128).astype(np.uint8)", GGUF_INTEROP,
           "Q8_0 -> affine reads the int8 quants as unsigned bytes: every negative quant is off by 256"),
    Mutant("i6-transformers-skip-parent-module-ignored", "torch_qmm/interop/transformers.py",
           'return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)',
           'return any(name == s or name.endswith("." + s) for s in skip)', TRANSFORMERS,
           "modules_to_not_convert naming a parent module (e.g. 'model.layers.0') no longer keeps its "
           "Linear children in float"),
    Mutant("i6-gguf-tokenizer-valueerror-not-caught", "torch_qmm/interop/gguf_tokenizer.py",
           "except Exception as e:",
           "except (KeyError, IndexError, TypeError, OSError) as e:",
           _files("tests/test_interop_mlx_lm.py", "tests/test_interop_gguf_llama.py", "tests/test_cli_convert.py"),
           "a GGUF whose tokenizer transformers refuses with a ValueError aborts the conversion instead "
           "of a warning and no tokenizer files"),
    # ---- Metal kernels (no rebuild) -------------------------------------------------------------
    Mutant("m6-qmv-group-of-block-start", "metal/quant_qmv.h",
           "const uint g = n * groups + k / G;", "const uint g = n * groups + k0 / G;", METAL_QMV,
           "qmv: every lane takes the scale / bias of the K-block's first group, not of its own slice "
           "(a 512-value block spans several groups)"),
    Mutant("m6-qdot-2bit-third-code-mask", "metal/quant_common.h",
           "xt[4 * i + 2] * float(v & 0x30u)", "xt[4 * i + 2] * float(v & 0x0cu)", METAL_QMV,
           "qmv's 2-bit dot masks the third code of a byte with the second code's mask"),
    Mutant("m6-qdot-fallback-x-of-first-unit", "metal/quant_common.h",
           "acc += F::weight(s, q[i], b) * float(x[8 * u + i]);", "acc += F::weight(s, q[i], b) * float(x[i]);",
           METAL_NONFINITE,
           "qmv's weight-by-weight fallback (non-finite hoisted sums) multiplies every unit by the first "
           "unit's x"),
    Mutant("m6-qvm-parked-partial-without-bsum", "metal/quant_qvm.h",
           "red[((simd_gid - 1) * SIMD_WIDTH + lane) * C + i] = acc[i] + bsum;",
           "red[((simd_gid - 1) * SIMD_WIDTH + lane) * C + i] = acc[i];", METAL_QVM,
           "qvm: SIMD-groups 1..3 park their partial sums without their bias terms"),
    Mutant("m6-mma-subtile-row-by-column-index", "metal/mma_tile.h",
           "const uint sm = (simd_gid / SG_COLS) * MMA_SUBTILE;", "const uint sm = (simd_gid % SG_COLS) * MMA_SUBTILE;",
           METAL_MMA,
           "the mma tile places a SIMD-group's sub-tile row by its column index: two of the four 16x16 "
           "sub-tiles of y are computed twice, two never"),
    Mutant("m6-mma-b-frag-kn-first-element-as-nk", "metal/mma_tile.h",
           "B[j].thread_elements()[0] = WLoader::W_NK ? ws[n * LDW + k] : ws[k * LDW + n];",
           "B[j].thread_elements()[0] = ws[n * LDW + k];", METAL_MMA,
           "the B fragment's first element ignores the W tile layout: transpose=False (qmm_n_mma32, "
           "gather_qmm_n_mma32) reads ws transposed"),
    Mutant("m6-mma-n-loader-groups-from-k", "metal/quant_mma.h",
           "transpose ? p.N : p.K, qlen * F::BITS / 8, qlen / F::G};",
           "transpose ? p.N : p.K, qlen * F::BITS / 8, p.K / F::G};", METAL_MMA,
           "qmm_n_mma32's loader counts a packed row's scale groups from K instead of N (wrong unless N == K)"),
    Mutant("m6-gather-qmv-rows-step-in-pairs", "metal/quant_gather.h",
           "for (uint m0 = rows.lo; m0 < rows.hi; m0 += GATHER_ROWS)",
           "for (uint m0 = rows.lo; m0 < rows.hi; m0 += GATHER_ROWS * p.M)", METAL_GATHER,
           "gather_qmv steps through a run 8 pairs at a time instead of 8 rows: with M > 1 and a run of "
           "more than 8 rows, rows are skipped"),
    Mutant("m6-e2m1-encode-never-minus-6", "metal/quant_format.h",
           "for (uint c = 1; c < 16; ++c) {", "for (uint c = 1; c < 15; ++c) {", METAL_FP,
           "the device e2m1 encoder never considers code 15 (-6): the most negative values get -4"),
    Mutant("m6-e4m3-encode-subnormal-below-2^-7", "metal/quant_format.h",
           "if (a < 1.0f / 64.0f) return sign | uint(rint(a * 512.0f));",
           "if (a < 1.0f / 128.0f) return sign | uint(rint(a * 512.0f));", METAL_FP,
           "the device e4m3 encoder treats [2^-7, 2^-6) as normal (exponent field 0): those values get "
           "subnormal codes of the wrong magnitude"),
    Mutant("m6-affine-quantize-n-bins-2^bits", "metal/quant_format.h",
           "const float n_bins = float((1 << bits) - 1);", "const float n_bins = float(1 << bits);", METAL_QUANT,
           "affine quantize on the device uses 2^bits bins: the scale is too small and the top code "
           "2^bits overflows into the next code's bits"),
    Mutant("m6-affine-quantize-pack-carry-dropped", "metal/quant_format.h",
           "        used -= 32;\n", "        used = 0;\n", METAL_QUANT,
           "affine quantize on the device drops the bits of a code that straddles two words (3/5/6 bits)"),
    Mutant("m6-fp-quantize-pack-shift-4", "metal/quant_format.h",
           "word |= c << (bits_ * i);", "word |= c << (4 * i);", METAL_FP,
           "the fp quantizers pack codes 4 bits apart whatever the width: mxfp8 codes overlap"),
    Mutant("m6-q4k-slice-second-word-from-first", "metal/gguf_qmm.h",
           "q[j][i + 4] = float((w1 >> (8 * i + 4 * nib)) & 0xfu);",
           "q[j][i + 4] = float((w0 >> (8 * i + 4 * nib)) & 0xfu);", METAL_GGUF,
           "qmv / bm Q4_K: the last 4 codes of a run are read from the run's first word again"),
    Mutant("m6-q6k-slice-qh-second-half-repeated", "metal/gguf_qmm.h",
           "const uint32_t hi = uint32_t(qh[0]) | (uint32_t(qh[1]) << 16);",
           "const uint32_t hi = uint32_t(qh[0]) | (uint32_t(qh[0]) << 16);", METAL_GGUF,
           "qmv / bm Q6_K: the high bits of a run's last two weights come from its first two bytes of qh"),
    Mutant("m6-gguf-mma-q6k-scale-per-t", "metal/gguf_mma.h",
           "float(b->scales[8 * h + 2 * t + l / 16])", "float(b->scales[8 * h + t + l / 16])", METAL_GGUF,
           "the mma32 Q6_K loader indexes the 16 sub-block scales by t instead of 2t"),
    # ---- planner (csrc/plan.cpp, --cpp) ---------------------------------------------------------
    Mutant("p6-plan-gather-mma-threshold-strict", "csrc/plan.cpp",
           "return p.pairs * p.M >= int64_t(GATHER_MMA_MIN_ROWS_PER_EXPERT) * p.experts;",
           "return p.pairs * p.M > int64_t(GATHER_MMA_MIN_ROWS_PER_EXPERT) * p.experts;", PLAN_GATHER,
           "gather_qmm with exactly 4 rows per expert takes gather_qmv instead of gather_qmm_mma32 "
           "(suspected value-equivalent: both routes are exact; only a route assertion can see it)"),
    Mutant("p6-plan-elementwise-dequantize-per-group", "csrc/plan.cpp",
           "const int64_t values = g.cols ? g.cols : p.group_size;", "const int64_t values = p.group_size;",
           PLAN_DEQUANTIZE,
           "the dequantize grid gets one thread per group instead of one per 8-value unit: most units "
           "are never written"),
    # ---- validation and fakes (--cpp) -----------------------------------------------------------
    Mutant("v6-packed-biases-device-unchecked", "csrc/validate.cpp",
           "TORCH_CHECK_VALUE(wq.device() == scales.device() && wq.device() == biases->device(), op,",
           "TORCH_CHECK_VALUE(wq.device() == scales.device(), op,", ERRORS,
           "biases on another device than wq and scales pass the check"),
    Mutant("v6-gather-index-shapes-mismatch-accepted", "csrc/validate.cpp",
           "TORCH_CHECK_VALUE(da == db, op, \": the index shapes must broadcast: \",",
           "TORCH_CHECK_VALUE(true, op, \": the index shapes must broadcast: \",", GATHER_CHECKS,
           "gather_qmm index shapes that do not broadcast pass the check (a RuntimeError later, not the "
           "ValueError naming both shapes)"),
    Mutant("v6-gather-index-negative-accepted", "csrc/validate.cpp",
           "TORCH_CHECK_VALUE(lo >= 0 && hi < limit,", "TORCH_CHECK_VALUE(hi < limit,", GATHER_CHECKS,
           "negative gather_qmm indices pass the range check"),
    Mutant("v6-format-mxfp8-element-e2m1", "csrc/format_spec.cpp",
           '{Mode::kMxfp8,  "mxfp8",  Element::kE4M3,', '{Mode::kMxfp8,  "mxfp8",  Element::kE2M1,', SPEC,
           "the mxfp8 row of the format table names e2m1 elements (copied from the mxfp4 row)"),
    Mutant("v6-meta-gather-out-shape-n-then-m", "csrc/meta.cpp",
           "  s.batch.push_back(s.M);\n  s.batch.push_back(s.N);", "  s.batch.push_back(s.N);\n  s.batch.push_back(s.M);",
           FAKES, "the fake gather_qmm gives [..., N, M] instead of [..., M, N]"),
    Mutant("v6-dequantize-affine-default-float32", "csrc/validate.cpp",
           "if (!dtype) return f.scale == ScaleKind::kFloat ? scales.scalar_type() : at::kBFloat16;",
           "if (!dtype) return f.scale == ScaleKind::kFloat ? at::kFloat : at::kBFloat16;", DEQUANTIZE_DEFAULT,
           "affine dequantize without dtype returns float32 instead of the scales' dtype (MLX's default)"),
    # ---- CPU kernels (--cpp) ---------------------------------------------------------------------
    Mutant("c6-quantize-fp-e8m0-multiplies-by-2^n", "csrc/cpu/quantize.cpp",
           "std::ldexp(double(float(src[j])), -n)", "std::ldexp(double(float(src[j])), n)", CPU_FP_QUANT,
           "the CPU e8m0 quantizer multiplies w by 2^n instead of dividing (right only where n == 0)"),
    Mutant("c6-gather-group-x-rows-start-in-pairs", "csrc/cpu/gather_qmm.cpp",
           "xs.narrow(0, g.start * M, a.M)", "xs.narrow(0, g.start, a.M)", CPU_GATHER,
           "gather_qmm on CPU: a group's rows of x start at its first pair's index instead of index * M "
           "(wrong for every group but the first when M > 1)"),
    Mutant("c6-bf16-gemm-last-tile-dropped", "csrc/cpu/bf16_gemm.cpp",
           "tiles = (a.N + rows - 1) / rows;", "tiles = a.N / rows;",
           BF16, "the bf16 GEMM leaves the last N % (rows per tile) columns of y unwritten"),
    Mutant("c6-all-finite-misses-nan", "csrc/cpu/qmm.cpp",
           "acc += (u[i] & 0x7f800000u) == 0x7f800000u;", "acc += (u[i] & 0x7fffffffu) == 0x7f800000u;",
           CPU_NONFINITE,
           "all_finite counts only infinities: a hoisted NaN (Inf in x against a bias) is kept where "
           "F.linear gives +-Inf"),
    Mutant("c6-fp-modes-take-fused-route", "csrc/cpu/qmm.cpp",
           "  if (a.mode != Mode::kAffine) return Route::kGemm;\n", "", CPU_FP_ROUTES,
           "fp-mode calls the chunk kernels do not serve go to the affine fused kernels (M < 16), which "
           "read uint8 scale codes as floats and codes as integers"),
    Mutant("c6-decode-2bit-second-word-offset", "csrc/cpu/decode.h",
           "v1 = codes_to_float((i32x16)((splat_u32(p + 4) >> sh) & 3u));",
           "v1 = codes_to_float((i32x16)((splat_u32(p + 2) >> sh) & 3u));", CPU,
           "the 2-bit block decoder reads codes 16..31 from byte 2 (16 bits in) instead of byte 4"),
]
