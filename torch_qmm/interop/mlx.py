"""MLX checkpoints: load an MLX-quantized model folder into a torch model, save ours for MLX.

An MLX folder (as mlx.nn / mlx_lm write it):
  config.json       "quantization" (and the same under "quantization_config"):
                    {"group_size": 64, "bits": 4, "mode": "affine",
                     "<module path>": {"group_size": .., "bits": .., "mode": ..} | false, ...}
                    A per-layer entry overrides the default; `false` means "not quantized". A
                    missing "mode" is "affine", in a per-layer entry too (mlx.nn's to_quantized
                    default, which mlx_lm passes the entry to). "group_size" or "bits" null is the
                    mode's default (affine 64 / 4, ...: mlx.nn's to_quantized takes None as the
                    default); mlx_lm's mixed recipes without --q-group-size write null group sizes.
  model.safetensors or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                    a quantized layer `p` stores p.weight (uint32 [out, in*bits/32]), p.scales
                    ([out, in/group_size]: float for affine, uint8 for the fp modes), p.biases
                    (affine only, like scales) and optionally p.bias; everything else is float.
Which layers are quantized follows mlx_lm's rule: a layer is quantized when `p.scales` is stored;
the config gives its bits and group size. Layer names are the torch model's (mlx_lm keeps the
Hugging Face names), so a transformers model of the same architecture loads by name.

The rest of config.json is the model's transformers config, plus the rotary-embedding fields in
the spelling mlx_lm's model arguments read (see mlx_lm_config).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from ..convert import record_loaded_model
from ..formats import FORMATS, packed_words
from ..format_state import FORMAT_STATE_KEY
from ..nn import QuantLinear, resolve_format
from ..nn_moe import QuantFusedExperts
from .experts import fused_experts
from .mlx_experts import (dequantized_stored, experts_specs, float_experts_tensors, from_mlx_key, load_experts,
                          split_experts, stored_parts, to_mlx_key)
from .meta import MetaTensors, cast_stored, check_no_meta, compute_buffers, resolve_device
from .gguf_types import type_name
from .modules import (GGUFLinear, GGUFSwitchLinear, QuantEmbedding, embedding_scale, replace_module,
                      replaceable_embedding, tie_output)
from .json_files import read_json_object
from .safetensors_io import Checkpoint, model_files, save_sharded

_QUANT_KEYS = ("quantization", "quantization_config")
_SPEC_KEYS = {"group_size", "bits", "mode", "quant_method"}

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_STORED_DTYPES = {"U32": torch.uint32, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8,
                  "I16": torch.int16, "BOOL": torch.bool, **_SAFETENSORS_DTYPES}


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    mode: str = "affine"

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @property
    def has_biases(self) -> bool:
        return FORMATS[self.mode].has_biases

    def __str__(self) -> str:
        return f"{self.mode} b{self.bits} gs{self.group_size}"


@dataclasses.dataclass
class LoadReport:
    """What a loader did: quantized layers (name -> format), float tensors loaded, bytes read."""

    quantized: dict[str, str]
    float_tensors: int
    bytes_read: int
    tied: list[str] = dataclasses.field(default_factory=list)
    # stored quantized, kept float (MoE routers, embeddings with a forward of their own)
    dequantized: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"{len(self.quantized)} quantized layers, {self.float_tensors} float tensors, "
            f"{self.bytes_read / 2**20:.1f} MiB read" + (f", tied: {', '.join(self.tied)}" if self.tied else "")
            + (f", dequantized (float in the model): {', '.join(self.dequantized)}" if self.dequantized else "")
        )


def _spec_from(entry: dict, where: str) -> QuantSpec:
    mode = entry.get("mode", "affine")
    if not isinstance(mode, str) or mode not in FORMATS:  # (a list or dict is not hashable)
        raise ValueError(f"{where}: quantization mode {mode!r} is not supported (torch_qmm reads the modes "
                         f"{', '.join(map(repr, FORMATS))})")
    if "bits" not in entry or "group_size" not in entry:
        raise ValueError(f"{where}: quantization entry must give 'bits' and 'group_size', got {entry!r}")
    for field in ("bits", "group_size"):
        v = entry[field]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):  # 4.7 or "4" is corrupt, not 4
            raise ValueError(f"{where}: field {field!r} must be a JSON integer or null, got {v!r}")
    try:
        bits, group_size = resolve_format(mode, entry["bits"], entry["group_size"])  # null: the mode's default
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return QuantSpec(bits, group_size, mode)


def parse_quantization(config: dict, where: str = "config.json") -> tuple[QuantSpec | None, dict[str, QuantSpec | bool]]:
    """Returns (default spec or None, {module path: QuantSpec or False}) from an MLX config."""
    q = next((config[k] for k in _QUANT_KEYS if isinstance(config.get(k), dict)), None)
    if q is None:
        return None, {}
    method = q.get("quant_method")
    if method not in (None, "mlx", "affine", "torch_qmm"):
        raise ValueError(f"{where}: quantization method {method!r} is not one of MLX's formats")
    default = _spec_from(q, f"{where} 'quantization'") if "bits" in q or "group_size" in q else None
    overrides: dict[str, QuantSpec | bool] = {}
    for key, value in q.items():
        if key in _SPEC_KEYS:
            continue
        if value is False:
            overrides[key] = False
        elif isinstance(value, dict):
            overrides[key] = _spec_from(value, f"{where} 'quantization.{key}'")
        elif value is True:
            if default is None:
                raise ValueError(f"{where}: 'quantization.{key}' is true but no default bits/group_size is given")
            overrides[key] = default
        # other keys (e.g. transformers' bookkeeping) are not per-layer entries
    return default, overrides


def model_type_of(config: dict, config_path) -> str | None:
    """config.json's model_type (it names the family's MoE tensors): a string, or None when absent."""
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):  # (a list or dict is not hashable)
        raise ValueError(f"{config_path}: field 'model_type' must be a string, got {model_type!r}")
    return model_type


def _check_quantized_shapes(ckpt: Checkpoint, path: str, spec: QuantSpec, rows: int, cols: int,
                            experts: int | None = None) -> None:
    lead = (rows,) if experts is None else (experts, rows)
    want_w = (*lead, packed_words(cols, spec.bits))
    want_s = (*lead, cols // spec.group_size)
    parts = ("scales", "biases") if spec.has_biases else ("scales",)
    for part in ("weight", *parts):
        if f"{path}.{part}" not in ckpt:
            raise ValueError(f"{ckpt.path}: quantized layer {path!r} has scales but no {path}.{part}")
    got_w = ckpt.shape(f"{path}.weight")
    got = {part: ckpt.shape(f"{path}.{part}") for part in parts}
    if got_w != want_w or any(shape != want_s for shape in got.values()):
        hint = ""
        if got_w != want_w and tuple(got_w[:-1]) == lead and got_w[-1] * 32 % cols == 0:
            hint = f" (the stored weight fits bits={got_w[-1] * 32 // cols})"
        got_s = got["scales"]
        if got_s != want_s and tuple(got_s[:-1]) == lead and got_s[-1] > 0 and cols % got_s[-1] == 0:
            hint += f" (the stored scales fit group_size={cols // got_s[-1]})"
        raise ValueError(
            f"{ckpt.where[f'{path}.scales']}: layer {path!r}: config says bits={spec.bits}, "
            f"group_size={spec.group_size}, "
            f"mode={spec.mode!r} for a {[*lead, cols]} weight, so weight must be {list(want_w)} and "
            f"{'/'.join(parts)} {list(want_s)}; the checkpoint has weight {list(got_w)}, "
            + ", ".join(f"{part} {list(shape)}" for part, shape in got.items()) + hint
        )
    if ckpt.dtype_name(f"{path}.weight") != "U32":
        raise ValueError(f"{ckpt.path}: layer {path!r}: quantized weight must be U32, got {ckpt.dtype_name(f'{path}.weight')}")
    for part in parts:
        stored = ckpt.dtype_name(f"{path}.{part}")
        if spec.has_biases and stored not in _SAFETENSORS_DTYPES:
            fp = " (uint8 scales are those of an fp mode: does the config give the mode?)" if stored == "U8" else ""
            raise ValueError(f"{ckpt.path}: layer {path!r}: {part} of mode {spec.mode!r} must be a float dtype "
                             f"({', '.join(_SAFETENSORS_DTYPES)}), got {stored}{fp}")
        if not spec.has_biases and stored != "U8":
            raise ValueError(f"{ckpt.path}: layer {path!r}: scales of mode {spec.mode!r} must be U8 (scale codes), "
                             f"got {stored}")


def _check_dtype(ckpt: Checkpoint, key: str, dst: torch.Tensor) -> None:
    """A stored tensor's dtype must suit its role: any float dtype for a float parameter (cast on
    load), exactly the buffer's dtype otherwise."""
    stored = ckpt.dtype_name(key)
    if dst.is_floating_point():
        if stored not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{ckpt.path}: tensor {key!r} is {stored}, but the model's tensor is {dst.dtype}: a float "
                             f"tensor must be stored as {', '.join(_SAFETENSORS_DTYPES)}")
    elif _STORED_DTYPES.get(stored) != dst.dtype:
        raise ValueError(f"{ckpt.path}: tensor {key!r} is {stored}, the model's tensor is {dst.dtype}")


def load_mlx(
    model: nn.Module,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    progress: bool | None = None,
    device: torch.device | str | None = None,
) -> LoadReport:
    """Loads an MLX model folder (or one .safetensors file next to its config.json) into `model`.

    The model must have the checkpoint's architecture with float layers (nn.Linear, nn.Embedding);
    layers the checkpoint stores quantized become QuantLinear / QuantEmbedding (with the scale of
    transformers' Gemma embeddings), an output layer tied to a quantized embedding becomes
    TiedQuantLinear; a quantized embedding whose module has a forward of its own (another
    nn.Embedding subclass) and a MoE router get the weights MLX multiplies by, in float.

    The model may be built on the meta device (``with torch.device("meta"): model =
    AutoModelForCausalLM.from_config(config)``), which costs no memory: the quantized layers (and
    MoE experts) are then built from the checkpoint's tensors, every other tensor it holds
    (norms, float embeddings, routers, biases) is created from it on `device`, the buffers a
    transformers model computes rather than stores (a rotary embedding's frequencies) are
    computed again from the config (torch_qmm.interop.meta.compute_buffers) and any tensor still
    without values is a ValueError naming it; the load then peaks near the checkpoint's size
    instead of the float model's. A model built in memory is filled where it is, as before.

    Args:
        model: the torch model, modified in place (its float parameters are cast to `dtype`).
        path: folder with config.json and safetensors shards.
        dtype: compute dtype of the model (default: the dtype of the checkpoint's float tensors).
        strict: every model tensor must be in the checkpoint and every checkpoint tensor used.
        progress: tqdm bar (default: for more than 32 tensors).
        device: where a model built on the meta device gets its tensors (default: the CPU);
            only for such a model (one in memory is moved with .to()).

    Raises:
        ValueError for malformed files, for configs that disagree with the tensors, and for a
        model built on meta whose tensors the checkpoint does not all give.
    """
    dev = resolve_device(model, device, "load_mlx")
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_path = folder / "config.json"
    config = read_json_object(config_path) if config_path.is_file() else {}
    default, overrides = parse_quantization(config, str(config_path))
    ckpt = Checkpoint(path)
    keys = ckpt.keys()
    model_type = model_type_of(config, config_path)

    if dtype is None:
        float_dtypes = Counter(_SAFETENSORS_DTYPES[ckpt.dtype_name(k)] for k in keys if ckpt.dtype_name(k) in _SAFETENSORS_DTYPES)
        dtype = float_dtypes.most_common(1)[0][0] if float_dtypes else torch.float32
    cast_stored(model, dtype)
    meta = MetaTensors(model, dev) if dev is not None else None

    # Ties between an embedding and output layers, seen before any layer is replaced.
    embedding_of = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    tied_to = {
        n: embedding_of[id(m.weight)]
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m.weight) in embedding_of
    }

    def spec_of(p: str) -> QuantSpec:
        spec = overrides.get(p, default)
        if spec is False:
            raise ValueError(f"{config_path}: 'quantization.{p}' is false but the checkpoint stores {p}.scales")
        if spec is None:
            missing = ("has no 'quantization' with bits and group_size" if config_path.is_file()
                       else "does not exist (it gives the layers' bits and group_size)")
            raise ValueError(
                f"{ckpt.path}: the checkpoint stores quantized layer {p!r} ({p}.scales) but {config_path} {missing}")
        return spec

    report = LoadReport(quantized={}, float_tensors=0, bytes_read=0)
    # The experts of MoE blocks (mlx_lm's SwitchGLU tensors) first: they fill whole modules.
    experts_keys, report.quantized, experts_done = load_experts(model, ckpt, model_type, spec_of, dtype,
                                                                _check_quantized_shapes, _check_dtype, meta)
    keys = [k for k in keys if k not in experts_keys]
    report.bytes_read += sum(ckpt.nbytes(k) for k in experts_keys)
    quantized_paths = [k[: -len(".scales")] for k in keys if k.endswith(".scales")]
    for p, spec in overrides.items():
        if isinstance(spec, QuantSpec) and p not in quantized_paths and f"{p}.weight" in keys:
            raise ValueError(
                f"{config_path}: 'quantization.{p}' gives {spec} but the checkpoint stores {p}.weight "
                f"unquantized (no {p}.scales)"
            )
    renamed: dict[str, str] = {k: from_mlx_key(k, model_type) for k in keys}  # checkpoint key -> model key
    dequantized: set[str] = set()  # checkpoint keys read as a float weight
    for p in quantized_paths:
        spec = spec_of(p)
        for part in ("weight", "biases") if spec.has_biases else ("weight",):
            if f"{p}.{part}" not in ckpt:
                raise ValueError(f"{ckpt.path}: quantized layer {p!r} has scales but no {p}.{part}")
        if not spec.has_biases and f"{p}.biases" in ckpt:
            raise ValueError(f"{ckpt.path}: quantized layer {p!r} stores {p}.biases, but its mode {spec.mode!r} "
                             "has none (config.json's 'quantization' gives the mode)")
        mp = from_mlx_key(p + ".", model_type)[:-1]  # the layer's path in the model
        try:
            module = model.get_submodule(mp)
        except AttributeError:
            raise ValueError(f"{ckpt.path}: quantized layer {p!r} does not exist in the model") from None
        if isinstance(module, nn.Linear):
            _check_quantized_shapes(ckpt, p, spec, module.out_features, module.in_features)
            new = QuantLinear(module.in_features, module.out_features, bias=f"{p}.bias" in ckpt,
                              bits=spec.bits, group_size=spec.group_size, dtype=dtype, mode=spec.mode,
                              device=module.weight.device)
        elif isinstance(module, nn.Embedding) and replaceable_embedding(module):
            _check_quantized_shapes(ckpt, p, spec, module.num_embeddings, module.embedding_dim)
            if module.max_norm is not None:
                raise ValueError(f"{ckpt.path}: quantized layer {p!r} replaces an nn.Embedding with max_norm="
                                 f"{module.max_norm} (rows renormalized when read), which a QuantEmbedding cannot be")
            new = QuantEmbedding(module.num_embeddings, module.embedding_dim, spec.bits, spec.group_size, dtype=dtype,
                                 mode=spec.mode, device=module.weight.device, embed_scale=embedding_scale(module))
        elif is_router(module) or isinstance(module, nn.Embedding):
            # A router, or an embedding whose forward a QuantEmbedding does not do: the values MLX
            # multiplies by, in the model's own float module.
            w = dequantized_weight(ckpt, p, spec, module)
            with torch.no_grad():
                (module.weight if meta is None else meta.real(module, "weight")).copy_(w)
            dequantized.update(f"{p}.{part}" for part in stored_parts(spec))
            report.dequantized.append(mp)
            continue
        elif isinstance(module, (QuantLinear, QuantEmbedding)):
            raise ValueError(f"{ckpt.path}: layer {mp!r} of the model is already a {type(module).__name__}: load_mlx "
                             "replaces the float layers of a freshly built model (load into a new model, not one "
                             "loaded or quantized before)")
        else:
            raise ValueError(f"{ckpt.path}: quantized layer {p!r} is a {type(module).__name__}, expected nn.Linear or nn.Embedding")
        # Built where the replaced layer is: on meta in a model built there, its tensors get storage
        # as the checkpoint fills them (MetaTensors.real), with the rest of the model's.
        replace_module(model, mp, new)
        renamed[f"{p}.weight"] = f"{mp}.qweight"
        report.quantized[mp] = str(spec)
    keys = [k for k in keys if k not in dequantized]

    for out_name, emb_name in tied_to.items():
        emb = model.get_submodule(emb_name)
        if f"{out_name}.weight" not in ckpt and isinstance(emb, QuantEmbedding):
            tie_output(model, out_name, emb)
            report.tied.append(f"{out_name} -> {emb_name}")

    state = model.state_dict()
    targets = {renamed.get(k, k): k for k in keys}
    if strict:
        missing = sorted(
            k for k in state
            if k not in targets and not _is_tied_duplicate(model, k, tied_to, keys, report.dequantized)
            and not _is_format_state(k)
            and not any(k.startswith(n + ".") for n in experts_done)
            and k not in {f"{n}.weight" for n in report.dequantized}
        )
        unexpected = sorted(k for k, _ in targets.items() if k not in state)
        if missing or unexpected:
            raise ValueError(
                f"{ckpt.path}: checkpoint does not match the model: missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )
    for target, key in targets.items():
        if target in state:
            _check_dtype(ckpt, key, state[target])
    show = bool(targets) and (progress if progress is not None else len(keys) > 32)
    with torch.no_grad():
        for target, key in tqdm(sorted(targets.items()), desc="loading", disable=not show, unit="tensor"):
            if target not in state:
                continue
            t = ckpt.finite_scales(key, ckpt.get(key))
            dst = state[target] if meta is None else meta.real_key(model, target)
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{ckpt.path}: tensor {key!r} has shape {list(t.shape)}, the model expects {list(dst.shape)}"
                )
            dst.copy_(t)
            report.bytes_read += t.numel() * t.element_size()
            if not key.endswith((".scales", ".biases")) and target == key:
                report.float_tensors += 1
    if dev is not None:
        compute_buffers(model, dev, f"load_mlx: {ckpt.path}")
        check_no_meta(model, "load_mlx", ckpt.path)
        model.to(dev)  # the tensors the model had in memory before (a model only partly on meta)
    record_loaded_model(model, "load_mlx")
    return report


def is_router(module: nn.Module) -> bool:
    """A router of a MoE block, which mlx_lm stores quantized (its nn.Linear) and transformers'
    model holds as a module of its own reading a 2-D .weight: it stays float."""
    return (not isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(getattr(module, "weight", None), nn.Parameter)
            and module.weight.dim() == 2)


def dequantized_weight(ckpt: Checkpoint, p: str, spec: QuantSpec, module: nn.Module) -> torch.Tensor:
    """The float32 weight of `module` (a router, or an embedding a QuantEmbedding cannot stand in
    for) from its quantized tensors at checkpoint path p (the values MLX multiplies by), after
    checking their shapes against the module's."""
    rows, cols = module.weight.shape
    _check_quantized_shapes(ckpt, p, spec, rows, cols)
    return dequantized_stored(ckpt, p, spec)


def _is_format_state(key: str) -> bool:
    # The format of a quantized layer comes from config.json (MLX stores none in the tensors).
    return key.rpartition(".")[2] == FORMAT_STATE_KEY


def _is_tied_duplicate(model: nn.Module, key: str, tied_to: dict[str, str], keys: list[str],
                       dequantized: list[str]) -> bool:
    # A float output weight tied to a float embedding is satisfied by the embedding's tensor (stored
    # float, or quantized and dequantized into it).
    module_name = key.rpartition(".")[0]
    if not (key.endswith(".weight") and module_name in tied_to):
        return False
    return f"{tied_to[module_name]}.weight" in keys or tied_to[module_name] in dequantized


def quantization_config(model: nn.Module, model_type: str | None = None) -> dict:
    """The MLX "quantization" entry describing `model`'s quantized layers (default = most common),
    under mlx_lm's names (the experts of MoE blocks: mlx_experts, by config.json's model_type)."""
    specs: dict[str, QuantSpec | bool] = {}
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            specs[to_mlx_key(name + ".", model_type)[:-1]] = QuantSpec(m.bits, m.group_size, m.mode)
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            specs[to_mlx_key(name + ".", model_type)[:-1]] = False
    for path, (bits, group_size, mode) in experts_specs(model, model_type).items():
        specs[path] = QuantSpec(bits, group_size, mode)
    counts = Counter(s for s in specs.values() if isinstance(s, QuantSpec))
    if not counts:
        return {}
    default = counts.most_common(1)[0][0]
    q: dict = default.as_dict()
    for name, s in specs.items():
        if s is False:
            q[name] = False
        elif s != default:
            q[name] = s.as_dict()
    return q


def mlx_state_dict(model: nn.Module, model_type: str | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors under MLX's names (a quantized layer's qweight is its `weight`; the
    experts of MoE blocks as mlx_lm's SwitchGLU layers, named by config.json's model_type).

    Tensors shared by two names (tied weights) are stored once, under the first name.
    """
    quantized = {n for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantFusedExperts)}
    float_experts = dict(fused_experts(model))
    out: dict[str, torch.Tensor] = {}
    for name, m in experts.items():
        out.update(split_experts(to_mlx_key(name + ".", model_type)[:-1], m))
    for name, m in float_experts.items():
        out.update(float_experts_tensors(to_mlx_key(name + ".", model_type)[:-1], m))
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for key, t in model.state_dict().items():
        module_name, _, leaf = key.rpartition(".")
        if leaf == FORMAT_STATE_KEY:  # config.json's "quantization" carries the format
            continue
        if any(key.startswith(n + ".") for n in (*experts, *float_experts)):
            continue
        if module_name in quantized and leaf == "qweight":
            key = f"{module_name}.weight" if module_name else "weight"
        ident = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), tuple(t.shape))
        if ident in seen:
            continue
        seen.add(ident)
        out[to_mlx_key(key, model_type)] = t
    return out


def mlx_lm_config(config: dict, aliases: Mapping[str, str] | None = None) -> dict:
    """`config` (a transformers config as a dict) with the fields mlx_lm reads under other names:
    the aliases of `aliases` (a transformers config's `attribute_map`, alias -> canonical name) and
    the rotary-embedding fields.

    transformers writes a field under its canonical name only (Qwen3-MoE: num_local_experts);
    mlx_lm's model arguments may read an alias (num_experts): both are written.

    transformers 5 keeps the rotary embedding in `rope_parameters` ({"rope_type", "rope_theta",
    and the type's parameters}) and ignores top-level copies when it reads a config; mlx_lm's model
    arguments (models/llama.py, whose arguments mistral's also use, and others) read top-level
    `rope_theta` (default 10000) and `rope_scaling` (None or the type's parameters, as
    transformers 4 wrote them). Both are set from `rope_parameters`, so both readers build the
    same rotary embedding; a config without `rope_parameters` gets no rotary fields. The other
    fields mlx_lm reads (hidden_size, num_key_value_heads, head_dim, rms_norm_eps,
    tie_word_embeddings, eos_token_id, ...) have the same names and meaning in both.
    """
    out = dict(config)
    for alias, canonical in (aliases or {}).items():
        if canonical in out and alias not in out:
            out[alias] = out[canonical]
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return out
    if "rope_theta" not in rope:
        # Per-layer-type parameters ({"full_attention": {...}, "sliding_attention": {...}}) have no
        # single top-level spelling; mlx_lm's families that use them read their own fields.
        warnings.warn(
            f"config 'rope_parameters' has no 'rope_theta' (keys {sorted(rope)}); config.json gets no top-level "
            "rope_theta/rope_scaling, so mlx_lm uses its model's defaults for them",
            stacklevel=3,
        )
        return out
    out["rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out["rope_scaling"] = None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def save_mlx(
    model: nn.Module,
    folder: str | os.PathLike,
    config: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> Path:
    """Saves `model` as an MLX model folder: config.json (+ quantization) and safetensors shards,
    which mlx_lm.load reads (with the tokenizer files, which are not the model's: copy them).

    Args:
        model: a torch model whose quantized layers are QuantLinear / QuantEmbedding.
        folder: output folder (created). One that already holds a model (config.json, safetensors
            weights or their index) is refused unless `overwrite`: saving a quantized model over
            the float checkpoint it came from would lose that checkpoint. Other files (a tokenizer
            saved first) are kept either way.
        config: the model's config to write; default: `model.config.to_dict()` for a transformers
            model. The "quantization" and "quantization_config" entries are set from the model and
            the fields mlx_lm reads under other names are added (mlx_lm_config, with the aliases
            of `model.config.attribute_map` when the model has one), whichever way it is given.
        max_shard_bytes: shard size limit; several shards get model.safetensors.index.json.
        overwrite: replace the model files of a folder that holds them.
    """
    blocks = [f"{n} ({type_name(m.ggml_type)})" for n, m in model.named_modules()
              if isinstance(m, (GGUFLinear, GGUFSwitchLinear))]
    if blocks:
        raise ValueError(
            f"save_mlx: {', '.join(blocks[:4])}{f' and {len(blocks) - 4} more' if len(blocks) > 4 else ''} "
            "are GGUFLinear / GGUFSwitchLinear layers (GGUF blocks), which MLX cannot read: `python -m "
            "torch_qmm convert FILE.gguf OUT --format mlx` writes Q4_K, Q5_K and IQ4_XS exactly as affine 4-, 5- "
            "and 8-bit layers and the others as float (or re-quantized, --requantize rest)")
    folder = Path(folder)
    if not overwrite and (held := model_files(folder)):
        raise FileExistsError(f"save_mlx: {folder} already holds a model ({', '.join(held[:3])}"
                              f"{f' and {len(held) - 3} more' if len(held) > 3 else ''}); pass overwrite=True to "
                              "replace it, or choose another folder")
    folder.mkdir(parents=True, exist_ok=True)
    model_config = getattr(model, "config", None)
    if config is None and callable(getattr(model_config, "to_dict", None)):
        config = model_config.to_dict()
    config = mlx_lm_config(dict(config or {}), getattr(model_config, "attribute_map", None))
    model_type = config.get("model_type")
    q = quantization_config(model, model_type)
    for k in _QUANT_KEYS:
        config.pop(k, None)
    if q:
        config["quantization"] = q
        config["quantization_config"] = q
    save_sharded(mlx_state_dict(model, model_type), folder, max_shard_bytes, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return folder
