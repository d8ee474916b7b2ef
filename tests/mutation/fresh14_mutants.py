"""Audit list 14: 26 Python mutants of the quantized embeddings in transformers folders (the
changes of 8ca575a..49a4add under torch_qmm/): TorchQmmConfig(embeddings=...)'s checks and its
to_dict, record_quantization_config and _ties_not_rebuilt (interop/transformers.py, 18: the
embedding's bits, the saved embeddings list, the reload's tie checks, MLX's "quantization" entry,
SigLIP's blocks skipped by transformers' init, the embedding's checks before loading, the bits
left to quantize_model, the reload's embed_scale, dtype and bits, the tied heads kept out of QuantLinear),
the embedding's tied heads (interop/modules.py, 2: listed_as_tied, replace_embedding's tie),
load_pretrained_sharded's QuantEmbedding (distributed/loading.py, 1: its embed_scale) and convert's
report (interop/cli_convert.py, 5: _why_embedding_float's flag, the rounded-scales wording,
_source_layers' QuantEmbedding, the summary's formats, the exact layers --requantize rest joins).

Selections are the test files that name the function under test, narrowed with -k to the tests
of the embeddings where a whole file would take minutes; pytest runs with -x, so a kill stops at
the first failing test. Results: tests/mutation/README.md ("Audit list 14")."""

from __future__ import annotations

from . import Mutant

HF = ("tests/test_interop_transformers.py", "-k", "embedding or tied or head or vision or torch_qmm_config")
HF_SAVE = ("tests/test_save_loaded_models.py", "tests/test_interop_transformers.py", "-k",
           "embedding or tied or head or vision or torch_qmm_config or reloads")
CONVERT = ("tests/test_cli_convert.py", "-k", "embedding or tied or torch_qmm or round or why or report or float")
SHARDED = ("tests/test_distributed.py", "-k", "transformers_save or pretrained")

MUTANTS: list[Mutant] = [
    # ---- interop/transformers.py: TorchQmmConfig(embeddings=...) -------------------------------------
    Mutant("m14-config-embeddings-twice-accepted", "torch_qmm/interop/transformers.py",
           "            if twice:\n"
           "                raise ValueError(f\"argument 'embeddings' names {twice[0]!r} more than once\")\n",
           "", HF,
           "TorchQmmConfig(embeddings=[e, e]) is accepted: the embedding is quantized twice on load (the "
           "second from the QuantEmbedding, not an nn.Embedding) instead of a clear error"),
    Mutant("m14-config-embedding-kept-float-accepted", "torch_qmm/interop/transformers.py",
           "            kept = sorted(set(embeddings) & set(modules_to_not_convert or ()))",
           "            kept = sorted(set(embeddings) & set(()))", HF,
           "an embedding that modules_to_not_convert also names is accepted: the config both keeps it "
           "float and quantizes it"),
    Mutant("m14-config-embeddings-mixedbits-accepted", "torch_qmm/interop/transformers.py",
           "            if isinstance(bits, MixedBits) and embeddings:",
           "            if isinstance(bits, MixedBits) and not embeddings:", HF,
           "a MixedBits budget with quantized embeddings is accepted (and a budget without them refused "
           "when embeddings=[]): the embedding gets no bits from a budget"),
    Mutant("m14-config-to-dict-drops-embeddings", "torch_qmm/interop/transformers.py",
           "\"modules_to_not_convert\": self.modules_to_not_convert, \"embeddings\": self.embeddings,",
           "\"modules_to_not_convert\": self.modules_to_not_convert,", HF,
           "the saved quantization_config lists no embeddings: a reload builds an nn.Embedding for the "
           "embedding's qweight / scales / biases"),
    Mutant("m14-quantized-layers-without-embeddings", "torch_qmm/interop/transformers.py",
           "    layers = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}",
           "    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}", HF_SAVE,
           "quantized_layers leaves the QuantEmbedding out: the recorded bits miss the embedding's (the "
           "reload takes another layer's or the '*' default)"),
    # ---- record_quantization_config / _ties_not_rebuilt ------------------------------------------------
    Mutant("m14-record-embeddings-not-listed", "torch_qmm/interop/transformers.py",
           "        embeddings=sorted(n for n, m in model.named_modules() if isinstance(m, QuantEmbedding)) or None)",
           "        embeddings=None)", HF_SAVE,
           "record_quantization_config of a loaded model with a QuantEmbedding does not list it: "
           "from_pretrained of its save rebuilds a float embedding"),
    Mutant("m14-ties-check-skipped", "torch_qmm/interop/transformers.py",
           "    untied = _ties_not_rebuilt(model)\n    if untied:",
           "    untied = []\n    if untied:", HF_SAVE,
           "record_quantization_config records a model whose ties a reload would not rebuild (a head of "
           "its own the config ties to the quantized embedding) as reloadable"),
    Mutant("m14-ties-non-input-embedding-accepted", "torch_qmm/interop/transformers.py",
           "            if m is not inputs:\n"
           "                found.append(f\"{name} (a QuantEmbedding that is not the model's input embedding)\")\n",
           "", HF_SAVE,
           "a QuantEmbedding other than the input embedding (a position embedding) is recorded as "
           "reloadable, where the reload refuses it"),
    Mutant("m14-ties-untied-config-accepted", "torch_qmm/interop/transformers.py",
           "        elif isinstance(m, TiedQuantLinear) and not (tied and m.embedding is inputs):",
           "        elif isinstance(m, TiedQuantLinear) and not m.embedding is inputs:", HF_SAVE,
           "a TiedQuantLinear in a model whose config does not tie the head is recorded as reloadable: "
           "the reload builds the head as a layer of its own, its weights absent from the checkpoint"),
    Mutant("m14-record-mlx-quantization-kept", "torch_qmm/interop/transformers.py",
           "    if isinstance(vars(model.config).get(\"quantization\"), dict):",
           "    if isinstance(vars(model.config).get(\"quantization\"), list):", HF_SAVE,
           "record_loaded_model keeps MLX's \"quantization\" entry of a loaded folder: save_pretrained "
           "writes it next to the quantization_config"),
    Mutant("m14-skip-inits-marks-the-layer", "torch_qmm/interop/transformers.py",
           "        parent_name = name.rpartition(\".\")[0]\n        if not parent_name:",
           "        parent_name = name\n        if not parent_name:", HF,
           "_skip_parent_inits marks the rebuilt layers themselves, not the blocks holding them: "
           "SigLIP's _init_weights of the block reads q_proj.weight, which a QuantLinear lacks"),
    # ---- _embedding_to_quantize and the quantizer ------------------------------------------------------
    Mutant("m14-embedding-star-bits-ignored", "torch_qmm/interop/transformers.py",
           "    if isinstance(cfg.bits, dict) and name not in cfg.bits and \"*\" not in cfg.bits:",
           "    if isinstance(cfg.bits, dict) and name not in cfg.bits:", HF,
           "an embedding without an entry of its own in a bits mapping is refused even where the mapping "
           "has a '*' default"),
    Mutant("m14-embedding-one-sharer-accepted", "torch_qmm/interop/transformers.py",
           "    if shared:\n",
           "    if len(shared) > 1:\n", HF,
           "an embedding whose weight one other embedding shares (T5EncoderModel's encoder.embed_tokens) "
           "is quantized: that embedding keeps reading the float table; only two or more are refused"),
    Mutant("m14-embedding-bits-left-to-quantize-model", "torch_qmm/interop/transformers.py",
           "        bits = {n: b for n, b in cfg.bits.items() if n not in embeddings} if isinstance(cfg.bits, dict) else cfg.bits",
           "        bits = cfg.bits", HF,
           "quantize_model gets the embedding's entry of the bits mapping (a layer it does not quantize)"),
    Mutant("m14-reload-embed-scale-dropped", "torch_qmm/interop/transformers.py",
           "                               dtype=embedding.weight.dtype, mode=cfg.mode, embed_scale=embedding_scale(embedding))",
           "                               dtype=embedding.weight.dtype, mode=cfg.mode)", HF,
           "a reloaded Gemma QuantEmbedding loses its embed_scale (sqrt(hidden)): its lookups are not scaled"),
    Mutant("m14-reload-embedding-float32", "torch_qmm/interop/transformers.py",
           "device=embedding.weight.device,\n                               dtype=embedding.weight.dtype,",
           "device=embedding.weight.device,\n                               dtype=torch.float32,", HF,
           "a reloaded QuantEmbedding is built in float32 whatever the model's dtype: a bfloat16 model's "
           "embedding computes (and holds its scales) in float32"),
    Mutant("m14-quantize-embedding-bits-of-star", "torch_qmm/interop/transformers.py",
           "                embedding, bits=cfg.layer_bits(name), group_size=cfg.group_size, mode=cfg.mode))",
           "                embedding, bits=cfg.layer_bits(\"*\") if isinstance(cfg.bits, dict) and \"*\" in cfg.bits else cfg.layer_bits(name), group_size=cfg.group_size, mode=cfg.mode))",
           HF,
           "on load the embedding is quantized with the '*' default of the bits mapping, not its own entry "
           "(the bits of the other layers)"),
    Mutant("m14-tied-head-quantized-as-linear", "torch_qmm/interop/transformers.py",
           "and m.in_features % gs == 0 and name not in tied",
           "and m.in_features % gs == 0", HF,
           "a head tied to the quantized embedding is quantized as a QuantLinear of its own (no tie) where "
           "modules_to_not_convert does not keep it float"),
    # ---- interop/modules.py: the tied heads of an embedding ------------------------------------------
    Mutant("m14-listed-as-tied-source-not-prefixed", "torch_qmm/interop/modules.py",
           "            if (f\"{prefix}.{source}\" if prefix else source) == f\"{name}.weight\"}",
           "            if source == f\"{name}.weight\"}", HF,
           "listed_as_tied compares a nested model's tied source without its prefix: a multimodal model's "
           "text head (listed in the language model) is not found tied to model.language_model.embed_tokens"),
    Mutant("m14-replace-embedding-head-not-tied", "torch_qmm/interop/modules.py",
           "    for head in heads:\n        tie_output(model, head, new)\n    return heads",
           "    return heads", HF,
           "replace_embedding leaves the tied heads as they are: an nn.Linear holding the float table "
           "(or, before loading, the meta one) instead of a TiedQuantLinear reading the quantized table"),
    # ---- distributed/loading.py: load_pretrained_sharded's QuantEmbedding ---------------------------
    Mutant("m14-sharded-embed-scale-dropped", "torch_qmm/distributed/loading.py",
           "device=\"meta\", dtype=dtype, mode=mode, embed_scale=embedding_scale(module))",
           "device=\"meta\", dtype=dtype, mode=mode)", SHARDED,
           "load_pretrained_sharded builds a Gemma QuantEmbedding without its embed_scale"),
    # ---- interop/cli_convert.py: convert's report --------------------------------------------------
    Mutant("m14-why-embedding-float-gguf-flag-inverted", "torch_qmm/interop/cli_convert.py",
           "                f\"{' --requantize rest' if gguf else ''} does\")",
           "                f\"{' --requantize rest' if not gguf else ''} does\")", CONVERT,
           "the report of a float embedding in the transformers format names --requantize rest for a float "
           "folder and not for a GGUF file"),
    Mutant("m14-report-rounded-scales-repeats-source", "torch_qmm/interop/cli_convert.py",
           "                   else f\"{src} scales rounded to {str(scales.dtype)[6:]} -> {fmt}\")",
           "                   else f\"{src} scales rounded to {str(scales.dtype)[6:]} {src} -> {fmt}\")", CONVERT,
           "the report of a kept layer whose scales --dtype rounded names its source twice (\"Q4_K scales "
           "rounded to float16 Q4_K -> affine b4 gs32\"), the wording the report had before"),
    Mutant("m14-exact-linears-skip-embedding", "torch_qmm/interop/cli_convert.py",
           "             if len(t.shape) == 2 and t.ggml_type in _EXACT_TYPES}",
           "             if len(t.shape) == 2 and t.ggml_type in _EXACT_TYPES and t.name != \"token_embd.weight\"}",
           CONVERT,
           "_exact_linears leaves out the embedding, which the transformers format now keeps exact: a file "
           "whose only exact layer is the embedding is re-quantized (--requantize rest) with another group "
           "size than the embedding's 32, which one quantization_config cannot hold"),
    Mutant("m14-source-layers-without-embedding", "torch_qmm/interop/cli_convert.py",
           "        if isinstance(m, (QuantLinear, QuantEmbedding, QuantFusedExperts)):\n            origin[name] = _quant_format(m)",
           "        if isinstance(m, (QuantLinear, QuantFusedExperts)):\n            origin[name] = _quant_format(m)",
           CONVERT,
           "_source_layers leaves a torch_qmm folder's QuantEmbedding out: the report calls it float "
           "and never says whether its scales were rounded"),
    Mutant("m14-summary-formats-keep-why", "torch_qmm/interop/cli_convert.py",
           "                      else how.split(\" (\")[0] if how.startswith(\"kept \") else how",
           "                      else how.split(\" (its \")[0] if how.startswith(\"kept \") else how", CONVERT,
           "the summary's formats keep an embedding's reason (\"kept float (the transformers format ...)\") "
           "as a format of its own"),
]
