"""A llama-family GGUF file (llama, mistral, qwen2, qwen3, and the mixture-of-experts qwen2moe,
qwen3moe, gpt-oss and Mixtral, which llama.cpp writes as llama with experts: gguf_moe) into a
transformers model of the same architecture.

Facts from llama.cpp's convert_hf_to_gguf.py and transformers' GGUF loader
(integrations/ggml.py, integrations/gguf/gguf_conversion_mapping.py, modeling_gguf_pytorch_utils.py):
* names: token_embd -> model.embed_tokens, output -> lm_head, output_norm -> model.norm,
  blk.N.{attn_q,attn_k,attn_v,attn_output} -> model.layers.N.self_attn.{q,k,v,o}_proj,
  blk.N.{ffn_gate,ffn_up,ffn_down} -> model.layers.N.mlp.{gate,up,down}_proj,
  blk.N.attn_norm -> input_layernorm, blk.N.ffn_norm -> post_attention_layernorm (no +1 offset);
  qwen3's blk.N.{attn_q_norm,attn_k_norm} -> self_attn.{q_norm,k_norm};
* for llama and mistral (whose rotary embedding llama.cpp computes on interleaved pairs) llama.cpp
  permutes the rows of attn_q (n_head heads) and attn_k (n_kv_head heads) from Hugging Face's
  rotate-half order to interleaved pairs: rows of one head go from [2, head_dim/2] to
  [head_dim/2, 2]. We undo it as a row permutation, so it applies unchanged to quantized rows
  (GGUF blocks never cross rows): the file's blocks are kept, only reordered. qwen2 and qwen3 are
  written unpermuted (llama.cpp rotates their halves, as transformers does);
* qwen2's q, k and v projections always have biases (its config has no flag for them);
* config: llama.{block_count, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.layer_norm_rms_epsilon, rope.freq_base, context_length,
  rope.dimension_count, attention.key_length / value_length (the head dim where it is not
  embedding_length / head_count)}; the special token ids tokenizer.ggml.{bos,eos,padding}_token_id (the
  unknown token has no config field: it is in the tokenizer files, see gguf_tokenizer);
* gpt-oss (convert_hf_to_gguf.py's GptOssModel, llama.cpp's LLM_ARCH_OPENAI_MOE): the norm after
  attention is blk.N.post_attention_norm, the attention sinks blk.N.attn_sinks.weight [n_head]
  (transformers' self_attn.sinks), the router blk.N.ffn_gate_inp (mlp.router, with a bias); every
  attention projection has a bias; gpt-oss.attention.sliding_window is the window of the
  sliding layers (every other layer from the first, in llama.cpp and transformers alike);
  rope.scaling.{type = "yarn", factor, original_context_length, yarn_beta_fast, yarn_beta_slow}
  give transformers' yarn rope_parameters, without truncating the correction range (gpt-oss's own
  config: truncate False). SwiGLU's limit 7 and alpha 1.702 are not in the file: llama.cpp and
  GptOssConfig both fix them.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..convert import record_loaded_model
from ..nn import QuantLinear
from ..nn_moe import QuantFusedExperts
from .gguf import GGUFFile, GGUFTensor, dequantize, embedding_from_gguf, linear_from_gguf
from .gguf_moe import (GPT_OSS_EXPERTS, INT_FIELDS as _MOE_INT_FIELDS, MIXTRAL_EXPERTS, MOE_RENAMES, QWEN_EXPERTS,
                       ExpertFields,
                       block_experts, checked_shape, describe, expected_shapes, expert_part, experts_from_gguf,
                       experts_module_name, fill_float_experts, moe_config, moe_config_keys, per_expert_layout,
                       shared_gate_tensor)
from .experts import layout_of
from .gguf_types import SUPPORTED_TYPES, supported_list
from .meta import MetaTensors, cast_stored, check_no_meta, compute_buffers, resolve_device
from .mlx import LoadReport
from .modules import GGUFLinear, QuantEmbedding, TiedQuantLinear, replace_module, tie_output



@dataclass(frozen=True)
class Architecture:
    """What differs between the llama-family architectures a GGUF file may name."""

    model_type: str  # transformers' model type (its config and model classes)
    permuted_qk: bool  # llama.cpp permuted the Q / K rows (see the module docstring)
    bias_flags: tuple[str, ...]  # config flags that give projections biases (LlamaConfig's two)
    fixed_biases: tuple[str, ...]  # GGUF projections that always have biases
    qk_norm: bool  # an RMSNorm over each head of q and k (attn_q_norm / attn_k_norm)
    experts: ExpertFields | None = None  # every block a MoE block, its config fields (gguf_moe)
    shared_expert: bool = False  # a gated shared expert beside the routed ones
    norm_topk_prob: bool | None = None  # whether llama.cpp normalizes the top-k routing weights
    renames: tuple[tuple[str, str], ...] = ()  # tensor names of this architecture (before the shared ones)
    ffn_norm: str = "ffn_norm"  # the GGUF name of the norm before the MLP
    sinks: bool = False  # attention sinks, one per head (blk.N.attn_sinks.weight)
    moe_biases: bool = False  # the router and the experts have biases
    config_keys: tuple[tuple[str, str], ...] = ()  # more metadata keys -> config fields
    yarn: dict | None = None  # transformers' yarn parameters the file does not carry (None: yarn not mapped)


ARCHITECTURES = {
    "llama": Architecture("llama", True, ("attention_bias", "mlp_bias"), (), False),
    "mistral": Architecture("llama", True, ("attention_bias", "mlp_bias"), (), False),
    "qwen2": Architecture("qwen2", False, (), ("attn_q", "attn_k", "attn_v"), False),
    "qwen3": Architecture("qwen3", False, ("attention_bias",), (), True),
    "qwen2moe": Architecture("qwen2_moe", False, (), ("attn_q", "attn_k", "attn_v"), False, experts=QWEN_EXPERTS,
                             shared_expert=True, norm_topk_prob=False),
    "qwen3moe": Architecture("qwen3_moe", False, ("attention_bias",), (), True, experts=QWEN_EXPERTS,
                             norm_topk_prob=True),
}
ARCHITECTURES["gpt-oss"] = Architecture(
    "gpt_oss", False, ("attention_bias",), (), False, experts=GPT_OSS_EXPERTS,
    renames=((r"\.ffn_gate_inp\.", ".mlp.router."), (r"\.attn_sinks\.weight$", ".self_attn.sinks"),
             (r"\.post_attention_norm\.", ".post_attention_layernorm.")),
    ffn_norm="post_attention_norm", sinks=True, moe_biases=True,
    config_keys=(("attention.sliding_window", "sliding_window"),),
    yarn={"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})
LLAMA_FAMILY = tuple(ARCHITECTURES)
# llama.cpp writes Mixtral as architecture llama with {arch}.expert_count > 0.
MIXTRAL = Architecture("mixtral", True, (), (), False, experts=MIXTRAL_EXPERTS)


def architecture_of(f: GGUFFile) -> Architecture:
    """The file's architecture; ValueError naming it outside the llama family."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: architecture {arch!r} is not in the llama family {LLAMA_FAMILY}")
    count = f.get_metadata(f"{arch}.expert_count")
    if arch in ("llama", "mistral") and count is not None and count != 0:
        return MIXTRAL
    return ARCHITECTURES[arch]

_RENAMES = MOE_RENAMES + [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.", r"model.layers.\1."),
    (r"\.attn_q\.", ".self_attn.q_proj."),
    (r"\.attn_k\.", ".self_attn.k_proj."),
    (r"\.attn_v\.", ".self_attn.v_proj."),
    (r"\.attn_output\.", ".self_attn.o_proj."),
    (r"\.ffn_gate\.", ".mlp.gate_proj."),
    (r"\.ffn_up\.", ".mlp.up_proj."),
    (r"\.ffn_down\.", ".mlp.down_proj."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.attn_q_norm\.", ".self_attn.q_norm."),
    (r"\.attn_k_norm\.", ".self_attn.k_norm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
]
# Not model parameters: llama.cpp's per-frequency rotary factors (Llama 3.1-style scaling), which
# transformers derives from the config instead (checked in _warn_unmapped_rope).
_SKIPPED = ("rope_freqs.weight",)

# GGUF metadata key (after "<arch>.") -> LlamaConfig field (transformers integrations/ggml.py).
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
# GGUF special token ids -> LlamaConfig fields. Absent from the file: None (LlamaConfig's own
# defaults, bos 1 / eos 2, belong to one vocabulary and are not the file's).
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def hf_name(gguf_name: str, arch: Architecture | None = None) -> str | None:
    """The transformers parameter name of a GGUF tensor of architecture `arch` (default: the
    llama names) (None: not a model parameter)."""
    if gguf_name in _SKIPPED:
        return None
    name = gguf_name
    for pattern, repl in (arch.renames if arch is not None else ()) + tuple(_RENAMES):
        name = re.sub(pattern, repl, name)
    return name


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """Index p with hf_rows = gguf_rows[p]: undoes llama.cpp's Q/K permutation of `rows` rows."""
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot undo the Q/K permutation: {rows} rows are not n_head={n_head} heads of even size")
    # gguf row (h, i, j) [head, head_dim/2, 2] holds hf row (h, j, i) [head, 2, head_dim/2].
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def llama_config_from_gguf(f: GGUFFile):
    """The transformers config of the file's architecture (LlamaConfig, Qwen2Config, Qwen3Config)
    from its metadata, checked against the tensor shapes (check_llama_metadata) before anything is
    built from it. ``transformers.AutoModelForCausalLM.from_config`` builds the model."""
    from transformers import AutoConfig

    kwargs = check_llama_metadata(f)
    kwargs.update(_special_token_ids(f, kwargs["vocab_size"]))
    kind = architecture_of(f)
    rope = _yarn_parameters(f, kind, kwargs)
    if rope is None:
        _warn_unmapped_rope(f, f.architecture)
        if kind.yarn is not None:  # the config class's default would be its model's yarn, not the file's rope
            rope = {"rope_type": "default", "rope_theta": kwargs.get("rope_theta", _LLAMA_CPP_FREQ_BASE)}
    if rope is not None:
        kwargs["rope_parameters"] = rope
        kwargs.pop("rope_theta", None)
    return AutoConfig.for_model(kind.model_type, **kwargs)


# llama.cpp's rotary base where a file has no {arch}.rope.freq_base.
_LLAMA_CPP_FREQ_BASE = 10000.0
# llama.cpp's yarn keys that transformers' rope_parameters of these models do not take.
_UNMAPPED_YARN_KEYS = ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier")


def _yarn_parameters(f: GGUFFile, kind: Architecture, kwargs: dict) -> dict | None:
    """transformers' rope_parameters of a yarn-scaled file of an architecture whose yarn is mapped
    (Architecture.yarn), else None. Keys of llama.cpp's yarn that the mapping does not carry get a
    warning."""
    arch = f.architecture
    if kind.yarn is None or f.get_metadata(f"{arch}.rope.scaling.type") != "yarn":
        return None
    unmapped = [k for k in _UNMAPPED_YARN_KEYS if f.get_metadata(f"{arch}.{k}") is not None]
    if unmapped:
        warnings.warn(f"{f.path}: the file's yarn has {', '.join(f'{arch}.{k}' for k in unmapped)}, which the "
                      f"transformers config of {kind.model_type!r} does not take: outputs may differ from "
                      "llama.cpp's", stacklevel=3)
    rope = {"rope_type": "yarn", **kind.yarn}
    keys = {"rope.scaling.factor": "factor", "rope.scaling.original_context_length": "original_max_position_embeddings",
            "rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow"}
    for key, field in keys.items():
        value = f.get_metadata(f"{arch}.{key}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{f.path}: metadata '{arch}.{key}' must be a positive finite number, got {value!r}")
        rope[field] = int(value) if field == "original_max_position_embeddings" else float(value)
    for field, key in (("factor", "rope.scaling.factor"), ("original_max_position_embeddings",
                                                          "rope.scaling.original_context_length")):
        if field not in rope:
            raise ValueError(f"{f.path}: metadata '{arch}.rope.scaling.type' is 'yarn' but '{arch}.{key}' is missing")
    rope["rope_theta"] = kwargs.get("rope_theta", _LLAMA_CPP_FREQ_BASE)
    return rope


# Metadata that must be a positive integer / a positive finite float when present.
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", *_MOE_INT_FIELDS)
_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
# Largest context length accepted (2^24 tokens, far beyond any llama-family model).
_MAX_CONTEXT = 2**24


def _metadata_value(f: GGUFFile, arch: str, key: str, field: str):
    value = f.get_metadata(f"{arch}.{key}")
    if value is None:
        return None
    where = f"{f.path}: metadata '{arch}.{key}'"
    if field in _INT_FIELDS:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where} must be a positive integer, got {value!r}")
        if field == "max_position_embeddings" and value > _MAX_CONTEXT:
            raise ValueError(f"{where} = {value} is larger than {_MAX_CONTEXT} (corrupt metadata?)")
    else:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where} must be a positive finite number, got {value!r}")
        value = float(value)  # an integer type in the file (LlamaConfig's float fields refuse an int)
    return value


def check_llama_metadata(f: GGUFFile) -> dict:
    """The config fields of a llama-family GGUF file, after checking every one against the
    tensors the file holds: each parameter of the transformers model these fields describe must be
    a tensor of exactly that shape, and every block 0 .. block_count-1 must be present. So the
    model built from the result holds no more values than the file's tensors.

    Raises ValueError naming the file and the metadata key or tensor that disagrees.
    """
    arch, kind = f.architecture, architecture_of(f)
    kwargs = {}
    keys = {**_CONFIG_KEYS, **(moe_config_keys(kind.experts, kind.shared_expert) if kind.experts else {}),
            **dict(kind.config_keys)}
    for key, field in keys.items():
        value = _metadata_value(f, arch, key, field)
        if value is not None:
            kwargs[field] = value
    if kind.experts:
        moe_config(f, arch, kwargs, kind.experts, kind.shared_expert)
        if kind.norm_topk_prob is not None:
            kwargs["norm_topk_prob"] = kind.norm_topk_prob
    _head_dim_from_lengths(f, arch, kwargs)
    for required in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if required not in kwargs:
            key = next(k for k, v in _CONFIG_KEYS.items() if v == required)
            raise ValueError(f"{f.path}: metadata '{arch}.{key}' (gives {required}) is missing")
    if "token_embd.weight" not in f.tensors:
        raise ValueError(f"{f.path}: no token_embd.weight tensor")
    embd = f.tensors["token_embd.weight"].shape
    if len(embd) != 2 or embd[0] < 1:
        raise ValueError(f"{f.path}: tensor 'token_embd.weight' must be [vocab >= 1, hidden], got {list(embd)}")
    kwargs["vocab_size"] = embd[0]
    kwargs["tie_word_embeddings"] = "output.weight" not in f.tensors
    # Biases have no metadata key: llama.cpp stores them as optional tensors of block 0 and on
    # (LlamaConfig has one flag for the attention's four projections and one for the MLP's three;
    # Qwen3Config the attention's only; qwen2's q, k, v always have them).
    for flag in kind.bias_flags:
        kwargs[flag] = any(f"blk.0.{p}.bias" in f.tensors for p in _BIASED_BY[flag])
    _check_shapes(f, arch, kwargs)
    _check_types(f)
    return kwargs


def _check_types(f: GGUFFile) -> None:
    """Every tensor of a type torch_qmm reads, checked before a model is built: a file with others
    (IQ2_XXS or IQ3_S, say) is refused naming them and how many."""
    unread: dict[str, int] = {}
    for t in f.tensors.values():
        if t.ggml_type not in SUPPORTED_TYPES:
            unread[t.type_name] = unread.get(t.type_name, 0) + 1
    if unread:
        found = ", ".join(f"{name} ({count} tensor{'s' * (count > 1)})" for name, count in sorted(unread.items()))
        raise ValueError(f"{f.path}: holds tensors of GGUF types torch_qmm does not read: {found}; it reads "
                         f"{supported_list()}")


_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
_MLP = ("ffn_gate", "ffn_up", "ffn_down")
_BIASED_BY = {"attention_bias": _ATTENTION, "mlp_bias": _MLP}


def _head_dim_from_lengths(f: GGUFFile, arch: str, kwargs: dict) -> None:
    """head_dim from {arch}.attention.key_length / value_length (llama.cpp writes them where the
    model's config names a head dim), which must agree with each other and with
    rope.dimension_count: transformers' models have one head dim for q, k, v and the rotary
    embedding."""
    for key in ("attention.key_length", "attention.value_length"):
        value = _metadata_value(f, arch, key, "head_dim")
        if value is None:
            continue
        if "head_dim" in kwargs and kwargs["head_dim"] != value:
            raise ValueError(f"{f.path}: metadata '{arch}.{key}' = {value} differs from the head dim "
                             f"{kwargs['head_dim']} of '{arch}.rope.dimension_count' or key_length (a partial "
                             "rotary embedding or different key and value heads, which the transformers model of "
                             f"{arch!r} cannot hold)")
        kwargs["head_dim"] = value


def _check_shapes(f: GGUFFile, arch: str, c: dict) -> None:
    hidden, n_head, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    n_kv = c.get("num_key_value_heads", n_head)
    if n_head % n_kv:
        raise ValueError(f"{f.path}: metadata '{arch}.attention.head_count' = {n_head} is not a multiple of "
                         f"'{arch}.attention.head_count_kv' = {n_kv}")
    if "head_dim" not in c and hidden % n_head:
        raise ValueError(f"{f.path}: metadata '{arch}.embedding_length' = {hidden} is not a multiple of "
                         f"'{arch}.attention.head_count' = {n_head} (and no '{arch}.rope.dimension_count')")
    head_dim = c.get("head_dim", hidden // n_head)
    if head_dim % 2:
        raise ValueError(f"{f.path}: head dim {head_dim} (from '{arch}.rope.dimension_count' or embedding_length / "
                         "head_count) must be even for rotary embeddings")
    blocks = sorted({int(m.group(1)) for name in f.tensors if (m := re.match(r"^blk\.(\d+)\.", name))})
    if len(blocks) != layers or blocks != list(range(layers)):  # (the length first: never build a huge range)
        raise ValueError(f"{f.path}: metadata '{arch}.block_count' = {layers} but the file holds tensors for "
                         f"blocks {_ranges(blocks)}")
    vocab, kind = c["vocab_size"], architecture_of(f)
    ffn_up = f.tensors.get("blk.0.ffn_up.weight")
    ffn = c.get("intermediate_size", ffn_up.shape[0] if ffn_up is not None and ffn_up.shape else None)
    if ffn is None and not kind.experts:
        raise ValueError(f"{f.path}: no '{arch}.feed_forward_length' and no blk.0.ffn_up.weight to infer it from")
    if ffn is not None:
        c.setdefault("intermediate_size", ffn)
    expected = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not c["tie_word_embeddings"]:
        expected["output.weight"] = (vocab, hidden)
    for i in range(layers):
        expected.update({
            f"blk.{i}.attn_q.weight": (n_head * head_dim, hidden), f"blk.{i}.attn_k.weight": (n_kv * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (n_kv * head_dim, hidden), f"blk.{i}.attn_output.weight": (hidden, n_head * head_dim),
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.{kind.ffn_norm}.weight": (hidden,),
        })
        if kind.sinks:
            expected[f"blk.{i}.attn_sinks.weight"] = (n_head,)
        if kind.experts:
            expected.update(expected_shapes(i, c, kind.experts, kind.shared_expert, per_expert_layout(f),
                                            kind.moe_biases))
        else:
            expected.update({f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                             f"blk.{i}.ffn_down.weight": (hidden, ffn)})
        for flag, names in _BIASED_BY.items():
            if c.get(flag):  # every projection of the kind then has a bias of its rows
                expected.update({f"blk.{i}.{n}.bias": (expected[f"blk.{i}.{n}.weight"][0],) for n in names})
        expected.update({f"blk.{i}.{n}.bias": (expected[f"blk.{i}.{n}.weight"][0],) for n in kind.fixed_biases})
        if kind.qk_norm:
            expected.update({f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)})
    # load_gguf_llama reads a bias with its weight: one the model has no place for would be dropped,
    # or given to a layer the config says has none.
    stray = sorted(n for n in f.tensors if n.endswith(".bias") and n not in expected)
    if stray:
        takes = ", ".join([f"{flag} {c[flag]}" for flag in kind.bias_flags]
                          + [f"always {', '.join(kind.fixed_biases)}"] * bool(kind.fixed_biases)
                          + ["the router and experts"] * kind.moe_biases)
        raise ValueError(f"{f.path}: tensor {stray[0]!r} is a bias the {arch} model has no place for (it takes "
                         "biases of the projections its config's flags give them, in every block when block 0 has "
                         f"them; here {takes})")
    for name, shape in expected.items():
        t = f.tensors.get(name)
        if t is None:
            raise ValueError(f"{f.path}: no tensor {name!r}, which the metadata ({arch}.*) implies")
        if checked_shape(name, tuple(t.shape)) != shape:
            raise ValueError(f"{f.path}: tensor {name!r} has shape {list(t.shape)}, but the metadata ({arch}.* "
                             f"embedding_length, head counts, feed_forward_length, vocab) implies {list(shape)}")


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return ", ".join(map(str, values[:10])) + (" ..." if len(values) > 10 else "")


def _warn_unmapped_rope(f: GGUFFile, arch: str) -> None:
    """The config carries the plain rotary embedding only: a file that scales it (llama.cpp's
    rope_freqs.weight factors, or {arch}.rope.scaling.type) gets a warning, not a silent change."""
    scaling = f.get_metadata(f"{arch}.rope.scaling.type")
    freqs = f.tensors.get("rope_freqs.weight")
    scaled_freqs = freqs is not None and not bool((dequantize(freqs) == 1).all())
    if (scaling not in (None, "none")) or scaled_freqs:
        what = "rope_freqs.weight (per-frequency factors)" if scaled_freqs else f"{arch}.rope.scaling.type={scaling!r}"
        warnings.warn(
            f"{f.path}: the file scales the rotary embedding ({what}); the transformers config built from it "
            "has the unscaled rotary embedding, so outputs differ from llama.cpp's (most at long context)",
            stacklevel=3,
        )


def _special_token_ids(f: GGUFFile, vocab_size: int) -> dict[str, int | None]:
    """{bos,eos,pad}_token_id from the file's tokenizer metadata. An id that names no token is
    dropped with a warning (as llama.cpp's loader does: the special token is optional, the
    weights are still good)."""
    tokens = f.header.kv.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if tokens is not None else vocab_size
    limit = min(vocab_size, n_tokens)
    out: dict[str, int | None] = {}
    for key, field in _TOKEN_ID_KEYS.items():
        value = f.get_metadata(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit):
            warnings.warn(
                f"{f.path}: metadata {key} = {value!r} is not a token id in [0, {limit}) (the vocabulary has "
                f"{n_tokens} tokens, token_embd.weight {vocab_size} rows); the config gets {field}=None",
                stacklevel=3,
            )
            value = None
        out[field] = value
    return out


def _check_model_type(f: GGUFFile, config) -> Architecture:
    """The file's architecture, which must be the model's (a llama model cannot hold qwen2's biases
    nor read qwen's unpermuted rows as permuted ones)."""
    kind = architecture_of(f)
    arch, want = f.architecture, kind.model_type
    got = getattr(config, "model_type", None)
    if got != want:
        raise ValueError(f"{f.path}: the file's architecture is {arch!r} (transformers model type {want!r}), the "
                         f"model's config is {got!r}; build the model from the file: "
                         "transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f))")
    return kind


def _rows_permuted(t: GGUFTensor, perm: torch.Tensor) -> GGUFTensor:
    return GGUFTensor(t.name, t.ggml_type, t.shape, t.raw[perm.numpy()], t.source)


def load_gguf_llama(
    model: nn.Module,
    path: str | os.PathLike | GGUFFile,
    dtype: torch.dtype = torch.float32,
    strict: bool = True,
    progress: bool | None = None,
    device: torch.device | str | None = None,
) -> LoadReport:
    """Loads a llama-family GGUF file into a transformers model (e.g. LlamaForCausalLM built from
    `llama_config_from_gguf`), in place.

    Linear weights become QuantLinear (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, and IQ4_NL/IQ4_XS as 8-bit:
    lossless; MXFP4: mode mxfp4, the
    same bits), GGUFLinear (the K-quants Q2_K .. Q6_K, IQ4_XS and the lattice i-quants, the file's blocks) or stay nn.Linear
    (F32/F16/BF16); the routed experts of a MoE file (qwen2moe, qwen3moe, gpt-oss, Mixtral) become
    a QuantFusedExperts in the same formats (gguf_moe: GGUFSwitchLinear for the native types); the embedding becomes a QuantEmbedding (the
    32-weight block types, and Q5_K as bits 5: lossless in float32 only) or a float table; without output.weight the output layer is tied to it.

    The model may be built on the meta device (``with torch.device("meta"): model =
    LlamaForCausalLM(llama_config_from_gguf(f))``), which costs no memory: the quantized layers
    are then built from the file's blocks, the other tensors the file holds (norms, a float
    embedding or output layer, biases) are created from it on `device`, the rotary embedding's
    frequencies are computed again from the config (torch_qmm.interop.meta.compute_buffers) and
    any tensor still without values is a ValueError naming it; the load then peaks near the
    file's size instead of the float model's. A model built in memory is filled where it is, as
    before.

    Args:
        model: the transformers model, modified in place (its float tensors cast to `dtype`).
        path: the GGUF file (or an open GGUFFile).
        dtype: the compute dtype.
        strict: every model tensor must come from the file and every file tensor be used.
        progress: tqdm bar (default: for more than 32 tensors).
        device: where a model built on the meta device gets its tensors (default: the CPU);
            only for such a model (one in memory is moved with .to()).

    Raises:
        ValueError when the file disagrees with the model (names, shapes, head counts), and for a
        model built on meta whose tensors the file does not all give.
    """
    target = resolve_device(model, device, "load_gguf_llama")
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    _check_not_loaded(model, f)
    config = getattr(model, "config", None)
    arch = _check_model_type(f, config)
    n_head = getattr(config, "num_attention_heads", None)
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    if n_head is None:
        raise ValueError("the model has no config.num_attention_heads (needed to undo the Q/K permutation)")
    cast_stored(model, dtype)
    meta = MetaTensors(model, target) if target is not None else None
    report = LoadReport(quantized={}, float_tensors=0, bytes_read=0)
    biases = {hf_name(n, arch): t for n, t in f.tensors.items() if n.endswith(".bias")}
    # a bias of an nn.Linear is read with its weight; others (gpt-oss's router's) are tensors of their own
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    loaded: set[str] = set()
    state = model.state_dict()
    expert_blocks: set[int] = set()  # blocks with routed experts, read once the tensors are known
    show = progress if progress is not None else len(f.tensors) > 32
    for gname, t in tqdm(list(f.tensors.items()), desc="loading gguf", disable=not show, unit="tensor"):
        f.check_unchanged()
        part = expert_part(gname)
        if part is not None:
            expert_blocks.add(part[0])
            continue
        name = hf_name(gname, arch)
        if name is None or (gname.endswith(".bias") and name.rpartition(".")[0] in linears):
            continue
        t = shared_gate_tensor(t)
        module_name, _, leaf = name.rpartition(".")
        perm = None
        if arch.permuted_qk and (".attn_q." in gname or ".attn_k." in gname):
            heads, field = (n_head, "num_attention_heads") if ".attn_q." in gname else (n_kv, "num_key_value_heads")
            try:
                perm = unpermute_rows(t.shape[0], heads)
            except ValueError as e:
                raise ValueError(f"{f.path}: tensor {gname!r} does not fit the model's config.{field} = {heads} "
                                 f"({e}); build the model from this file's metadata "
                                 "(torch_qmm.interop.gguf_llama.llama_config_from_gguf)") from None
            t = _rows_permuted(t, perm)
        module = _module(model, module_name, strict, f"{f.path}: tensor {gname!r} -> {name!r}")
        if module is None:
            continue
        report.bytes_read += t.nbytes
        if isinstance(module, nn.Linear) and leaf == "weight":
            if t.shape != (module.out_features, module.in_features):
                raise ValueError(
                    f"{f.path}: tensor {gname!r} has shape {list(t.shape)}, model layer {module_name!r} expects "
                    f"[{module.out_features}, {module.in_features}] (config disagrees with the file)"
                )
            bias_t = biases.get(f"{module_name}.bias")
            bias = dequantize(bias_t).to(dtype).reshape(-1) if bias_t is not None else None
            if bias is not None and perm is not None:  # qwen-style q/k biases follow their rows
                bias = bias[perm]
            new = linear_from_gguf(t, bias=bias, dtype=dtype)
            replace_module(model, module_name, new if target is None else new.to(target))
            loaded.update({name} | ({f"{module_name}.bias"} if bias is not None else set()))
            if isinstance(new, (QuantLinear, GGUFLinear)):
                report.quantized[module_name] = t.type_name
            else:
                report.float_tensors += 1
        elif isinstance(module, nn.Embedding) and leaf == "weight":
            if t.shape != (module.num_embeddings, module.embedding_dim):
                raise ValueError(
                    f"{f.path}: tensor {gname!r} has shape {list(t.shape)}, model embedding {module_name!r} expects "
                    f"[{module.num_embeddings}, {module.embedding_dim}] (config disagrees with the file)"
                )
            new = embedding_from_gguf(t, dtype=dtype)
            if target is not None:
                new = new.to(target)
            tied = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight is module.weight]
            replace_module(model, module_name, new)
            if isinstance(new, QuantEmbedding):
                report.quantized[module_name] = t.type_name
            for out_name in tied:  # re-tie outputs that shared the float table
                if "output.weight" in f.tensors:
                    continue
                if isinstance(new, QuantEmbedding):
                    tie_output(model, out_name, new)
                else:
                    model.get_submodule(out_name).weight = new.weight
                report.tied.append(f"{out_name} -> {module_name}")
                loaded.add(f"{out_name}.weight")
            loaded.add(name)
        elif name in state:
            value = dequantize(t)
            if tuple(value.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"{f.path}: tensor {gname!r} has shape {list(t.shape)}, the model's {name!r} is "
                    f"{list(state[name].shape)} (config disagrees with the file)"
                )
            with torch.no_grad():
                (state[name] if meta is None else meta.real_key(model, name)).copy_(value)
            loaded.add(name)
            report.float_tensors += 1
        elif strict:
            raise ValueError(f"{f.path}: tensor {gname!r} -> {name!r} is not a parameter of the model")
    for block in sorted(expert_blocks):
        f.check_unchanged()
        _load_experts(model, block, dtype, f, meta, target, report, loaded, strict)
    if strict:
        missing = sorted(k for k in state if k not in loaded and not _covered(k, loaded))
        if missing:
            raise ValueError(f"{f.path}: the file has no tensors for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if target is not None:
        compute_buffers(model, target, f"load_gguf_llama: {f.path}")
        check_no_meta(model, "load_gguf_llama", f.path)
        model.to(target)  # the tensors the model had in memory before (a model only partly on meta)
    record_loaded_model(model, "load_gguf_llama")
    return report


def _module(model: nn.Module, name: str, strict: bool, what: str) -> nn.Module | None:
    """The model's module `name`; where it has none, a ValueError starting with `what` (strict) or None."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        if strict:
            raise ValueError(f"{what}: no such module in the model") from None
        return None


def _check_not_loaded(model: nn.Module, f: GGUFFile) -> None:
    """A model that already holds torch_qmm layers (loaded or quantized before) is refused: the
    file's tensors fill the float layers of a model built from its config."""
    held = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
            if isinstance(m, (QuantLinear, GGUFLinear, QuantEmbedding, TiedQuantLinear, QuantFusedExperts))]
    if held:
        raise ValueError(f"{f.path}: the model already holds torch_qmm layers ({', '.join(held[:3])}"
                         f"{f' and {len(held) - 3} more' if len(held) > 3 else ''}): was it loaded or quantized "
                         "before? load_gguf_llama fills a model built from the file's config "
                         "(transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)))")


def _load_experts(model, block: int, dtype: torch.dtype, f: GGUFFile, meta, target, report: LoadReport,
                  loaded: set[str], strict: bool) -> None:
    """Block `block`'s routed experts into the model: a QuantFusedExperts, or float values in the
    model's experts module (gguf_moe.experts_from_gguf)."""
    name = experts_module_name(block)
    module = _module(model, name, strict, f"{f.path}: tensors blk.{block}.ffn_*_exps -> {name!r}")
    if module is None:
        return
    parts = block_experts(f, block)
    report.bytes_read += sum(t.nbytes for st in parts.values() for t in st.experts + (st.bias,) if t is not None)
    layout = layout_of(module)  # (before experts_from_gguf empties the module)
    new = experts_from_gguf(module, parts, dtype, f"{f.path}: block {block}")
    leaves = layout.weight_names if layout is not None else ()
    if new is not None:
        replace_module(model, name, new if target is None else new.to(target))
        report.quantized[name] = describe(parts)
    else:
        fill_float_experts({leaf: module.get_parameter(leaf) if meta is None else meta.real_key(model, f"{name}.{leaf}")
                            for leaf in leaves}, parts, layout)
        report.float_tensors += len(leaves)
    loaded.update(f"{name}.{leaf}" for leaf in leaves)


def _covered(key: str, loaded: set[str]) -> bool:
    # A replaced layer's old parameter names (weight / bias) are covered by its new buffers.
    module_name = key.rpartition(".")[0]
    return f"{module_name}.weight" in loaded


