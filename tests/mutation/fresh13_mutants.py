"""Audit list 13: 21 Python mutants written from the product sources alone (torch_qmm/; by someone
who had not read the tests that cover them), in four files no earlier list had touched: the float64
reference of the fp modes (reference_fp.py, 9: the e2m1 distances, the e4m3 saturation and NaN
bytes, the e8m0 exponent of a power of two and its wrap, nvfp4's global scale and quotient
rounding, the dequantized e8m0 scale's rounding, the magnitude of the terms), the tensor-parallel
styles (distributed/styles.py, 5: the rows of a row-split QuantEmbedding, the ids check against the
whole table, GGUFLinear's rowwise unit, the gradient sum of ReplicatedGradAllReduce), the fused
experts of transformers' MoE models (interop/experts.py, 4: the gate / up order, a module with a
norm after its experts, down_proj's own format, the gate linears kept float) and the registry of
quantizer methods (quantizers/methods.py, 3: GPTQ's damp, a name registered twice, the gptq-refit
preset).

Selections are two test files chosen by their names and by which of them name the function under
test (`grep -l`, not reading them), the likeliest first: pytest runs with -x, so a kill stops at the
first failing test. Results: tests/mutation/README.md ("Audit list 13")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

REF = _files("tests/test_reference_fp.py", "tests/test_fp_modes.py")
TP = _files("tests/test_distributed.py", "tests/test_distributed_moe.py")
EXPERTS = _files("tests/test_moe_models.py", "tests/test_moe_gpt_oss_mxfp4.py")
EXPERTS_LOAD = _files("tests/test_moe_models.py", "tests/test_moe_mlx_lm.py")
METHODS = _files("tests/test_quantizers_methods.py", "tests/test_quantizers.py")

MUTANTS: list[Mutant] = [
    # ---- reference_fp.py: the float64 reference of mxfp4 / nvfp4 / mxfp8 ----------------------------
    Mutant("m13-ref-e2m1-distance-in-float64", "torch_qmm/reference_fp.py",
           "    distance = _round(q.unsqueeze(-1) - table, dtype).abs()",
           "    distance = (q.unsqueeze(-1) - table).abs()", REF,
           "the distances to the e2m1 table are compared in float64, not rounded to w's dtype as MLX "
           "computes them: a quotient whose two distances round to the same value (a tie in bfloat16, "
           "first entry wins) goes to the nearer entry instead"),
    Mutant("m13-ref-e4m3-saturates-from-480", "torch_qmm/reference_fp.py",
           "    saturate = ~(a < 448.0)  # also NaN",
           "    saturate = ~(a < 480.0)  # also NaN", REF,
           "e4m3 saturates only from 480 (the bound of another encoder): 464 < |x| < 480 rounds to the "
           "mantissa carry 0x7F, the NaN byte, where MLX's CPU build gives 448 (an nvfp4 group with "
           "amax / 6 there gets a NaN scale)"),
    Mutant("m13-ref-e4m3-negative-nan-decoded", "torch_qmm/reference_fp.py",
           "    magnitude = torch.where((c & 0x7F) == 0x7F, torch.full_like(magnitude, float(\"nan\")), magnitude)",
           "    magnitude = torch.where(c == 0x7F, torch.full_like(magnitude, float(\"nan\")), magnitude)", REF,
           "only 0x7F decodes as NaN: 0xFF (the negative NaN byte) decodes as -480"),
    Mutant("m13-ref-e8m0-power-of-two-rounded-up", "torch_qmm/reference_fp.py",
           "    n = torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int64)",
           "    n = exponent.to(torch.int64)", REF,
           "ceil(log2(s)) taken as frexp's exponent for every s: an s that is an exact power of two "
           "(amax = 6 * 2^k in mxfp4) gets a scale twice too large and its elements half their codes"),
    Mutant("m13-ref-e8m0-clamped-not-wrapped", "torch_qmm/reference_fp.py",
           "    return (n + 127) & 0xFF",
           "    return (n + 127).clamp(0, 255)", REF,
           "the e8m0 byte is clamped to [0, 255] where MLX wraps it mod 256: a float32 group below "
           "about 3.5e-38 gets byte 0 instead of a wrapped byte from 233 to 255"),
    Mutant("m13-ref-nvfp4-global-scale-inverted", "torch_qmm/reference_fp.py",
           "        enc = 1.0 if gs is None else _round(NVFP4_GLOBAL_SCALE_RANGE / gs, torch.float32)",
           "        enc = 1.0 if gs is None else _round(gs / NVFP4_GLOBAL_SCALE_RANGE, torch.float32)", REF,
           "nvfp4's encoding factor with a global scale is g / 2688 instead of 2688 / g (the "
           "dequantization's factor): the scales and elements are encoded on the wrong range"),
    Mutant("m13-ref-nvfp4-quotient-not-rounded-to-dtype", "torch_qmm/reference_fp.py",
           "        q = _round(_round(g / e4m3_decode(scale_codes), dtype) * enc, torch.float32)",
           "        q = _round(g / e4m3_decode(scale_codes) * enc, torch.float32)", REF,
           "nvfp4's element quotient w / scale is rounded to float32 only, not first to w's dtype as "
           "MLX divides: bfloat16 / float16 quotients that round onto an e2m1 midpoint are coded apart"),
    Mutant("m13-ref-dequant-e8m0-scale-unrounded", "torch_qmm/reference_fp.py",
           "        scale = _round(e8m0_decode(s), dtype)",
           "        scale = e8m0_decode(s)", REF,
           "the e8m0 scale is not rounded to the output dtype before the product: in float16 a scale "
           "of 2^-25 or below (0 in MLX) and 2^16 or above (inf in MLX) give finite values"),
    Mutant("m13-ref-magnitude-x-signed", "torch_qmm/reference_fp.py",
           "    return x.to(torch.float64).abs() @ (w.T if transpose else w)",
           "    return x.to(torch.float64) @ (w.T if transpose else w)", REF,
           "qmm_fp_magnitude sums x * |W| with x's signs: the terms cancel, the size of the product "
           "that error bounds scale with is underestimated (even negative)"),
    # ---- distributed/styles.py: tensor-parallel styles -----------------------------------------------
    Mutant("m13-tp-embedding-next-rank-row-kept", "torch_qmm/distributed/styles.py",
           "    outside = (local_ids < 0) | (local_ids >= rows_here)",
           "    outside = (local_ids < 0) | (local_ids > rows_here)", TP,
           "a row-split QuantEmbedding takes the first id of the next rank's rows as its own (local id "
           "rows_here, one past its table)"),
    Mutant("m13-tp-embedding-outside-rows-not-zeroed", "torch_qmm/distributed/styles.py",
           "            return global_output(rows.masked_fill(outside.unsqueeze(-1), 0), mesh, Partial(), self.embedding_dim)",
           "            return global_output(rows, mesh, Partial(), self.embedding_dim)", TP,
           "a row-split QuantEmbedding's ids outside a rank's rows read its row 0 instead of zeros: "
           "the Partial sum adds every other rank's row 0 to each embedding"),
    Mutant("m13-tp-embedding-last-id-accepted", "torch_qmm/distributed/styles.py",
           "        if lo < 0 or hi >= module.num_embeddings:",
           "        if lo < 0 or hi > module.num_embeddings:", TP,
           "a row-split QuantEmbedding accepts id == num_embeddings: outside every rank's rows, it "
           "embeds as zeros instead of the IndexError of the whole embedding"),
    Mutant("m13-tp-gguf-rowwise-unit-bytes", "torch_qmm/distributed/styles.py",
           "block_info(module.ggml_type)[0], \"weights per GGUF super-block\"",
           "block_info(module.ggml_type)[1], \"weights per GGUF super-block\"", TP,
           "a rowwise GGUFLinear's in_features is checked against the bytes of a super-block, not its "
           "weights: valid splits are refused and splits cutting a super-block accepted"),
    Mutant("m13-tp-replicated-grad-not-summed", "torch_qmm/distributed/styles.py",
           "    summed = redistribute(DTensor.from_local(grad, mesh, (Partial(),), run_check=False), (Replicate(),), stage)",
           "    summed = redistribute(DTensor.from_local(grad, mesh, (Replicate(),), run_check=False), (Replicate(),), stage)",
           TP,
           "ReplicatedGradAllReduce takes each rank's gradient as already replicated: no all-reduce, "
           "each rank keeps the gradient of its own part of the activations"),
    # ---- interop/experts.py: the fused experts of transformers' MoE models ---------------------------
    Mutant("m13-experts-interleaving-inverted", "torch_qmm/interop/experts.py",
           "interleaved=not module.is_concatenated,",
           "interleaved=bool(module.is_concatenated),", EXPERTS,
           "is_concatenated read the wrong way round: concatenated gate / up rows (Mixtral, Qwen) are "
           "taken as alternating and gpt-oss's alternating rows as concatenated"),
    Mutant("m13-experts-post-norm-accepted", "torch_qmm/interop/experts.py",
           "        if not described or not module.has_gate or getattr(module, \"has_post_expert_norm\", False):",
           "        if not described or not module.has_gate:", EXPERTS,
           "an experts module with a norm after its experts is taken as fused experts: its "
           "QuantFusedExperts computes without the norm"),
    Mutant("m13-experts-down-format-ignored", "torch_qmm/interop/experts.py",
           "    d_bits, d_group, d_mode = down or (bits, group_size, mode)",
           "    d_bits, d_group, d_mode = bits, group_size, mode", EXPERTS_LOAD,
           "empty_quant_layers builds down_proj in gate_up_proj's format even when the checkpoint "
           "stores it in another (bits, group size or mode of its own)"),
    Mutant("m13-experts-gate-linear-full-path", "torch_qmm/interop/experts.py",
           "    return name.rpartition(\".\")[2] in GATE_LINEARS",
           "    return name in GATE_LINEARS", EXPERTS,
           "is_gate_linear compares the module's whole path (model.layers.0.mlp.shared_expert_gate) "
           "with the names: a nested gate is never recognized and is quantized by default"),
    # ---- quantizers/methods.py: the registry of quantizer methods ------------------------------------
    Mutant("m13-methods-damp-zero-accepted", "torch_qmm/quantizers/methods.py",
           "and 0 < self.damp < 1):",
           "and 0 <= self.damp < 1):", METHODS,
           "GPTQ(damp=0) is accepted: a singular Hessian is not damped at all"),
    Mutant("m13-methods-duplicate-name-replaces", "torch_qmm/quantizers/methods.py",
           "    if method.name in REGISTRY:\n"
           "        raise ValueError(f\"a method named {method.name!r} is already registered\")\n",
           "", METHODS,
           "register accepts a name already registered: a user method named 'gptq' silently replaces "
           "the built-in one"),
    Mutant("m13-methods-refit-preset-not-sequential", "torch_qmm/quantizers/methods.py",
           "_REFIT_GPTQ = GPTQ(act_order=True, clip=True, refit=2, sequential=True)",
           "_REFIT_GPTQ = GPTQ(act_order=True, clip=True, refit=2)", METHODS,
           "the gptq-refit (and awq-gptq-refit) preset quantizes each block's layers from one pass, "
           "not in execution order as its summary says"),
]
