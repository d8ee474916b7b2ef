"""A second independent audit list (python -m tests.mutation --fresh2): realistic single bugs
written from the product code alone, before reading any test, in the interop readers and
writers, the command-line tools, the quantizers, the tolerance rule and the float64 reference,
metalsim's runtime and strictness checks, and the benchmark's bookkeeping. As in
fresh_mutants.py the test selections are broad (whole files chosen by their names), not the tests
meant to catch each bug: the question is whether the suite as a whole kills them. Not run in CI."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

GGUF = _files("tests/test_interop_gguf*.py", "tests/test_hostile_files.py", "tests/test_gguf_qmm.py",
              "tests/test_interop_cli.py", "tests/test_cli_convert.py")
LLAMA = _files("tests/test_interop_gguf_llama.py", "tests/test_interop_gguf*.py", "tests/test_interop_mlx_lm.py",
               "tests/test_cli_convert.py", "tests/test_interop_cli.py", "tests/test_hostile_files.py")
SAFETENSORS = _files("tests/test_hostile_files.py", "tests/test_interop_transformers.py", "tests/test_interop_mlx.py",
                     "tests/test_interop_cli.py", "tests/test_cli_convert.py", "tests/test_regressions.py")
CLI = _files("tests/test_cli_convert.py", "tests/test_interop_cli.py", "tests/test_cli_help.py",
             "tests/test_hostile_files.py")
TOKENIZER = _files("tests/test_interop_gguf_llama.py", "tests/test_interop_mlx_lm.py", "tests/test_cli_convert.py",
                   "tests/test_interop_cli.py")
QUANT = _files("tests/test_quantizers.py", "tests/test_quantize.py", "tests/test_regressions.py")
REFERENCE = _files("tests/test_tolerance.py", "tests/test_quantize.py", "tests/test_qmm.py", "tests/test_routes_cpu.py", "tests/test_cpu_*.py",
                   "tests/test_interop_mlx.py")
METALSIM = _files("tests/metalsim/test_metalsim_*.py")
BENCH = _files("tests/test_bench.py")

MUTANTS: list[Mutant] = [
    # ---- GGUF header parser (torch_qmm/interop/gguf_header.py) ----------------------------------
    Mutant("g2-header-name-63-bytes-refused", "torch_qmm/interop/gguf_header.py",
           "        if len(name.encode()) > MAX_NAME_BYTES:", "        if len(name.encode()) >= MAX_NAME_BYTES:", GGUF,
           "a tensor name of exactly 63 bytes (llama.cpp's limit, valid) is refused"),
    Mutant("g2-header-alignment-zero-accepted", "torch_qmm/interop/gguf_header.py",
           "        if alignment == 0 or alignment & (alignment - 1):", "        if alignment & (alignment - 1):", GGUF,
           "general.alignment = 0 passes the power-of-two check: ZeroDivisionError in _pad instead of a "
           "GGUFFormatError"),
    Mutant("g2-header-running-offset-unpadded", "torch_qmm/interop/gguf_header.py",
           "        expected += _pad(nbytes, alignment)", "        expected += nbytes", GGUF,
           "the expected offset of the next tensor ignores alignment padding: valid files whose tensor sizes "
           "are not multiples of the alignment are refused"),
    Mutant("g2-header-array-of-arrays-accepted", "torch_qmm/interop/gguf_header.py",
           "        if item_type not in VALUE_TYPES or item_type == ARRAY:",
           "        if item_type not in VALUE_TYPES:", GGUF,
           "an array of arrays is walked as an array of strings instead of refused"),
    Mutant("g2-header-one-item-array-as-scalar", "torch_qmm/interop/gguf_header.py",
           "    return out if entry.value_type == ARRAY else out[0]",
           "    return out if entry.count != 1 else out[0]", GGUF,
           "a metadata array of one item is returned as a bare scalar"),
    # ---- GGUF tensors (torch_qmm/interop/gguf.py) -------------------------------------------------
    Mutant("g2-gguf-q4_1-codes-offset", "torch_qmm/interop/gguf.py",
           "        codes, bias = nibbles(b[..., 4:20]), f16(2)", "        codes, bias = nibbles(b[..., 2:18]), f16(2)",
           GGUF, "Q4_1 -> affine reads the codes from byte 2 (Q4_0's offset): the m field becomes codes"),
    Mutant("g2-gguf-pack4-nibble-order", "torch_qmm/interop/gguf.py",
           "        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)",
           "        packed = ((codes[:, 0::2] << 4) | codes[:, 1::2]).astype(np.uint8)", GGUF,
           "4-bit repacking puts the even weight in the high nibble: every pair of codes swapped"),
    Mutant("g2-gguf-f16-bias-overflow-unchecked", "torch_qmm/interop/gguf.py",
           "    if not (torch.isfinite(scales).all() and torch.isfinite(biases).all()):\n"
           "        raise ValueError(f\"{t.source}",
           "    if not torch.isfinite(scales).all():\n        raise ValueError(f\"{t.source}", GGUF,
           "to_affine with dtype float16: a Q8_0 bias -128 d that overflows float16 becomes -Inf silently"),
    Mutant("g2-gguf-q6k-scale-check-wrong-bytes", "torch_qmm/interop/gguf.py",
           "b[:, 0:4] if t.ggml_type == Q4_K else b[:, 208:210]", "b[:, 0:4] if t.ggml_type == Q4_K else b[:, 0:2]",
           GGUF, "to_blocks checks Q6_K's first two code bytes instead of its float16 d: a NaN d is accepted "
                 "(and code bytes that look like NaN are refused)"),
    # ---- llama GGUF -> transformers (torch_qmm/interop/gguf_llama.py) ----------------------------------
    Mutant("g2-llama-unpermute-forward-not-inverse", "torch_qmm/interop/gguf_llama.py",
           "reshape(n_head, rows // n_head // 2, 2).transpose(1, 2)",
           "reshape(n_head, 2, rows // n_head // 2).transpose(1, 2)", LLAMA,
           "the Q/K rows get llama.cpp's permutation applied again instead of undone (same for head_dim 4)"),
    Mutant("g2-llama-token-id-limit-inclusive", "torch_qmm/interop/gguf_llama.py",
           "not 0 <= value < limit)", "not 0 <= value <= limit)", LLAMA,
           "a special token id equal to the vocabulary size is kept instead of dropped with a warning"),
    Mutant("g2-llama-bool-metadata-as-int", "torch_qmm/interop/gguf_llama.py",
           "        if not isinstance(value, int) or isinstance(value, bool) or value < 1:",
           "        if not isinstance(value, int) or value < 1:", LLAMA,
           "a BOOL block_count / head count (True) is read as 1"),
    # ---- safetensors (torch_qmm/interop/safetensors_io.py) and JSON files ---------------------------
    Mutant("g2-st-gap-between-tensors-accepted", "torch_qmm/interop/safetensors_io.py",
           "        if begin != covered:", "        if begin < covered:", SAFETENSORS,
           "unused bytes between two tensors' data_offsets are accepted"),
    Mutant("g2-st-shard-path-traversal", "torch_qmm/interop/safetensors_io.py",
           "or Path(file).name != file or file in", "or file in", SAFETENSORS,
           "an index naming ../x.safetensors or sub/x.safetensors reads a file outside the folder"),
    Mutant("g2-st-stale-cleanup-prefix-match", "torch_qmm/interop/safetensors_io.py",
           "_OWN_WEIGHT_FILE.fullmatch(f.name)", "_OWN_WEIGHT_FILE.match(f.name)", SAFETENSORS,
           "save_sharded deletes the user's files that merely start like a weight file (model.safetensors.bak)"),
    Mutant("g2-st-index-shard-not-checked", "torch_qmm/interop/safetensors_io.py",
           "                if self.where.get(name) != path / file:", "                if name not in self.where:",
           SAFETENSORS, "an index that lists a tensor in the wrong shard is accepted"),
    Mutant("g2-json-non-object-accepted", "torch_qmm/interop/json_files.py",
           "    if not isinstance(value, dict):", "    if value is None:", SAFETENSORS,
           "a config.json holding a list passes: AttributeError later instead of a ValueError naming the file"),
    Mutant("g2-gguf-cut-short-after-open-unchecked", "torch_qmm/interop/gguf.py",
           "        if now < self._size:\n", "        if False:\n", GGUF,
           "a GGUF file truncated after GGUFFile opened it kills the loading process (SIGBUS)"),
    # ---- output folder (torch_qmm/interop/output_folder.py) ------------------------------------------
    Mutant("g2-out-symlink-prefix-escape", "torch_qmm/interop/output_folder.py",
           "any(target == a or a in target.parents for a in allowed)",
           "any(str(target).startswith(str(a)) for a in allowed)", CLI,
           "a side-file link into a sibling folder whose name extends the source's (src-private/) is copied"),
    Mutant("g2-out-failed-run-leaves-partial", "torch_qmm/interop/output_folder.py",
           "        shutil.rmtree(tmp, ignore_errors=True)\n        _remove_empty(created)\n",
           "        _remove_empty(created)\n", CLI,
           "a failed conversion leaves its .partial folder behind"),
    Mutant("g2-out-dot-destination-unresolved", "torch_qmm/interop/output_folder.py",
           "    where = dst.resolve()\n", "    where = dst\n", CLI,
           "convert SRC . stages next to '.', inside the destination, and fails renaming the working directory"),
    Mutant("g2-out-failed-move-keeps-old-aside", "torch_qmm/interop/output_folder.py",
           "                os.replace(aside / name, dst / name)\n", "                pass\n", CLI,
           "a failed last move into an existing destination leaves the user's old entries in a hidden folder"),
    Mutant("g2-out-empty-destination-refused", "torch_qmm/interop/output_folder.py",
           "    if dst.is_dir() and any(dst.iterdir()) and not overwrite:", "    if dst.is_dir() and not overwrite:", CLI,
           "an existing empty destination is refused without --overwrite"),
    # ---- convert CLI (torch_qmm/interop/cli_convert.py) --------------------------------------------
    Mutant("g2-cli-q4k-exact-ignores-biases", "torch_qmm/interop/cli_convert.py",
           "    exact = torch.equal(scales.float(), s32) and torch.equal(biases.float(), b32)",
           "    exact = torch.equal(scales.float(), s32)", CLI,
           "a Q4_K layer whose biases were rounded by --dtype is reported lossless"),
    Mutant("g2-cli-transformers-requantize-rest-drops-exact-layers", "torch_qmm/interop/cli_convert.py",
           "keep_affine=True, float_embedding=True)", 'keep_affine=args.requantize is None, float_embedding=True)', CLI,
           "GGUF -> transformers with --requantize rest silently re-quantizes the exact layers too (lossy)"),
    Mutant("g2-cli-gguf-head-not-retied", "torch_qmm/interop/cli_convert.py",
           "    if float_embedding and config.tie_word_embeddings:\n"
           "        model.lm_head.weight = model.model.embed_tokens.weight\n", "", CLI,
           "GGUF -> transformers of a tied model: the output head is left untied (an empty Linear)"),
    # ---- inspect CLI (torch_qmm/interop/cli_inspect.py) --------------------------------------------
    Mutant("g2-inspect-lexicographic-order", "torch_qmm/interop/cli_inspect.py",
           '(0, int(part), "") if part.isdigit()', "(0, 0, part) if part.isdigit()", CLI,
           "layers listed blk.1, blk.10, blk.2 instead of in natural order"),
    Mutant("g2-inspect-config-over-saved-format", "torch_qmm/interop/cli_inspect.py",
           "            known = saved or configured", "            known = configured or saved", CLI,
           "inspect shows config.json's format instead of the one the layer's _extra_state holds"),
    Mutant("g2-inspect-gguf-row-k-swapped", "torch_qmm/interop/cli_inspect.py",
           "shape[1] // block_bytes * per_block]", "shape[1] // per_block * block_bytes]", CLI,
           "a saved GGUFLinear's K is computed with block bytes and weights per block swapped"),
    # ---- GGUF tokenizer (torch_qmm/interop/gguf_tokenizer.py) --------------------------------------
    Mutant("g2-tokenizer-reads-neighbour-files", "torch_qmm/interop/gguf_tokenizer.py",
           "        return AutoTokenizer.from_pretrained(tmp, gguf_file=link.name, local_files_only=True)",
           "        return AutoTokenizer.from_pretrained(f.path.parent, gguf_file=f.path.name, "
           "local_files_only=True)", TOKENIZER,
           "the tokenizer is built from the GGUF's own folder, which may hold another model's tokenizer_config.json"),
    # ---- quantizers (torch_qmm/quantizers/) --------------------------------------------------------
    Mutant("g2-quant-codes-clamp-one-short", "torch_qmm/quantizers/affine.py",
           "    q = torch.round((groups - bias) / safe).clamp_(0, levels(bits))",
           "    q = torch.round((groups - bias) / safe).clamp_(0, levels(bits) - 1)", QUANT,
           "codes never reach the top level 2^bits - 1 (mse, gptq, awq)"),
    Mutant("g2-quant-mse-least-squares-bias-typo", "torch_qmm/quantizers/mse.py",
           "    b = torch.where(ok, (sqq * sx - sq * sqx) / safe, b_prev)",
           "    b = torch.where(ok, (sqq * sx - sq * sx) / safe, b_prev)", QUANT,
           "the least-squares bias uses sum(c x) for sum(c q x): the refinement never improves on the range search"),
    Mutant("g2-quant-mixed-spends-on-least-sensitive", "torch_qmm/quantizers/mixed.py",
           "(sens[n][0] - sens[n][1]) / sizes[n], reverse=True)", "(sens[n][0] - sens[n][1]) / sizes[n])", QUANT,
           "MixedBits gives the high width to the layers that gain least from it"),
    Mutant("g2-quant-gptq-no-lazy-block-update", "torch_qmm/quantizers/gptq.py",
           "        W[:, i2:] -= E1 @ hinv[i1:i2, i2:]\n", "", QUANT,
           "gptq's error feedback stops at each 128-column block: columns past the first block get none"),
    Mutant("g2-quant-gptq-act-order-gather", "torch_qmm/quantizers/gptq.py",
           "    codes_orig = torch.empty_like(Q)\n    codes_orig[:, perm] = Q",
           "    codes_orig = Q[:, perm]", QUANT,
           "act_order writes the codes back with the permutation instead of its inverse"),
    Mutant("g2-quant-gptq-rest-writes-back", "torch_qmm/quantizers/plan.py",
           "            quantize(stats, members, rest, write_back=False)", "            quantize(stats, members, rest)",
           QUANT, "gptq writes the dequantized output head back into its float weight, which a tied embedding shares"),
    Mutant("g2-quant-awq-fold-divides-columns", "torch_qmm/quantizers/awq.py",
           "        prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))",
           "        prev.weight.div_(s.to(prev.weight.dtype))", QUANT,
           "the row fold (v_proj for o_proj) divides v_proj's columns: the float model changes (square v_proj)"),
    # ---- tolerance and reference ---------------------------------------------------------------------
    Mutant("g2-tol-f16-atol-normal-spacing", "torch_qmm/tolerance.py",
           "torch.float16: 2**-25,", "torch.float16: 2**-15,", REFERENCE,
           "float16's absolute floor taken from the normal range: errors up to 2^-15 near zero pass"),
    Mutant("g2-ref-quantize-edge-tie", "torch_qmm/reference.py",
           "    min_is_edge = w_min.abs() > w_max.abs()", "    min_is_edge = w_min.abs() >= w_max.abs()", REFERENCE,
           "reference.quantize takes the minimum as the exact edge when |min| == |max| (MLX takes the maximum)"),
    Mutant("g2-ref-quantize-scale-floor-dropped", "torch_qmm/reference.py",
           "    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)", "    scale = (w_max - w_min) / n_bins",
           REFERENCE, "a constant group gives scale 0 and NaN codes in reference.quantize"),
    # ---- metalsim (torch_qmm/metalsim/) ---------------------------------------------------------------
    Mutant("g2-msim-barrier-with-exited-threads", "torch_qmm/metalsim/runtime.c",
           "    if (w->L->check && (ne > 0 || odd)) {", "    if (w->L->check && odd) {", METALSIM,
           "checked mode: threads waiting at a barrier while others of the threadgroup exited is not reported"),
    Mutant("g2-msim-same-simdgroup-race", "torch_qmm/metalsim/runtime.c",
           "      if (osg != sg || s->wsg == tg->sg_epoch[sg]) { conflict = \"wrote\"; other = s->wtid; }",
           "      if (osg != sg) { conflict = \"wrote\"; other = s->wtid; }", METALSIM,
           "checked mode: a read-after-write race between lanes of one SIMD-group (no collective between) is missed"),
    Mutant("g2-msim-oob-straddling-end", "torch_qmm/metalsim/runtime.c",
           "      if (a < bm->lo[k] || a + n > bm->hi[k]) {", "      if (a < bm->lo[k] || a >= bm->hi[k]) {", METALSIM,
           "checked mode: an access that starts inside a buffer and runs past its end is not reported"),
    Mutant("g2-msim-tg-oob-start-only", "torch_qmm/metalsim/runtime.c",
           "  if (off + n > tg->used) {", "  if (off >= tg->used) {", METALSIM,
           "checked mode: a threadgroup access straddling the end of the declared memory is not reported"),
    Mutant("g2-msim-nonuniform-edge-full", "torch_qmm/metalsim/runtime.c",
           "        if (L->threads[d] - start < sz) sz = L->threads[d] - start;", "        (void)start;", METALSIM,
           "dispatchThreads: edge threadgroups are full size, so threads past the grid run"),
    Mutant("g2-msim-dispatch-threads-floor", "torch_qmm/metalsim/_api.py",
           "            groups = tuple(-(-g // t) for g, t in zip(grid, tptg))",
           "            groups = tuple(max(1, g // t) for g, t in zip(grid, tptg))", METALSIM,
           "dispatchThreads rounds the threadgroup count down: the partial edge threadgroup never runs"),
    Mutant("g2-msim-function-pointer-call-missed", "torch_qmm/metalsim/_strict.py",
           '    bad_ptr = sorted(f for f in reach if indirect[f] and "__msim_invoke" not in f)',
           '    bad_ptr = sorted(f for f in reach if indirect[f] and "__msim_invoke" in f)', METALSIM,
           "a call through a function pointer left in the optimised IR passes the strictness rules"),
    # ---- benchmark bookkeeping (torch_qmm/bench/) --------------------------------------------------------
    Mutant("g2-bench-speedup-inverted", "torch_qmm/bench/kernels.py",
           "        return {p: t / ours for p, t in self.times_ms.items() if p != OURS}",
           "        return {p: ours / t for p, t in self.times_ms.items() if p != OURS}", BENCH,
           "speedups report torch_qmm time / peer time (> 1 means slower, contrary to the doc)"),
    Mutant("g2-bench-output-check-nan-passes", "torch_qmm/bench/kernels.py",
           "    if not worst <= 1.0:\n        raise AssertionError(f\"torch_qmm output differs from the reference for {cfg} "
           "(worst error/bound {worst:.2f})\")\n\n\ndef _linear",
           "    if worst > 1.0:\n        raise AssertionError(f\"torch_qmm output differs from the reference for {cfg} "
           "(worst error/bound {worst:.2f})\")\n\n\ndef _linear", BENCH,
           "the bench's output check lets NaN outputs through (NaN > 1.0 is false)"),
]
