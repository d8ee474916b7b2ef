"""A fourth independent audit list (python -m tests.mutation --fresh4): realistic single bugs written
from the product sources alone (csrc/, metal/, torch_qmm/), by someone who had not read the tests,
in code the first three lists touch least: the small-M and gather kernels' indexing, the mma
fragment layout, the quantize kernels' edge cases, the GGUF decoders (Metal and interop), the
planner's grid for gather, the gather index checks and broadcasting, the CPU fused / gemm / gather
kernels' row, column and expert offsets, the activation-quantization switch, autograd's broadcast,
the format state, the MLX writer's per-layer config and the experts' names.

Selections are a few test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 4")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

METAL_SMALL = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_MMA = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py")
METAL_GATHER = _files("tests/test_metal_gather.py", "tests/test_routes_metal.py")
METAL_QUANT = _files("tests/test_metal_ops.py", "tests/test_metal_edges.py", "tests/test_routes_metal.py")
METAL_FP = _files("tests/test_metal_fp.py", "tests/test_metal_edges.py")
METAL_GGUF = _files("tests/test_metal_gguf.py", "tests/test_routes_metal.py")
PLAN = _files("tests/test_metal_plan.py", "tests/test_metal_gather.py", "tests/test_routes_metal.py")
GATHER_CHECKS = _files("tests/test_gather_qmm.py", "tests/test_errors.py", "tests/test_hardening_ops.py")
GGUF_CHECKS = _files("tests/test_gguf_qmm.py", "tests/test_errors.py", "tests/test_hardening_ops.py")
FORMATS = _files("tests/test_mode_defaults.py", "tests/test_spec_ops.py", "tests/test_nn.py")
CPU = _files("tests/test_routes_cpu.py", "tests/test_cpu_kernels.py", "tests/test_qmm.py")
CPU_GATHER = _files("tests/test_gather_qmm.py", "tests/test_nn_moe.py")
ACTIVATIONS = _files("tests/test_cpu_actq.py", "tests/test_qmm.py")
GRAD = _files("tests/test_gather_qmm.py", "tests/test_nn_moe.py", "tests/test_regressions.py")
NN = _files("tests/test_nn.py", "tests/test_nn_dtypes.py", "tests/test_errors.py")
STATE = _files("tests/test_format_state.py", "tests/test_nn.py")
MLX = _files("tests/test_interop_mlx.py", "tests/test_interop_mlx_lm.py")
GGUF_INTEROP = _files("tests/test_interop_gguf.py", "tests/test_interop_gguf_q4k_affine.py")
MOE_MLX = _files("tests/test_moe_mlx_lm.py", "tests/test_moe_models.py")
TRANSFORMERS = _files("tests/test_interop_transformers.py")

MUTANTS: list[Mutant] = [
    # ---- Metal kernels (no rebuild) -------------------------------------------------------------
    Mutant("m4-small-scale-of-block-start", "metal/quant_qmm_small.h",
           "s[r] = F::scale(scales, n * groups + k / G);", "s[r] = F::scale(scales, n * groups + k0 / G);",
           METAL_SMALL,
           "bm2/4/8 (and gather_qmv) read the scale of the K-block's first group for every lane: wrong "
           "wherever a 256-value block spans several groups"),
    Mutant("m4-mma-frag-column-step", "metal/mma_tile.h",
           "(qid & 2) * 2 + (lane % 2) * 2", "(qid & 2) * 2 + (lane % 2)", METAL_MMA,
           "the 8x8 fragment's column of a lane drops the factor 2 (two elements per lane)"),
    Mutant("m4-gather-biases-of-expert-0", "metal/quant_gather.h",
           "F::HAS_BIAS ? biases + e * (codes / F::G) : biases", "biases", METAL_GATHER,
           "every expert reads expert 0's biases (scales and codes are offset, the biases are not)"),
    Mutant("m4-gather-qmv-run-drops-last-pair", "metal/quant_gather.h",
           "rows{lhs, order, p.M, i * p.M, end * p.M}", "rows{lhs, order, p.M, i * p.M, (end - 1) * p.M}",
           METAL_GATHER, "a run's live rows stop one pair early: the last pair of each expert run is not written"),
    Mutant("m4-gather-x-row-ignores-order", "metal/row_map.h",
           "uint(lhs[order[r / M]]) * M + r % M", "uint(lhs[r / M]) * M + r % M", METAL_GATHER,
           "the x row of a gathered row uses the pair's sorted position, not the pair: wrong when the "
           "pairs were reordered by expert"),
    Mutant("m4-gather-mma-run-end-not-pair-aligned", "metal/quant_gather.h",
           "uint hi = (lo / M + 1) * M;", "uint hi = lo + M;", METAL_GATHER,
           "a run that starts inside a pair (a 32-row tile boundary, M not dividing 32) ends M rows later "
           "instead of at the pair's end"),
    Mutant("m4-affine-quantize-tie-takes-min", "metal/quant_format.h",
           "abs(w_min) > abs(w_max)", "abs(w_min) >= abs(w_max)", METAL_QUANT,
           "|min| == |max|: MLX keeps max as the exact edge; this keeps min (other scale sign and bias)"),
    Mutant("m4-affine-quantize-scale-floor-dropped", "metal/quant_format.h",
           "max((w_max - w_min) / n_bins, 1e-7f)", "((w_max - w_min) / n_bins)", METAL_QUANT,
           "a constant group gets scale 0: edge / 0 and 0 / 0 instead of MLX's 1e-7 floor"),
    Mutant("m4-decode8-reads-a-byte-past-the-unit", "metal/quant_format.h",
           "const int last = (bit0 + 4 * bits - 1) / 8;", "const int last = (bit0 + 4 * bits) / 8;", METAL_QUANT,
           "3/5/6-bit halves read one byte more than the unit (past the buffer for the last unit); the "
           "values are masked, so only checked mode can see it"),
    Mutant("m4-e4m3-exponent-bias-off-by-one", "metal/quant_format.h",
           "((e + 120u) << 23)", "((e + 121u) << 23)", METAL_FP,
           "every normal e4m3 value (nvfp4 scales, mxfp8 elements) decodes twice too large"),
    Mutant("m4-fp-amax-without-abs", "metal/quant_format.h",
           "amax = max(amax, fabs(float(src[j])))", "amax = max(amax, float(src[j]))", METAL_FP,
           "the fp quantizers' group maximum ignores negative weights: a group whose largest magnitude is "
           "negative gets too small a scale (its codes saturate)"),
    Mutant("m4-quantize-group-word-offset-int-division", "metal/quant_quantize.h",
           "g * (G * bits / 32)", "g * (G / 32 * bits)", METAL_FP + METAL_QUANT,
           "group_size 16 (nvfp4): G / 32 == 0, so every group of a row writes its words at the row's start"),
    Mutant("m4-q4k-scale-min-branch-at-4", "metal/gguf_format.h",
           "if (j < 4) {", "if (j <= 4) {", METAL_GGUF,
           "Q4_K sub-block 4 reads its 6-bit scale/min like sub-blocks 0-3 (bytes 4 and 8, no high bits)"),
    Mutant("m4-q6k-slice-high-bits-shift", "metal/gguf_qmm.h",
           "((lo >> (8 * i + lo_shift)) & 0xfu) | (((hi >> (8 * i + 2 * t)) & 0x3u) << 4);",
           "((lo >> (8 * i + lo_shift)) & 0xfu) | (((hi >> (8 * i + t)) & 0x3u) << 4);", METAL_GGUF,
           "the qmv / bm Q6_K slice takes the 2 high bits of quarter t at bit t instead of 2t"),
    Mutant("m4-gguf-run-dot-min-added", "metal/gguf_qmm.h",
           "s.scale[j] * dot - s.min[j] * xsum", "s.scale[j] * dot + s.min[j] * xsum", METAL_GGUF,
           "Q4_K's factored sub-block dot adds the min term instead of subtracting it (qmv / bm routes)"),
    Mutant("m4-q6k-mma-half-by-parity", "metal/gguf_mma.h",
           "(lo >> (8 * i + 4 * (t / 2)))", "(lo >> (8 * i + 4 * (t % 2)))", METAL_GGUF,
           "the mma32 Q6_K loader picks the low/high nibble by t % 2 instead of t / 2"),
    # ---- planner (csrc/plan.cpp, --cpp) ---------------------------------------------------------
    Mutant("p4-plan-gather-tiles-by-m", "csrc/plan.cpp",
           "const int64_t rows = p.op == Op::kGatherQmm ? p.pairs * p.M : p.M;", "const int64_t rows = p.M;",
           PLAN, "the gather mma grids cover M rows instead of pairs * M: rows past the first tile not computed"),
    # ---- validation (csrc/validate.cpp, gguf_validate.cpp, format_spec.cpp, --cpp) ----------------
    Mutant("v4-gather-index-limit-inclusive", "csrc/validate.cpp",
           "TORCH_CHECK_VALUE(lo >= 0 && hi < limit,", "TORCH_CHECK_VALUE(lo >= 0 && hi <= limit,", GATHER_CHECKS,
           "an index equal to the number of matrices passes the range check (reads one matrix past the end)"),
    Mutant("v4-gather-broadcast-takes-the-1", "csrc/validate.cpp",
           "} else if (TORCH_GUARD_SIZE_OBLIVIOUS(db.sym_eq(1))) {\n      batch[i] = da;",
           "} else if (TORCH_GUARD_SIZE_OBLIVIOUS(db.sym_eq(1))) {\n      batch[i] = db;", GATHER_CHECKS,
           "lhs [P] against rhs [1]: the broadcast batch dimension is taken as 1"),
    Mutant("v4-gather-uint32-indices-refused", "csrc/validate.cpp",
           "d == at::kInt || d == at::kLong || d == at::kUInt32", "d == at::kInt || d == at::kLong", GATHER_CHECKS,
           "uint32 indices (MLX's dtype) refused"),
    Mutant("v4-gather-x-one-dimension-accepted", "csrc/validate.cpp",
           "TORCH_CHECK_VALUE(x.dim() >= 2, op, \": argument 'x' must have at least 2 dimensions",
           "TORCH_CHECK_VALUE(x.dim() >= 1, op, \": argument 'x' must have at least 2 dimensions", GATHER_CHECKS,
           "gather_qmm's x [K] passes the rank check (M is then read from a dimension that does not exist)"),
    Mutant("v4-gguf-row-bytes-unchecked", "csrc/gguf_validate.cpp",
           "blocks.dim() == 2 && blocks.sym_size(0) == N && blocks.sym_size(1) == row_bytes",
           "blocks.dim() == 2 && blocks.sym_size(0) == N", GGUF_CHECKS,
           "blocks with the wrong bytes per row (another type's block size, or K) reach the kernel"),
    Mutant("v4-format-affine-default-group-32", "csrc/format_spec.cpp",
           "{{32, 64, 128}, 3}, 4,  64, 0.0f}", "{{32, 64, 128}, 3}, 4,  32, 0.0f}", FORMATS,
           "affine's default group size in the format table is 32 instead of MLX's 64"),
    # ---- CPU kernels (--cpp) ---------------------------------------------------------------------
    Mutant("c4-fused-hoisted-xsum-of-row-0", "csrc/cpu/qmm_fused.cpp",
           "    xsum += m0 * groups;\n", "", CPU,
           "the M=1 hoisted tile used for the last row (M % 4 == 1, M >= 5) takes row 0's group sums"),
    Mutant("c4-n-fused-full-span-boundary", "csrc/cpu/qmm_fused.cpp",
           "if (c0 + 64 <= a.N)", "if (c0 + 64 < a.N)", CPU,
           "transpose=False: a last span of exactly 64 columns is run as a 32-column one"),
    Mutant("c4-nspan-codec-order-ignored", "csrc/cpu/qmm_fused.cpp",
           "yr[32 * j + Blk::natural(h, l)] = lanes[h][l];", "yr[32 * j + 16 * h + l] = lanes[h][l];", CPU,
           "transpose=False fused: 4-bit columns stored in decode order (even/odd interleave) not natural order"),
    Mutant("c4-n-gemm-rows-as-k", "csrc/cpu/qmm_gemm.cpp",
           "decode(a.N, k0, kk, n0, nn, scratch.data());", "decode(a.K, k0, kk, n0, nn, scratch.data());", CPU,
           "transpose=False gemm decodes W [K, N] with K as the packed row length (right only when K == N)"),
    Mutant("c4-hsum16-drops-two-lanes", "csrc/cpu/decode.h",
           "for (int i = 0; i < 4; ++i) s8[i] += s8[i + 4];", "for (int i = 0; i < 3; ++i) s8[i] += s8[i + 4];",
           CPU, "the horizontal sum leaves out lanes 7 and 15"),
    Mutant("c4-gather-scatter-ignores-order", "csrc/cpu/gather_qmm.cpp",
           "std::memcpy(yp + (c.order[g.start + j] * M + m) * N + n0,",
           "std::memcpy(yp + ((g.start + j) * M + m) * N + n0,", CPU_GATHER,
           "results written in the expert-sorted order instead of back to their pairs (unsorted rhs)"),
    Mutant("c4-gather-lhs-not-reordered", "csrc/cpu/gather_qmm.cpp",
           "lhs_sorted[j] = lp[c.order[j]];", "lhs_sorted[j] = lp[j];", CPU_GATHER,
           "x rows gathered in pair order while the pairs are processed in expert order"),
    Mutant("c4-gather-biases-of-expert-0", "csrc/cpu/gather_qmm.cpp",
           "a.biases = bp ? bp + r0 * c.srow_bytes : nullptr;", "a.biases = bp;", CPU_GATHER,
           "every expert (and N slice) reads the biases of expert 0's first rows"),
    # ---- Python ops and modules (no rebuild) ---------------------------------------------------
    Mutant("p4-int8-setting-applies-to-transpose-false", "torch_qmm/ops.py",
           'applies = mode == "affine" and transpose and x.device.type == "cpu"',
           'applies = mode == "affine" and x.device.type == "cpu"', ACTIVATIONS,
           "inside activation_quantization('int8'), a transpose=False call raises instead of running exactly"),
    Mutant("p4-gather-backward-no-broadcast", "torch_qmm/ops.py",
           "    lhs, rhs = torch.broadcast_tensors(lhs, rhs)\n", "", GRAD,
           "gather_qmm's backward uses lhs / rhs unbroadcast: wrong or failing when one index is broadcast"),
    Mutant("p4-nn-cols-multiple-unchecked", "torch_qmm/nn.py",
           "    if cols % group_size != 0:\n        raise ValueError(",
           "    if False:\n        raise ValueError(", NN,
           "QuantLinear(in_features not a multiple of group_size) is built (fewer groups) instead of refused"),
    Mutant("p4-state-mode-not-compared", "torch_qmm/format_state.py",
           "        if values != self.format_values():", "        if values[:2] != self.format_values()[:2]:",
           STATE, "a state of another mode with the same bits and group size loads"),
    # ---- interop (no rebuild) --------------------------------------------------------------------
    Mutant("i4-mlx-config-overrides-dropped", "torch_qmm/interop/mlx.py",
           "        elif s != default:\n            q[name] = s.as_dict()\n", "", MLX,
           "save_mlx's config gives only the most common format: layers of another format are read with it"),
    Mutant("i4-mlx-scales-shape-unchecked", "torch_qmm/interop/mlx.py",
           "if got_w != want_w or any(shape != want_s for shape in got.values()):", "if got_w != want_w:", MLX,
           "a checkpoint whose scales / biases have the wrong shape gets past the check (copy_ fails later "
           "with a RuntimeError, or broadcasts)"),
    Mutant("i4-gguf-pack-bits-big-endian", "torch_qmm/interop/gguf.py",
           'axis=1, bitorder="little")', 'axis=1, bitorder="big")', GGUF_INTEROP,
           "to_affine packs the 5-bit codes (Q5_0 / Q5_1) most significant bit first"),
    Mutant("i4-gguf-q4k-scale-high-bits-unshifted", "torch_qmm/interop/gguf.py",
           "(mix & 0x0F) | ((lo >> 2) & 0x30)", "(mix & 0x0F) | (lo >> 6)", GGUF_INTEROP,
           "q4_k_to_affine: sub-blocks 4-7 take the 2 high scale bits as bits 0-1 instead of 4-5"),
    Mutant("i4-experts-spec-down-as-gate-up", "torch_qmm/interop/mlx_experts.py",
           'layer = m.down_proj if proj == "down_proj" else m.gate_up_proj', "layer = m.gate_up_proj", MOE_MLX,
           "the saved config gives down_proj gate_up's format (wrong when they differ)"),
    Mutant("i4-split-experts-gate-up-swapped", "torch_qmm/interop/mlx_experts.py",
           'out[f"{prefix}.gate_proj.{name}"], out[f"{prefix}.up_proj.{name}"] = gate.contiguous(), up.contiguous()',
           'out[f"{prefix}.gate_proj.{name}"], out[f"{prefix}.up_proj.{name}"] = up.contiguous(), gate.contiguous()',
           MOE_MLX, "the quantized experts' gate and up rows saved under each other's names"),
    Mutant("i4-transformers-indivisible-layers-kept", "torch_qmm/interop/transformers.py",
           "if type(m) is nn.Linear and not _skipped(name, skip) and m.in_features % gs == 0",
           "if type(m) is nn.Linear and not _skipped(name, skip)", TRANSFORMERS,
           "a linear whose in_features is not a multiple of group_size is chosen for quantization (refused then)"),
]
