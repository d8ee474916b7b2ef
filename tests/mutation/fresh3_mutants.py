"""A third independent audit list (python -m tests.mutation --fresh3): realistic single bugs written
from the product code alone, before reading any test, in the parts the first two lists reached
least: the argument checks and the format table (csrc/validate.cpp, format_spec.cpp), the fp
codecs (csrc/fp_codec.h and their Metal twins in metal/quant_format.h), the planner's routes and
grids (csrc/plan.cpp), the kernels' edge handling (non-finite fallbacks, bounds of the last row
or unit), the Python wrappers and modules (ops.py, nn.py, format_state.py), the MLX reader and
writer's fp modes, the quantizers, the tolerance rule and the selftest. As in the earlier lists
the test selections are whole files chosen by their names, not the tests meant to catch each bug:
the question is whether the suite as a whole kills them. Results: tests/mutation/README.md."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

VALIDATE = _files("tests/test_errors.py", "tests/test_spec_errors.py", "tests/test_hardening_ops.py",
                  "tests/test_fakes.py", "tests/test_spec_ops.py", "tests/test_qmm.py")
FORMATS = _files("tests/test_spec_ops.py", "tests/test_spec_errors.py", "tests/test_errors.py", "tests/test_fp_modes.py",
                 "tests/test_nn.py")
FP_CPU = _files("tests/test_fp_modes.py", "tests/test_reference_fp.py", "tests/test_cpu_fp_chunked.py",
                "tests/test_cpu_mxfp8_chunked.py", "tests/test_spec_ops.py")
FP_METAL = _files("tests/test_metal_edges.py", "tests/test_metal_fp.py", "tests/test_fp_modes.py", "tests/test_routes_metal.py")
PLAN = _files("tests/test_metal_plan.py", "tests/test_routes_metal.py", "tests/test_metal_gguf.py",
              "tests/test_metal_ops.py", "tests/test_metal_fp.py")
METAL = _files("tests/test_metal_edges.py", "tests/test_metal_ops.py", "tests/test_routes_metal.py", "tests/test_metal_fp.py",
               "tests/test_metal_gguf.py", "tests/test_metal_plan.py")
OPS = _files("tests/test_mode_defaults.py", "tests/test_regressions.py", "tests/test_qmm.py", "tests/test_fp_modes.py", "tests/test_spec_ops.py",
             "tests/test_errors.py", "tests/test_hardening_ops.py", "tests/test_compile.py")
NN = _files("tests/test_format_state.py", "tests/test_nn_dtypes.py", "tests/test_nn.py", "tests/test_regressions.py",
            "tests/test_hardening_ops.py", "tests/test_fp_modes.py",
            "tests/test_interop_transformers.py")
MLX = _files("tests/test_interop_mlx.py", "tests/test_interop_mlx_lm.py", "tests/test_interop_cli.py",
             "tests/test_cli_convert.py", "tests/test_hostile_files.py")
QUANT = _files("tests/test_quantizers.py", "tests/test_quantize.py")
TOLERANCE = _files("tests/test_tolerance_precision.py", "tests/test_tolerance.py", "tests/test_qmm.py", "tests/test_routes_cpu.py")
SELFTEST = _files("tests/test_selftest_strict.py", "tests/test_selftest.py")

MUTANTS: list[Mutant] = [
    # ---- C++ argument checks (csrc/validate.cpp, --cpp) -----------------------------------------
    Mutant("v3-validate-whole-groups-dropped", "csrc/validate.cpp",
           "words * 32 % bits == 0 && cols % group_size == 0", "words * 32 % bits == 0", VALIDATE,
           "wq whose rows are not a whole number of groups: the scales shape check then compares "
           "against cols / group_size rounded down"),
    Mutant("v3-validate-quantize-k-multiple-dropped", "csrc/validate.cpp",
           "  TORCH_CHECK_VALUE(K % group_size == 0, op, \": the last dimension of 'w' (K=\", K,",
           "  TORCH_CHECK_VALUE(true, op, \": the last dimension of 'w' (K=\", K,", VALIDATE,
           "quantize accepts K not a multiple of group_size (the tail group is dropped or read out of bounds)"),
    Mutant("v3-validate-x-device-dropped", "csrc/validate.cpp",
           "  TORCH_CHECK_VALUE(x.device() == wq.device(), op,", "  TORCH_CHECK_VALUE(true, op,", VALIDATE,
           "x on another device than the packed weights reaches the kernel"),
    Mutant("v3-validate-fp-dequantize-default-float32", "csrc/validate.cpp",
           "scales.scalar_type() : at::kBFloat16;", "scales.scalar_type() : at::kFloat;", FORMATS + FP_CPU,
           "dequantize of an fp mode without dtype returns float32 instead of MLX's bfloat16"),
    Mutant("v3-validate-biases-dtype-dropped", "csrc/validate.cpp",
           "    TORCH_CHECK_TYPE(biases->scalar_type() == scales.scalar_type(), op,",
           "    TORCH_CHECK_TYPE(true, op,", VALIDATE,
           "biases of another dtype than scales are read as the scales' dtype"),
    Mutant("v3-validate-wq-3d-accepted", "csrc/validate.cpp",
           "  TORCH_CHECK_VALUE(wq.dim() == 2, op,", "  TORCH_CHECK_VALUE(wq.dim() >= 2, op,", VALIDATE,
           "a 3-D wq passes the rank check (its first two sizes are taken as rows and words)"),
    # ---- C++ format table (csrc/format_spec.cpp, --cpp) -----------------------------------------
    Mutant("v3-format-affine-group-128-dropped", "csrc/format_spec.cpp",
           "{{32, 64, 128}, 3}", "{{32, 64, 128}, 2}", FORMATS,
           "the count of affine group sizes is one short: group_size=128 is refused"),
    Mutant("v3-format-nvfp4-default-group-32", "csrc/format_spec.cpp",
           "4,  16, 6.0f}", "4,  32, 6.0f}", FORMATS + FP_CPU,
           "nvfp4's default group size is mxfp4's 32 (not an allowed nvfp4 size)"),
    Mutant("v3-format-mxfp8-element-max-e5m2", "csrc/format_spec.cpp",
           "8,  32, 448.0f}", "8,  32, 57344.0f}", FP_CPU,
           "mxfp8's scale divides amax by e5m2's max: the scales come out 2^7 too small"),
    # ---- C++ fp codecs (csrc/fp_codec.h, --cpp) -------------------------------------------------
    Mutant("v3-fp-e4m3-subnormal-threshold", "csrc/fp_codec.h",
           "  if (a < 0x1p-6f) return", "  if (a < 0x1p-7f) return", FP_CPU,
           "values in [2^-7, 2^-6) take the normal-number encoding: wrong codes for small nvfp4 scales"),
    Mutant("v3-fp-e2m1-value-sign-dropped", "csrc/fp_codec.h",
           "inline float e2m1_value(uint32_t code) { return kE2M1Values[code & 15u]; }",
           "inline float e2m1_value(uint32_t code) { return kE2M1Values[code & 7u]; }", FP_CPU,
           "e2m1 decodes every negative code as its magnitude"),
    Mutant("v3-fp-e8m0-zero-scale-code-0", "csrc/fp_codec.h",
           "  if (!(s > 0.0f)) return 0;", "  if (!(s > 0.0f)) return -127;", FP_CPU,
           "an all-zero group gets scale code 0 (2^-127) instead of 127 (2^0)"),
    Mutant("v3-fp-e4m3-subnormal-decode", "csrc/fp_codec.h",
           "e == 0 ? std::ldexp(float(m), -9)", "e == 0 ? std::ldexp(float(m), -10)", FP_CPU,
           "e4m3 subnormal codes decode at half their value"),
    # ---- C++ planner (csrc/plan.cpp, --cpp) ------------------------------------------------------
    Mutant("v3-plan-qvm-takes-m4", "csrc/plan.cpp",
           '{"qvm_bounded", Op::kQmm, kQuantModes, 0, 1, 3,', '{"qvm_bounded", Op::kQmm, kQuantModes, 0, 1, 4,', PLAN,
           "transpose=False M=4 goes to qvm instead of the mma32 tile (results right, route wrong)"),
    Mutant("v3-plan-gguf-bm8-stops-at-8", "csrc/plan.cpp",
           '{"gguf_qmm_bm8", Op::kGgufQmm, kGgufTypes, -1, 5, 16,', '{"gguf_qmm_bm8", Op::kGgufQmm, kGgufTypes, -1, 5, 8,',
           PLAN, "gguf_qmm with 9 <= M <= 16 has no route (the table has a gap)"),
    Mutant("v3-plan-elementwise-grid-floor", "csrc/plan.cpp",
           "    l.threadgroups = {ceil_div(p.N * (p.K / values), g.threads), 1, 1};",
           "    l.threadgroups = {uint32_t(p.N * (p.K / values) / g.threads), 1, 1};", PLAN,
           "quantize / dequantize grids rounded down: the last partial threadgroup's units are never written"),
    Mutant("v3-plan-tiled-grid-y-by-cols", "csrc/plan.cpp",
           "ceil_div(std::max<int64_t>(rows, 1), g.rows)", "ceil_div(std::max<int64_t>(rows, 1), g.cols)", PLAN,
           "the row grid divides M by the tile's column count: rows past the first block of a route "
           "whose tile has fewer rows than columns are never computed"),
    Mutant("v3-plan-u32-mn-unchecked", "csrc/plan.cpp",
           '    counts.push_back({"y", "M * N", {p.M, p.N}});\n', "", OPS,
           "M*N past 2^32 is planned: the kernels' 32-bit output index wraps"),
    # ---- Metal fp codecs and policies (metal/quant_format.h) -------------------------------------
    Mutant("m3-e4m3-encode-truncates", "metal/quant_format.h",
           "  return sign | uint((e + 7) * 8 + int(rint(frac * 8.0f)));",
           "  return sign | uint((e + 7) * 8 + int(floor(frac * 8.0f)));", FP_METAL,
           "Metal's e4m3 encoder truncates the mantissa instead of rounding to nearest even"),
    Mutant("m3-e8m0-code0-decodes-zero", "metal/quant_format.h",
           "return b == 0 ? as_type<float>(0x00400000u) : as_type<float>(b << 23); }",
           "return b == 0 ? 0.0f : as_type<float>(b << 23); }", FP_METAL,
           "scale code 0 (2^-127, a float32 subnormal) decodes as 0"),
    Mutant("m3-ceil-log2-subnormal-bias-lost", "metal/quant_format.h",
           "    bias = 64;\n", "    bias = 0;\n", FP_METAL,
           "a subnormal amax/element_max (float32 weights near 1e-38) gets an exponent 64 too large"),
    Mutant("m3-ceil-log2-power-of-two-rounds-up", "metal/quant_format.h",
           "  return ((bits & 0x7fffffu) ? e + 1 : e) - bias;", "  return e + 1 - bias;", FP_METAL,
           "an exact power-of-two amax/element_max gets the next exponent (every element halved)"),
    Mutant("m3-nvfp4-distances-in-t", "metal/quant_format.h",
           "                       : scale_kind == FP_SCALE_E4M3 ? e2m1_encode<float>(q)",
           "                       : scale_kind == FP_SCALE_E4M3 ? e2m1_encode<T>(q)", FP_METAL,
           "nvfp4 measures e2m1 distances in T like mxfp4 (MLX uses float32 for nvfp4)"),
    Mutant("m3-fp-scale-not-rounded-to-t", "metal/quant_format.h",
           "    const float s = float(static_cast<T>(amax / float(ELEMENT_MAX)));",
           "    const float s = amax / float(ELEMENT_MAX);", FP_METAL,
           "the group scale amax/element_max is not rounded to T before its exponent / e4m3 code is taken"),
    Mutant("m3-fp-dequantize-e8m0-unrounded", "metal/quant_format.h",
           "float(static_cast<T>(e8m0_value(scales[g])))", "e8m0_value(scales[g])", FP_METAL,
           "dequantize uses the float32 e8m0 scale, not MLX's scale rounded to T (float16 tiny/huge scales)"),
    Mutant("m3-fp-quotient-unrounded", "metal/quant_format.h",
           "        const float q = float(static_cast<T>(float(src[w * PER_WORD + i]) / divisor));",
           "        const float q = float(src[w * PER_WORD + i]) / divisor;", FP_METAL,
           "the quotient w / scale is not rounded to T before it is encoded. Equivalent as far as searched: "
           "e8m0 divisors are powers of two (exact quotients), and for nvfp4 no float16/bfloat16 weight and "
           "e4m3 divisor in 0.5625..1.875 gives a different e2m1 code (tests/mutation/README.md)"),
    Mutant("m3-e4m3-nan-code-decodes-finite", "metal/quant_format.h",
           "  if ((c & 0x7fu) == 0x7fu) v = as_type<float>(0x7fc00000u);\n", "", FP_METAL,
           "e4m3 code 0x7F decodes as 480 instead of NaN"),
    # ---- Metal kernel edges -----------------------------------------------------------------------
    Mutant("m3-qmv-bounded-writes-past-n", "metal/quant_qmv.h",
           "    if (lane == 0 && (!bounded || n < N)) y[n] = static_cast<T>(sum);",
           "    if (lane == 0) y[n] = static_cast<T>(sum);", METAL,
           "qmv_bounded writes the rows past N of the last threadgroup"),
    Mutant("m3-qdot-no-fallback", "metal/quant_common.h",
           "  return isfinite(hoisted) ? hoisted : qdot_by_weight<F, T, n>(w, x, s, b);", "  return hoisted;", METAL,
           "qmv returns the hoisted s*acc + b*xsum even when it overflows (inf - inf = NaN where the "
           "per-weight sum is finite)"),
    Mutant("m3-group-dot8-fallback-drops-bias", "metal/quant_common.h",
           "  for (int i = 0; i < 8; ++i) acc += F::weight(s, q[i], b) * x[i];",
           "  for (int i = 0; i < 8; ++i) acc += s * q[i] * x[i];", METAL,
           "the small-M kernels' non-finite fallback leaves out the bias"),
    Mutant("m3-qvm-fallback-bsum-kept", "metal/quant_qvm.h",
           "      bsum = 0.0f;\n      for (uint k = simd_gid; k < K; k += QVM_SIMDGROUPS) {",
           "      for (uint k = simd_gid; k < K; k += QVM_SIMDGROUPS) {", METAL,
           "qvm's non-finite fallback adds the hoisted bias sum on top of the per-weight sums"),
    Mutant("m3-dequantize-last-unit-past-end", "metal/quant_quantize.h",
           "  if (u >= N * units_per_row) return;", "  if (u > N * units_per_row) return;", METAL,
           "the dequantize thread one past the last unit writes out of bounds"),
    # ---- Python wrappers (torch_qmm/ops.py) -------------------------------------------------------
    Mutant("p3-ops-default-group-size-affine", "torch_qmm/ops.py",
           "f.default_group_size if group_size is None else group_size)",
           "64 if group_size is None else group_size)", OPS,
           "every mode's default group size is affine's 64 (mxfp4 / nvfp4 calls without group_size refused)"),
    Mutant("p3-ops-dequantize-grad-unregistered", "torch_qmm/ops.py",
           'torch.library.register_autograd("torch_qmm::dequantize", _refuse_backward("dequantize", "\'scales\' or \'biases\'"))\n',
           "", OPS, "dequantize of scales that require grad gives no gradient silently instead of the clear error"),
    # ---- Modules (torch_qmm/nn.py, format_state.py) ------------------------------------------------
    Mutant("p3-nn-dtype-unchecked", "torch_qmm/nn.py",
           "    if dtype not in SUPPORTED_DTYPES:", "    if dtype is None:", NN,
           "QuantLinear(dtype=torch.float64) builds float64 buffers the ops refuse later"),
    Mutant("p3-nn-from-linear-dtype-float32", "torch_qmm/nn.py",
           "    dtype = dtype or weight.dtype\n", "    dtype = dtype or torch.float32\n", NN,
           "from_linear of a float16 / bfloat16 layer makes a float32 module"),
    Mutant("p3-nn-load-weight-not-cast", "torch_qmm/nn.py",
           "            weight.detach().to(dtype), group_size=module.group_size,",
           "            weight.detach(), group_size=module.group_size,", NN,
           "from_linear(dtype=float16) of a float32 layer quantizes the float32 weights (different codes "
           "and scales than MLX quantizing the float16 weights)"),
    Mutant("p3-format-state-bool-accepted", "torch_qmm/format_state.py",
           "                and not state.is_floating_point() and not state.is_complex() and state.dtype != torch.bool):",
           "                and not state.is_floating_point() and not state.is_complex()):", NN,
           "a bool format state is read as 0/1 values instead of refused as not an integer tensor; no "
           "format has bits and group_size in {0, 1}, so it is still refused, by the 'state holds' message: "
           "only the message tells the two apart"),
    Mutant("p3-format-state-zero-code-invalid", "torch_qmm/format_state.py",
           "    if not all(0 <= c < 128 for c in codes):", "    if not all(0 < c < 128 for c in codes):", NN,
           "the zero padding of a mode name counts as a non-ASCII code: every fp state is described as codes"),
    Mutant("p3-format-state-name-8-chars-refused", "torch_qmm/format_state.py",
           "    if len(codes) > _MODE_CHARS:", "    if len(codes) >= _MODE_CHARS:", NN,
           "a mode name of exactly 8 characters is refused; no shipped mode has 8 characters (the longest, "
           "'affine', has 6), so through the modules this is equivalent; quant_state_values called directly "
           "tells it apart"),
    # ---- MLX reader / writer, fp modes (torch_qmm/interop/mlx.py) ---------------------------------
    Mutant("p3-mlx-fp-scales-dtype-unchecked", "torch_qmm/interop/mlx.py",
           '        if not spec.has_biases and stored != "U8":', '        if False:', MLX,
           "fp-mode scales stored as float are copied into the uint8 codes (cast) instead of refused"),
    Mutant("p3-mlx-fp-biases-ignored", "torch_qmm/interop/mlx.py",
           '        if not spec.has_biases and f"{p}.biases" in ckpt:', '        if False:', MLX,
           "an fp layer that stores biases (a config that forgot mode: affine) loads without them"),
    Mutant("p3-mlx-config-mode-dropped", "torch_qmm/interop/mlx.py",
           '        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}',
           '        return {"group_size": self.group_size, "bits": self.bits}', MLX,
           "saved configs carry no mode: MLX reads an mxfp4 model as affine"),
    # ---- Quantizers ---------------------------------------------------------------------------------
    Mutant("p3-mse-clip-bottom-unshrunk", "torch_qmm/quantizers/mse.py",
           "        consider((hi - lo) * ratio / levels(bits), lo * ratio)",
           "        consider((hi - lo) * ratio / levels(bits), lo)", QUANT,
           "the clipping search shrinks only the top of the range"),
    Mutant("p3-awq-no-alpha-zero", "torch_qmm/quantizers/awq.py",
           "ALPHAS = tuple(i / 20 for i in range(20))", "ALPHAS = tuple(i / 20 for i in range(1, 20))", QUANT,
           "AWQ's grid lacks alpha = 0 (no scaling), so it can end worse than round-to-nearest"),
    Mutant("p3-awq-fold-rows-bias-kept", "torch_qmm/quantizers/awq.py",
           "        if prev.bias is not None:\n            prev.bias.div_(s.to(prev.bias.dtype))\n", "", QUANT,
           "folding 1/s into the previous linear's rows leaves its bias unscaled"),
    # ---- Tolerance rule (torch_qmm/tolerance.py) ----------------------------------------------------
    Mutant("p3-tolerance-bf16-whole-ulp", "torch_qmm/tolerance.py",
           "torch.bfloat16: 2**-8}", "torch.bfloat16: 2**-7}", TOLERANCE,
           "bfloat16's output rounding allowed a whole ulp: truncation passes"),
    Mutant("p3-tolerance-highest-loose", "torch_qmm/tolerance.py",
           '"highest": 0.0,', '"highest": 2**-16,', TOLERANCE,
           "full float32 precision allowed the error of x rounded to two bfloat16 terms"),
    # ---- Selftest (torch_qmm/selftest.py) ----------------------------------------------------------
    Mutant("p3-selftest-biases-unchecked", "torch_qmm/selftest.py",
           "and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]))",
           "and torch.equal(got[1], want[1]))", SELFTEST,
           "selftest's quantize cases pass with wrong biases"),
    Mutant("p3-selftest-route-unchecked", "torch_qmm/selftest.py",
           "            if ran != [case.route]:", "            if not ran:", SELFTEST,
           "selftest on metalsim accepts a case that ran another route than planned"),
    Mutant("p3-selftest-fp-dequantize-close", "torch_qmm/selftest.py",
           "        case.ok = got.dtype == dtype and torch.equal(got, want)",
           "        case.ok = got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=1e-2)", SELFTEST,
           "selftest's fp dequantize cases accept errors of 1% instead of requiring bit-exact results"),
]
