"""A tenth independent audit list (python -m tests.mutation --fresh10): realistic single bugs written
from the product sources alone (torch_qmm/, csrc/; by someone who had not read the tests that
cover them), none of them a bug of an earlier list, concentrated on the code written or changed
since f02eb12. C++ (each in a .cpp file that rebuilds alone): the GGUF Q4_K / Q6_K panel kernels
(gguf_panel.cpp: x laid out with rows of x as lanes and its side entries, the Q4_K sub-block sums
of the hoisted mins; the super-block decoders' scale lanes, nibble bytes and Q6_K weight order;
the tile's per-super-block partial sums, the next super-block decoded beside the FMAs, the last
W rows of a span; the prefetch) and gguf_f32.cpp's split of a call between the panel and the
chunk kernels (panel_rows: whole groups of 16 and a last group of >= 14; the x and y offsets of
the rest; TORCH_QMM_CPU_NO_PANEL). Python: loading into models built on the meta device
(torch_qmm/interop/meta.py: resolve_device, MetaTensors, compute_buffers and its two fills,
check_no_meta) and its users (mlx.py, mlx_experts.py, gguf_llama.py, distributed/loading.py).

Selections are two test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 10")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

PANEL = _files("tests/test_cpu_gguf_panel.py", "tests/test_cpu_gguf_float32.py")
PANEL_ROUTE = _files("tests/test_cpu_gguf_panel.py", "tests/test_routes_cpu.py")
META = _files("tests/test_load_meta.py", "tests/test_interop_mlx.py")
META_GGUF = _files("tests/test_load_meta.py", "tests/test_interop_gguf_llama.py")
META_EXPERTS = _files("tests/test_load_meta.py", "tests/test_moe_mlx_lm.py")
META_SHARDED = _files("tests/test_load_meta.py", "tests/test_distributed.py")

MUTANTS: list[Mutant] = [
    # ---- meta.py: the device of a load -------------------------------------------------------------
    Mutant("m10-resolve-device-ignored", "torch_qmm/interop/meta.py",
           "        target = torch.device(device if device is not None else \"cpu\")",
           "        target = torch.device(\"cpu\")", META,
           "the `device` a load is given for a model built on meta is ignored: its tensors are always "
           "created on the CPU (and device='meta' is not refused)"),
    Mutant("m10-device-for-in-memory-model-accepted", "torch_qmm/interop/meta.py",
           "    if device is not None:\n        raise ValueError(f\"{loader}: argument 'device' applies",
           "    if False:\n        raise ValueError(f\"{loader}: argument 'device' applies", META,
           "a `device` given for a model whose tensors are in memory is silently ignored instead of "
           "refused (the model stays where it is)"),
    # ---- meta.py: MetaTensors ----------------------------------------------------------------------
    Mutant("m10-tied-owners-not-replaced", "torch_qmm/interop/meta.py",
           "        owners = self._owners.get(id(t), [])\n",
           "        owners = []\n", META_GGUF,
           "a meta tensor shared by several modules (tied weights) gets storage in the module asked "
           "for only: the tie is broken and the other owners keep the meta tensor"),
    Mutant("m10-real-parameter-not-wrapped", "torch_qmm/interop/meta.py",
           "        if isinstance(t, nn.Parameter):\n            new = nn.Parameter(new, requires_grad=t.requires_grad)\n",
           "", META,
           "a meta parameter is replaced by a plain tensor, not an nn.Parameter: it is no longer a "
           "trainable parameter (requires_grad False, not a Parameter in the module's table)"),
    Mutant("m10-real-storage-float32", "torch_qmm/interop/meta.py",
           "        new = torch.empty(t.shape, dtype=t.dtype, device=self.device)",
           "        new = torch.empty(t.shape, dtype=torch.float32, device=self.device)", META,
           "the storage given to a meta tensor is float32 whatever the model's dtype: a bfloat16 "
           "model loaded from meta keeps float32 norms and float layers"),
    # ---- meta.py: compute_buffers ------------------------------------------------------------------
    Mutant("m10-one-fill-twice", "torch_qmm/interop/meta.py",
           "module._buffers[n] = torch.full(b.shape, _fills(b.dtype)[k], dtype=b.dtype, device=device)",
           "module._buffers[n] = torch.full(b.shape, _fills(b.dtype)[0], dtype=b.dtype, device=device)", META,
           "both runs of the initialization start from the same fill: a buffer it does not compute "
           "(or computes in part) gives equal results and is accepted holding the fill"),
    Mutant("m10-init-writes-loaded-parameters", "torch_qmm/interop/meta.py",
           "            for n, p in params.items():  # stand-ins: the initialization writes nothing that is loaded\n"
           "                if p is not None:\n",
           "            for n, p in params.items():  # stand-ins: the initialization writes nothing that is loaded\n"
           "                if False:\n", META,
           "the module's loaded parameters are not hidden behind meta stand-ins while _init_weights "
           "computes its buffers: an initialization that writes them in place overwrites loaded values"),
    Mutant("m10-compute-failures-not-raised", "torch_qmm/interop/meta.py",
           "    if failed:\n        raise ValueError(",
           "    if False:\n        raise ValueError(", META,
           "a computed buffer that no transformers initialization sets is not reported by "
           "compute_buffers (the ValueError naming it and how to build the model instead)"),
    Mutant("m10-outermost-init-weights", "torch_qmm/interop/meta.py",
           "        if callable(own) and hasattr(module, \"config\") and hasattr(module, \"initialize_weights\"):",
           "        if fn is None and callable(own) and hasattr(module, \"config\") and hasattr(module, \"initialize_weights\"):",
           META,
           "a module's buffers are computed by the _init_weights of the outermost transformers model "
           "holding it, not the innermost (a composite model's sub-model initializes its own modules)"),
    Mutant("m10-meta-buffers-unchecked", "torch_qmm/interop/meta.py",
           "    return [name for name, t in (*model.named_parameters(remove_duplicate=False),\n"
           "                                 *model.named_buffers(remove_duplicate=False)) if t.is_meta]",
           "    return [name for name, t in model.named_parameters(remove_duplicate=False) if t.is_meta]", META,
           "check_no_meta looks at parameters only: a buffer left on meta after the load (one the file "
           "does not hold, strict=False) is not reported"),
    # ---- the loaders -------------------------------------------------------------------------------
    Mutant("m10-gguf-float-tensors-copied-into-meta", "torch_qmm/interop/gguf_llama.py",
           "                (state[name] if meta is None else meta.real_key(model, name)).copy_(value)",
           "                state[name].copy_(value)", META_GGUF,
           "load_gguf_llama copies the file's float tensors (norms, float layers) into the model's "
           "meta tensors (a copy that keeps nothing) instead of giving them storage first"),
    Mutant("m10-gguf-no-meta-check", "torch_qmm/interop/gguf_llama.py",
           "        check_no_meta(model, \"load_gguf_llama\", f.path)\n",
           "", META_GGUF,
           "load_gguf_llama does not check what is left on meta: with strict=False a model tensor the "
           "file does not hold stays on meta without an error"),
    Mutant("m10-mlx-experts-built-on-meta", "torch_qmm/interop/mlx_experts.py",
           "                                            device=None if meta is None else meta.device)",
           "                                            device=None)", META_EXPERTS,
           "the QuantFusedExperts of a model built on meta are created on the replaced module's "
           "device (meta), so the checkpoint's expert tensors are copied into meta tensors"),
    Mutant("m10-float-experts-left-on-meta", "torch_qmm/interop/mlx_experts.py",
           "            if meta is not None:\n                for weight in layout.weight_names:\n"
           "                    meta.real(experts, weight)\n",
           "", META_EXPERTS,
           "float (unquantized) fused experts of a model built on meta get no storage before their "
           "weights are filled: the copies go into meta tensors"),
    Mutant("m10-sharded-non-persistent-buffers-materialized", "torch_qmm/distributed/loading.py",
           "                if table is module._buffers and name in module._non_persistent_buffers_set:\n"
           "                    continue\n",
           "", META_SHARDED,
           "the sharded loader gives the non-persistent buffers (rotary inv_freq) uninitialised storage "
           "with the rest: they are no longer on meta, so compute_buffers skips them and they keep "
           "whatever the memory held"),
    # ---- C++ (each rebuilds the C++ scratch copy: --only-cpp) ----------------------------------------
    # gguf_panel.cpp
    Mutant("k10-q4k-side-sums-of-lanes-0-7", "csrc/cpu/gguf_panel.cpp",
           "    for (int i = 0; i < 8; ++i) out[i] = s[8 + i];",
           "    for (int i = 0; i < 8; ++i) out[i] = s[i];", PANEL,
           "the Q4_K side entries of x take lanes 0-7 of q4k_sums (zero) instead of lanes 8-15, the "
           "sub-block sums: the hoisted mins -dmin*m[s] are multiplied by 0 and dropped"),
    Mutant("k10-q4k-high-nibbles-low-scale", "csrc/cpu/gguf_panel.cpp",
           "hi_s = _mm512_set1_ps(sv[2 * J + 1]);",
           "hi_s = _mm512_set1_ps(sv[2 * J]);", PANEL,
           "the high nibbles of Q4_K chunk J (sub-block 2J + 1) are scaled by sub-block 2J's d*sc"),
    Mutant("k10-q4k-offsets-of-scales", "csrc/cpu/gguf_panel.cpp",
           "_mm256_sub_ps(_mm256_setzero_ps(), _mm256_load_ps(sv + 8))",
           "_mm256_sub_ps(_mm256_setzero_ps(), _mm256_load_ps(sv))", PANEL,
           "the Q4_K offsets are -d*sc[s] (lanes 0-7 of the scale vector) instead of -dmin*m[s]"),
    Mutant("k10-q6k-weight-order-natural", "csrc/cpu/gguf_panel.cpp",
           "    return 64 * hp + 4 * l + u;",
           "    return 64 * hp + 16 * u + l;", PANEL,
           "x is laid out for Q6_K in the natural order within each 64 weights (16u + l) while the "
           "decoder stores weight 4l + u at scratch entry 16u + l: weights and x are mismatched"),
    Mutant("k10-q6k-high-field-3-of-2", "csrc/cpu/gguf_fields.h",
           ": _mm512_srlv_epi32(qh, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2));",
           ": _mm512_srlv_epi32(qh, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));", PANEL,
           "for p = 1 the Q6_K weights with c >= 32 take field 2 of qh (bits 4-5) as their high bits "
           "instead of field 3 (bits 6-7)"),
    Mutant("k10-q6k-scale-lane-of-p-halved", "csrc/cpu/gguf_panel.cpp",
           "_mm512_set1_epi32(8 * h + 4 * p));",
           "_mm512_set1_epi32(8 * h + 2 * p));", PANEL,
           "the Q6_K scales of the high-nibble half (p = 1) are read from sub-blocks 8h + 2 + l / 4 "
           "instead of 8h + 4 + l / 4"),
    Mutant("k10-partial-sum-replaces-total", "csrc/cpu/gguf_panel.cpp",
           "_mm512_store_ps(total[g] + r * kLanes, _mm512_add_ps(_mm512_load_ps(total[g] + r * kLanes), part[r]));",
           "_mm512_store_ps(total[g] + r * kLanes, part[r]);", PANEL,
           "each super-block's partial sums replace the row's total instead of being added to it: "
           "y holds the last super-block's products only"),
    Mutant("k10-next-decode-of-this-block", "csrc/cpu/gguf_panel.cpp",
           "        if (g == 0 && b + 1 < blocks_per_row) decode(b + 1, c, next);",
           "        if (g == 0 && b + 1 < blocks_per_row) decode(b, c, next);", PANEL,
           "the super-block decoded beside the FMAs is this one again, not the next: from the second "
           "super-block on, every block multiplies the weights of the one before"),
    Mutant("k10-x-layout-ignores-group", "csrc/cpu/gguf_panel.cpp",
           "Kern::prepare(m < a.M ? a.x + m * a.K + 256 * b : nullptr,",
           "Kern::prepare(m < a.M ? a.x + j * a.K + 256 * b : nullptr,", PANEL,
           "x is laid out from row j of the group's lanes without the group's first row m0: every "
           "group of 16 rows of x holds rows 0-15"),
    Mutant("k10-last-row-of-span-skipped", "csrc/cpu/gguf_panel.cpp",
           "      for (; n < n1; ++n) tile<Kern, 1>(",
           "      for (; n + 1 < n1; ++n) tile<Kern, 1>(", PANEL,
           "the W rows of a span past its tiles of 8 are taken one at a time up to the last but one: "
           "a span of N not a multiple of 8 leaves its last row of y unwritten"),
    Mutant("k10-prefetch-past-the-row", "csrc/cpu/gguf_panel.cpp",
           "    if (b + kAhead < blocks_per_row)",
           "    if (b + kAhead <= blocks_per_row)", PANEL,
           "the prefetch of the super-block kAhead on also runs when that block is the first past the "
           "row (the next W row's, or past the end of W for the last row)"),
    # gguf_f32.cpp
    Mutant("k10-panel-last-group-of-14-to-chunks", "csrc/cpu/gguf_chunked.h",
           "  return M - last + (last >= kGgufPanelMinGroupRows ? last : 0);",
           "  return M - last + (last > kGgufPanelMinGroupRows ? last : 0);", PANEL_ROUTE,
           "a last group of exactly 14 rows goes to the chunk kernels, not the panel (off by one)"),
    Mutant("k10-rest-x-offset-in-floats-of-a-row", "csrc/cpu/gguf_f32.cpp",
           "  rest.x = a.x + panel * a.K;",
           "  rest.x = a.x + panel;", PANEL,
           "the rows the chunk kernels take after the panel's are read from x + panel floats (inside "
           "row 0) instead of row `panel`"),
    Mutant("k10-rest-y-offset-by-k", "csrc/cpu/gguf_f32.cpp",
           "  y += panel * a.N;",
           "  y += panel * a.K;", PANEL,
           "the chunk kernels' rows of y start at panel * K floats instead of panel * N: right only "
           "for square W"),
    Mutant("k10-no-panel-env-ignored", "csrc/cpu/gguf_f32.cpp",
           "  if (!gguf_panel_built() || gguf_panel_avoided()) return 0;",
           "  if (!gguf_panel_built()) return 0;", PANEL_ROUTE,
           "TORCH_QMM_CPU_NO_PANEL=1 no longer steps the panel kernels aside"),
]
