"""An eighth independent audit list (python -m tests.mutation --fresh8): realistic single bugs
written from the product sources alone (torch_qmm/, csrc/; the Python ones by someone who had
not read the tests), none of them a bug of an earlier list, concentrated on the code written or changed since 98c530c: the
CLI's output-file check, the ops' flag and bits / group-size type checks and the batched
dequantize, FormatState's dtype check and pickling, quantize_model's dtype check and its
transformers config, the transformers quantizer's dtypes, config and import hook, calibration's
samples and token ids, the regular-file checks, the safetensors finiteness scan, the llama
GGUF's biases and float metadata, the MLX config's null fields and mode, QuantEmbedding's and
GGUFLinear's new paths, convert's source-format, calibration and report code, the benchmark's
rounds and selftest's precision and lists; in C++ (two, each in a .cpp file that rebuilds alone)
the int8-activation GGUF offset sums and where a part of a row of x may start.

Selections are two test files chosen by their names (not by reading them), the likeliest
first: pytest runs with -x, so a kill stops at the first failing test. Results:
tests/mutation/README.md ("Audit list 8")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

OUTPUT_FILE = _files("tests/test_selftest.py", "tests/test_bench.py")
OPS_ARGS = _files("tests/test_format_arguments.py", "tests/test_errors.py")
GATHER_ARGS = _files("tests/test_format_arguments.py", "tests/test_gather_qmm.py")
DEQUANTIZE = _files("tests/test_quantize.py", "tests/test_format_arguments.py")
FORMAT_STATE = _files("tests/test_format_state.py", "tests/test_nn.py")
CONVERT_DTYPES = _files("tests/test_user_convert.py", "tests/test_moe_models.py")
TRANSFORMERS = _files("tests/test_interop_transformers.py", "tests/test_user_convert.py")
TRANSFORMERS_FILES = _files("tests/test_interop_transformers.py", "tests/test_hostile_files.py")
TRANSFORMERS_CONFIG = _files("tests/test_interop_transformers.py", "tests/test_format_arguments.py")
CALIBRATION = _files("tests/test_quantizers_methods.py", "tests/test_quantizers.py")
CALIBRATION_TEXT = _files("tests/test_quantizers.py", "tests/test_cli_convert.py")
HOSTILE_GGUF = _files("tests/test_hostile_files.py", "tests/test_interop_gguf.py")
INSPECT = _files("tests/test_interop_cli.py", "tests/test_hostile_files.py")
LLAMA = _files("tests/test_interop_gguf_llama.py", "tests/test_hostile_files.py")
MLX = _files("tests/test_interop_mlx.py", "tests/test_interop_mlx_lm.py")
MLX_HOSTILE = _files("tests/test_hostile_files.py", "tests/test_interop_mlx.py")
EMBEDDING_DTYPES = _files("tests/test_nn_dtypes.py", "tests/test_interop_mlx.py")
EMBEDDING_FAKE = _files("tests/test_fakes.py", "tests/test_compile.py", "tests/test_hardening_ops.py")
GGUF_LINEAR = _files("tests/test_format_arguments.py", "tests/test_errors.py")
GGUF_AUTOCAST = _files("tests/test_nn_dtypes.py", "tests/test_gguf_qmm.py")
CLI = _files("tests/test_cli_convert.py", "tests/test_interop_cli.py")
BENCH = _files("tests/test_bench.py", "tests/test_bench_llamacpp.py")
SELFTEST = _files("tests/test_selftest.py", "tests/test_cli_help.py")
SELFTEST_STRICT = _files("tests/test_selftest.py", "tests/test_selftest_strict.py")
ACTQ_GGUF = _files("tests/test_cpu_actq_gguf.py", "tests/test_cpu_actq.py")
ACTQ_PARTS = _files("tests/test_cpu_actq.py", "tests/test_cpu_chunked.py")

MUTANTS: list[Mutant] = [
    # ---- CLI output files (cli_errors.output_file) ----------------------------------------------
    Mutant("o8-output-file-existing-folder-accepted", "torch_qmm/cli_errors.py",
           "    if not text or path.is_dir():",
           "    if not text:", OUTPUT_FILE,
           "--json / --output naming an existing folder passes the check: the run ends with 'Is a "
           "directory' when the report is written, the results lost"),
    Mutant("o8-output-file-parent-a-file-accepted", "torch_qmm/cli_errors.py",
           "    if not ancestor.is_dir():",
           "    if not ancestor.exists():", OUTPUT_FILE,
           "the nearest existing ancestor of the output path is only required to exist: a regular file "
           "as the 'folder' (out.json/report.json) passes, and the write fails after the run"),
    # ---- ops: argument types, batched dequantize --------------------------------------------------
    Mutant("p8-check-flags-accepts-ints", "torch_qmm/ops.py",
           "        if not isinstance(value, bool):",
           "        if not isinstance(value, (bool, int)):", OPS_ARGS,
           "transpose=0 / 1 (an int, not a bool) passes the flag check and is read by truth value"),
    Mutant("p8-params-bool-checked-for-bits-only", "torch_qmm/ops.py",
           "        if isinstance(value, bool):\n            raise TypeError(f\"{op}: argument '{name}' must be an int",
           "        if isinstance(value, bool) and name == \"bits\":\n            raise TypeError(f\"{op}: argument '{name}' must be an int",
           OPS_ARGS,
           "group_size=True is not refused as a bool: it reaches the op as 1 (a ValueError about the "
           "group size, or worse, not the TypeError naming the argument)"),
    Mutant("p8-gather-sorted-indices-flag-unchecked", "torch_qmm/ops.py",
           "    _check_flags(\"gather_qmm\", transpose=transpose, sorted_indices=sorted_indices)",
           "    _check_flags(\"gather_qmm\", transpose=transpose)", GATHER_ARGS,
           "gather_qmm's sorted_indices=None (or 0, a tensor) is read by truth value instead of refused"),
    Mutant("p8-dequantize-batched-biases-shape-unchecked", "torch_qmm/ops.py",
           "    for name, t in ((\"scales\", scales), (\"biases\", biases)):\n        if isinstance(t, torch.Tensor) and t.shape[:-1] != wq.shape[:-1]:",
           "    for name, t in ((\"scales\", scales),):\n        if isinstance(t, torch.Tensor) and t.shape[:-1] != wq.shape[:-1]:",
           DEQUANTIZE,
           "batched dequantize checks the scales' leading dimensions but not the biases': biases "
           "[3, 2, G] for wq [2, 3, words] are flattened to the same rows and used, mismatched"),
    # ---- FormatState: dtype check and pickling ---------------------------------------------------
    Mutant("f8-state-int64-codes-accepted", "torch_qmm/format_state.py",
           "given.dtype not in (own.dtype, _SIGNED_OF.get(own.dtype))",
           "given.dtype not in (own.dtype, _SIGNED_OF.get(own.dtype), torch.int64)",
           FORMAT_STATE,
           "an int64 qweight in a state dict is accepted for the uint32 words: copy_ wraps values past "
           "2^32 and reads the int64 layout as other codes"),
    Mutant("f8-state-integer-into-float-accepted", "torch_qmm/format_state.py",
           "            if own.is_floating_point() != given.is_floating_point() or (\n                    not own.is_floating_point()",
           "            if (\n                    not own.is_floating_point()",
           FORMAT_STATE,
           "only the code buffers' dtypes are checked: integer scales / biases (an int32 tensor for "
           "float scales) are copied in, truncated values"),
    Mutant("f8-unpickled-words-left-signed", "torch_qmm/format_state.py",
           "            self._buffers[name] = self._buffers[name].view(dtype)",
           "            self._buffers[name] = self._buffers[name].view(_SIGNED_OF[dtype])",
           FORMAT_STATE,
           "after pickling (copy.deepcopy, pickle) the packed words stay the signed view: qweight is "
           "int32 in the copy, which the ops refuse"),
    # ---- quantize_model --------------------------------------------------------------------------
    Mutant("c8-compute-dtypes-experts-unchecked", "torch_qmm/convert.py",
           "    _check_compute_dtypes(dtype, candidates + experts_modules)",
           "    _check_compute_dtypes(dtype, candidates)", CONVERT_DTYPES,
           "float64 fused experts are not checked before converting: the experts before them are "
           "converted, then these refused with an error about an argument 'dtype' never passed"),
    Mutant("c8-quantize-model-config-not-recorded", "torch_qmm/convert.py",
           "    summary.model_bytes_before, summary.model_bytes_after = model_before, _model_bytes(model)\n    _record_for_transformers(model)\n",
           "    summary.model_bytes_before, summary.model_bytes_after = model_before, _model_bytes(model)\n",
           TRANSFORMERS,
           "a transformers model quantized by quantize_model gets no quantization_config: save_pretrained "
           "writes a folder that reloads into float layers"),
    # ---- transformers integration ----------------------------------------------------------------
    Mutant("t8-recorded-config-quantizes-float-layers", "torch_qmm/interop/transformers.py",
           "        modules_to_not_convert=sorted(_float_layers(model)),",
           "        modules_to_not_convert=None,", TRANSFORMERS,
           "the recorded config lists no float layers: a reload quantizes the layers (the output head, "
           "those filter_fn left out) that were float when saved"),
    Mutant("t8-new-dtype-casts-into-codes", "torch_qmm/interop/transformers.py",
           "        return None if new in (torch.uint32, torch.uint8) else new",
           "        return new", TRANSFORMERS_FILES,
           "a float checkpoint tensor for qweight / fp scale codes is cast into uint32 / uint8 (rounded "
           "into other codes) instead of kept and refused"),
    Mutant("t8-loaded-integer-dtypes-unchecked", "torch_qmm/interop/transformers.py",
           "                if got != dtype:",
           "                if got != dtype and got.is_floating_point():", TRANSFORMERS_FILES,
           "an int32 / int64 qweight or integer scales in the checkpoint load as stored: only float "
           "mismatches are refused"),
    Mutant("t8-modules-to-not-convert-string-accepted", "torch_qmm/interop/transformers.py",
           "                isinstance(modules_to_not_convert, (list, tuple))",
           "                isinstance(modules_to_not_convert, (list, tuple, str))", TRANSFORMERS_CONFIG,
           "modules_to_not_convert='lm_head' (a string) is accepted and then matched character by "
           "character"),
    Mutant("h8-hook-finder-appended", "torch_qmm/transformers_hook.py",
           "        sys.meta_path.insert(0, _AfterTransformersImport())",
           "        sys.meta_path.append(_AfterTransformersImport())", TRANSFORMERS,
           "the import hook goes last on sys.meta_path: the path finder finds transformers first, the "
           "hook never runs, and `import torch_qmm` before transformers registers nothing"),
    # ---- calibration -----------------------------------------------------------------------------
    Mutant("q8-calibration-single-mapping-iterated", "torch_qmm/quantizers/calibration.py",
           "    if isinstance(calibration, (torch.Tensor, str, bytes, Mapping)):",
           "    if isinstance(calibration, (torch.Tensor, str, bytes, dict)):", CALIBRATION,
           "a tokenizer's BatchEncoding (a Mapping, not a dict) given as the calibration is iterated "
           "as samples (its keys) instead of refused with the 'pass [it]' hint"),
    Mutant("q8-token-id-at-vocab-size-accepted", "torch_qmm/quantizers/calibration.py",
           "    if low < 0 or high >= embedding.num_embeddings:",
           "    if low < 0 or high > embedding.num_embeddings:", CALIBRATION,
           "the token id equal to the vocabulary size passes the check: the embedding raises a bare "
           "IndexError (wrapped as a failed forward) instead of the ValueError naming the id"),
    Mutant("q8-one-token-calibration-text-accepted", "torch_qmm/quantizers/calibration.py",
           "    if len(ids) < 2:",
           "    if len(ids) < 1:", CALIBRATION_TEXT,
           "a calibration text of one token is accepted: the sample has no next token"),
    # ---- regular files, safetensors finiteness ---------------------------------------------------
    Mutant("g8-gguf-header-not-regular-file-unchecked", "torch_qmm/interop/gguf_header.py",
           "        check_regular_file(path)  # open() of a FIFO would wait for a writer",
           "        pass", HOSTILE_GGUF,
           "a GGUF path naming a folder or a FIFO is opened: IsADirectoryError (an OSError, not a "
           "GGUFFormatError) or a reader that waits forever"),
    Mutant("s8-finite-scan-slices-from-start", "torch_qmm/interop/safetensors_io.py",
           "                    part = view[r:r + step] if shape else view[:]",
           "                    part = view[r:step] if shape else view[:]", INSPECT,
           "the finiteness scan slices rows [r:step] instead of [r:r+step]: past the first slice every "
           "part is empty, so a NaN beyond the first slice of rows is not found"),
    # ---- llama GGUF ------------------------------------------------------------------------------
    Mutant("l8-llama-output-bias-not-attention", "torch_qmm/interop/gguf_llama.py",
           "_ATTENTION = (\"attn_q\", \"attn_k\", \"attn_v\", \"attn_output\")",
           "_ATTENTION = (\"attn_q\", \"attn_k\", \"attn_v\")", LLAMA,
           "the attention's output projection is left out of the bias names: attn_output.bias of a "
           "file with attention biases is refused as stray (or, alone, not detected)"),
    Mutant("l8-llama-integer-float-metadata-kept-int", "torch_qmm/interop/gguf_llama.py",
           "        value = float(value)  # an integer type in the file (LlamaConfig's float fields refuse an int)\n",
           "", LLAMA,
           "a float field stored with an integer GGUF type (rope_freq_base 10000 as uint32) reaches "
           "LlamaConfig as an int, which it refuses"),
    # ---- MLX config ------------------------------------------------------------------------------
    Mutant("m8-mlx-null-bits-not-resolved", "torch_qmm/interop/mlx.py",
           "    return QuantSpec(bits, group_size, mode)",
           "    return QuantSpec(entry[\"bits\"], entry[\"group_size\"], mode)", MLX,
           "a null group_size / bits (mlx_lm's mixed recipes) is checked with the mode's default but "
           "the spec keeps None: the layers are built with group_size None"),
    Mutant("m8-mlx-mode-unhashable-crashes", "torch_qmm/interop/mlx.py",
           "    if not isinstance(mode, str) or mode not in FORMATS:",
           "    if mode not in FORMATS:", MLX_HOSTILE,
           "a config whose mode is a list or object raises TypeError (unhashable) instead of the "
           "ValueError naming the field"),
    # ---- QuantEmbedding, GGUFLinear --------------------------------------------------------------
    Mutant("e8-embedding-assign-keeps-carrier-dtype", "torch_qmm/interop/modules.py",
           "        dtype = scales.dtype if scales.is_floating_point() else carrier.dtype",
           "        dtype = carrier.dtype", EMBEDDING_DTYPES,
           "load_state_dict(assign=True) of float16 affine scales leaves the compute dtype carrier "
           "float32: the embedding returns float32 rows for a float16 table"),
    Mutant("e8-embedding-fake-ids-read", "torch_qmm/interop/modules.py",
           "        elif compiling or flat.device.type == \"meta\" or is_fake(flat):",
           "        elif compiling or flat.device.type == \"meta\":", EMBEDDING_FAKE,
           "fake ids (FakeTensorMode, torch.export's tracing) take the eager range check, which reads "
           "their values: a data-dependent error instead of the checking op"),
    Mutant("e8-gguf-linear-bool-type-accepted", "torch_qmm/interop/gguf_types.py",
           "    if not isinstance(ggml_type, int) or isinstance(ggml_type, bool):",
           "    if not isinstance(ggml_type, int):", GGUF_LINEAR,
           "GGUFLinear(ggml_type=True) is taken as type 1 (F16): a ValueError about the type, not the "
           "TypeError naming the argument"),
    Mutant("e8-gguf-linear-ignores-autocast", "torch_qmm/interop/modules.py",
           "    @follows_autocast\n    def forward(self, x: torch.Tensor) -> torch.Tensor:\n        y = gguf_matmul(",
           "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n        y = gguf_matmul(",
           GGUF_AUTOCAST,
           "GGUFLinear does not follow torch.autocast: inside autocast(bfloat16) a float32 x gives a "
           "float32 output where nn.Linear gives bfloat16"),
    # ---- convert CLI -----------------------------------------------------------------------------
    Mutant("v8-cli-nul-only-at-start-refused", "torch_qmm/interop/cli_convert.py",
           "    if \"\\0\" in text:",
           "    if text.startswith(\"\\0\"):", CLI,
           "a --calibration file with a NUL byte after some text passes as plain text"),
    Mutant("v8-cli-lossless-casts-bf16-to-f16", "torch_qmm/interop/cli_convert.py",
           "_LOSSLESS_CASTS = {(\"F16\", torch.float32), (\"BF16\", torch.float32),",
           "_LOSSLESS_CASTS = {(\"F16\", torch.float32), (\"BF16\", torch.float16),", CLI,
           "the report's lossless casts hold BF16 -> float16 (which rounds) instead of BF16 -> float32: "
           "a BF16 tensor kept in float32 is reported rounded, one cast to float16 reported lossless"),
    Mutant("v8-cli-quantized-source-bits-dropped", "torch_qmm/interop/cli_convert.py",
           "    args.bits = None if per_layer else source.bits",
           "    args.bits = None", CLI,
           "the source folder's bits are not kept for the layers this run quantizes: an 8-bit folder's "
           "embedding and head (--format mlx) are quantized with the mode's default 4 bits"),
    # ---- bench rounds, selftest ------------------------------------------------------------------
    Mutant("b8-merge-rounds-skips-of-first-round-only", "torch_qmm/bench/kernels.py",
           "    skipped = {k: v for r in rounds for k, v in r.skipped.items()}",
           "    skipped = dict(first.skipped)", BENCH,
           "an implementation skipped in a later round only is dropped from the merged times without "
           "a reason in skipped"),
    Mutant("s8-selftest-csv-items-not-stripped", "torch_qmm/selftest.py",
           "        items = [kind(t.strip()) for t in text.split(\",\") if t.strip()]",
           "        items = [kind(t) for t in text.split(\",\") if t.strip()]", SELFTEST,
           "--modes 'affine, mxfp4' / --dtypes 'float16, bfloat16' keep the space: ' mxfp4' is refused "
           "as not a mode"),
    Mutant("s8-selftest-precision-always-highest", "torch_qmm/selftest.py",
           "    case.precision = route_precision(case.kernel)",
           "    case.precision = \"highest\"", SELFTEST_STRICT,
           "every case is held to precision 'highest', the bfloat16 GEMM route's too: a correct route "
           "fails, and the report shows the wrong precision"),
    # ---- C++ (each rebuilds the C++ scratch copy: --only-cpp) ------------------------------------
    Mutant("x8-actq-q6k-offset-sums-over-32-codes", "csrc/cpu/actq_gguf.cpp",
           "        sd[kSumsFrom + s] = Fmt::offset_factor * (d * float(block_sum(q + Fmt::kSub * s, Fmt::kSub)));",
           "        sd[kSumsFrom + s] = Fmt::offset_factor * (d * float(block_sum(q + Fmt::kSub * s, kBlock)));",
           ACTQ_GGUF,
           "the int8-activation GGUF path sums x over 32 codes (the affine path's x block) for each "
           "offset sum X_s, where Q6_K's sub-blocks hold 16: its -32 offsets are wrong (Q4_K, 32, is "
           "unchanged)"),
    Mutant("x8-actq-parts-start-mid-group", "csrc/cpu/actq_qmm.cpp",
           "part_chunks = chunk::chunks_per_group(G, C::kCodes);",
           "part_chunks = 1;", ACTQ_PARTS,
           "the vector int8-activation kernels let a part of a row of x start at any chunk: at small M "
           "(x rows cut into parts, one per thread) a part starts inside a group of 64 / 128, and that "
           "group's x sum (the hoisted bias term) is split between the parts"),
]
