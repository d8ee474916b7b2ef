"""transformers integration: `TorchQmmConfig`, registered through transformers' public quantizer
registry (`register_quantization_config` / `register_quantizer`; tested with transformers 5.x).

    from transformers import AutoModelForCausalLM
    from torch_qmm.interop.transformers import TorchQmmConfig
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=TorchQmmConfig(bits=4, group_size=64))
    # or TorchQmmConfig(mode="mxfp4"), TorchQmmConfig(bits=MixedBits(4.5)), TorchQmmConfig(bits={"*": 4, ...})
    model.save_pretrained(out)                      # config.json records quant_method "torch_qmm"
    AutoModelForCausalLM.from_pretrained(out)       # reloads the QuantLinear layers (after `import torch_qmm`)

Quantize-on-load: the float weights are loaded as usual, then every eligible nn.Linear is swapped
for a QuantLinear and the fused experts of MoE blocks for a QuantFusedExperts (routers and MoE
gates stay float; docs/moe.md) (peak memory is that of the float model). A layer is eligible unless it is in
`modules_to_not_convert` (default: the output head and transformers' keep-in-fp32 modules) or its
in_features is not a multiple of group_size; the saved config lists every skipped layer, so a
reload builds exactly the saved layers.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..convert import quantize_model
from ..nn import QuantLinear, resolve_format
from ..nn_moe import QuantFusedExperts
from .experts import empty_quant_experts, fused_experts
from .modules import (QuantEmbedding, TiedQuantLinear, embedding_scale, listed_as_tied, replace_embedding,
                      replaceable_embedding, tied_to_embedding)
from ..quantizers.mixed import MixedBits

QUANT_METHOD = "torch_qmm"
# The key of a saved quantization_config that records why from_pretrained cannot rebuild the
# folder's layers (record_loaded_model); a reload raises ValueError with it.
NOT_RELOADABLE = "not_reloadable"
# The projections of a QuantFusedExperts, as a saved config names them where their bits differ.
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def quantized_layers(model) -> dict:
    """{name: layer} of the layers a saved config gives bits: every QuantLinear and QuantEmbedding,
    and each QuantFusedExperts as one entry (its down_proj), or one per projection where their bits
    differ."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    for n, m in model.named_modules():
        if isinstance(m, QuantFusedExperts):
            same = m.gate_up_proj.bits == m.down_proj.bits
            layers |= {n: m.down_proj} if same else {f"{n}.{p}": getattr(m, p) for p in EXPERT_PROJECTIONS}
    return layers


def experts_bits_keys(bits, name: str) -> tuple[str, str]:
    """The keys of a saved config's bits mapping that give experts `name`'s gate_up_proj and
    down_proj bits: one per projection where record_quantization_config wrote them, else the block's."""
    if isinstance(bits, dict) and f"{name}.{EXPERT_PROJECTIONS[0]}" in bits:
        return tuple(f"{name}.{p}" for p in EXPERT_PROJECTIONS)
    return name, name


@register_quantization_config(QUANT_METHOD)
@dataclass(repr=False)  # repr: the mixin's, every setting (to_dict)
class TorchQmmConfig(QuantizationConfigMixin):
    """One of MLX's formats for the linear layers of a transformers model.

    Args:
        bits: the bit width (None: the mode's default; affine 2, 3, 4, 5, 6 or 8); for mode
            "affine" also per layer: a mapping name -> bits ("*": the others) or a MixedBits budget
            (torch_qmm.quantizers). The saved config holds the bits each layer got (an int when
            they are all equal, else the mapping), so a reload builds exactly the saved layers.
        group_size: None: the mode's default; affine 32, 64 or 128.
        mode: "affine" (default), or an fp mode of torch_qmm.formats.FORMATS ("mxfp4", "nvfp4", ...).
        modules_to_not_convert: module names (or name suffixes) kept in float; None: transformers'
            default (the output head, tied weights, keep-in-fp32 modules).
        embeddings: the model's input embedding's name, to quantize it too, as MLX does
            (QuantEmbedding in the same format; bits from `bits`, which is then an int or a mapping;
            an output head tied to it reads the quantized table: TiedQuantLinear; no other
            embedding may share its weight). None: embeddings stay float. A saved config lists the
            model's quantized embedding here.
        method: the quantizer: a name of torch_qmm.quantizers.names() ("rtn", MLX's, default; "mse",
            "awq", "gptq", ...) or GPTQ(...) / AWQ(...) options; the saved format is the same for
            all, so reloading ignores it (the saved config names the method's kind).
        calibration: model inputs for awq/gptq (token-id tensors [1, T]); not saved.
    """

    def __init__(self, bits: int | Mapping[str, int] | MixedBits | None = None, group_size: int | None = None,
                 modules_to_not_convert: list[str] | None = None, method: Any = "rtn", calibration: Any = None,
                 mode: str = "affine", mixed_bits: dict | None = None, embeddings: list[str] | None = None,
                 **kwargs: Any) -> None:
        from ..quantizers import resolve

        if mixed_bits is not None:  # a MixedBits budget as to_dict writes it
            if bits is not None or not isinstance(mixed_bits, dict):
                raise ValueError(f"argument 'mixed_bits' must be a dict (average, low, high) and comes without "
                                 f"'bits', got mixed_bits={mixed_bits!r}, bits={bits!r}")
            bits = MixedBits(**mixed_bits)
        uniform = bits is None or (type(bits) is int)
        default_bits, group_size = resolve_format(mode, bits if uniform else None, group_size)
        if not uniform:
            if mode != "affine":
                raise ValueError(f"argument 'bits': per-layer bits are for mode 'affine', got mode={mode!r}")
            if isinstance(bits, Mapping):
                for name, b in bits.items():
                    if not isinstance(name, str):
                        raise ValueError(f"argument 'bits' must map layer names to bits, got the key {name!r}")
                    resolve_format(mode, b, group_size)
                bits = dict(bits)
            elif isinstance(bits, MixedBits):
                bits.widths()
            else:
                raise TypeError(f"argument 'bits' must be an int, a mapping name -> bits or MixedBits, "
                                f"got {type(bits).__name__}")
        if kwargs.get(NOT_RELOADABLE):  # written by record_loaded_model: this folder cannot be rebuilt
            raise ValueError(f"from_pretrained cannot rebuild the torch_qmm layers of this folder: "
                             f"{kwargs[NOT_RELOADABLE]}")
        resolve(method)  # a registered name or GPTQ(...) / AWQ(...) options, else ValueError / TypeError
        if modules_to_not_convert is not None and not (
                isinstance(modules_to_not_convert, (list, tuple))
                and all(isinstance(n, str) for n in modules_to_not_convert)):
            raise TypeError(f"argument 'modules_to_not_convert' must be a list of module names or None, "
                            f"got {modules_to_not_convert!r}")
        if embeddings is not None:
            if not (isinstance(embeddings, (list, tuple)) and all(isinstance(n, str) for n in embeddings)):
                raise TypeError(f"argument 'embeddings' must be a list of module names or None, got {embeddings!r}")
            if isinstance(bits, MixedBits) and embeddings:
                raise ValueError("argument 'embeddings': quantized embeddings take their bits from 'bits' as an int "
                                 "or a mapping name -> bits, not a MixedBits budget (which spends it on the linear "
                                 "layers)")
            embeddings = list(embeddings)
            twice = sorted({n for n in embeddings if embeddings.count(n) > 1})
            if twice:
                raise ValueError(f"argument 'embeddings' names {twice[0]!r} more than once")
            kept = sorted(set(embeddings) & set(modules_to_not_convert or ()))
            if kept:
                raise ValueError(f"argument 'embeddings' names {kept[0]!r}, which 'modules_to_not_convert' keeps float")
        self.quant_method = QUANT_METHOD
        self.bits = default_bits if uniform else bits
        self.group_size = group_size
        self.mode = mode
        self.modules_to_not_convert = modules_to_not_convert
        self.embeddings = embeddings
        self.method = method
        self.calibration = calibration

    @property
    def method_name(self) -> str:
        """The method's registered name (for options, their kind: "gptq" / "awq")."""
        from ..quantizers import resolve

        return resolve(self.method).name

    def experts_bits(self, name: str) -> tuple[int, int]:
        """(gate_up_proj, down_proj) bits of saved experts: the block's entry, or one per projection
        (record_quantization_config writes those where the two differ)."""
        return tuple(self.layer_bits(key) for key in experts_bits_keys(self.bits, name))

    def layer_bits(self, name: str) -> int:
        """The bits of a saved layer (reloading)."""
        if type(self.bits) is int:
            return self.bits
        b = self.bits.get(name, self.bits.get("*")) if isinstance(self.bits, dict) else None
        if b is None:
            raise ValueError(f"the torch_qmm quantization_config gives no bits for layer {name!r} (bits: "
                             f"{self.bits!r}); a saved config maps every quantized layer to its bits")
        return b

    def to_dict(self) -> dict[str, Any]:
        out = {"quant_method": QUANT_METHOD, "bits": self.bits, "group_size": self.group_size, "mode": self.mode,
               "modules_to_not_convert": self.modules_to_not_convert, "embeddings": self.embeddings,
               "method": self.method_name}
        if isinstance(self.bits, MixedBits):
            out["bits"], out["mixed_bits"] = None, dataclasses.asdict(self.bits)
        return out


def _without_expert_converters(conversions: list, model) -> list:
    """`conversions` without the converters that build a weight of a QuantFusedExperts (the fused
    gate_up_proj / down_proj tensors that the quantized module replaces by its buffers): those
    whose reverse, as transformers matches it, takes one of that module's tensors."""
    from transformers.core_model_loading import WeightConverter

    keys = [f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, QuantFusedExperts)
            for k in m.state_dict(keep_vars=True)]

    def builds_expert_weight(c) -> bool:
        if not isinstance(c, WeightConverter):
            return False
        reverse = c.reverse_transform()
        return any(reverse.rename_source_key(k)[1] is not None for k in keys)

    return [c for c in conversions if not builds_expert_weight(c)]


def keep_quantized_experts_on_save(model) -> None:
    """Makes transformers' save_pretrained write `model`'s QuantFusedExperts buffers as they are.
    save_pretrained reverts the weight conversions that read the model's checkpoint (those
    from_pretrained recorded in `model._weight_conversions`, else the default ones of the model's
    class), and the reverse of a merge of per-expert tensors into gate_up_proj / down_proj would
    split the packed buffers as if they were float weights; those converters are dropped, the
    renamings are kept (a reload applies them again)."""
    if not any(isinstance(m, QuantFusedExperts) for m in model.modules()):
        return
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        # What save_pretrained reverts for a model from_pretrained did not load: its class's
        # mapping, without the prefix changes (nothing tells whether the prefix was there).
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    model._weight_conversions = _without_expert_converters(conversions, model)


def stored_key(model, ckpt):
    """model key -> the key a save_pretrained folder stores it under: transformers' save renames
    some modules back to their checkpoint names (a Mixtral block's mlp is block_sparse_moe), the
    renamings of the model's class, which from_pretrained applies the other way. stored(key)
    gives the key itself where the checkpoint has no such name, or with required=True raises
    ValueError naming it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [(target, source) for r in get_model_conversion_mapping(model, add_legacy=False)
                 if isinstance(r, WeightRenaming) for source, target in zip(r.source_patterns, r.target_patterns)]

    def stored(key: str, required: bool = False) -> str:
        if key in ckpt:
            return key
        for ours, theirs in renamings:
            if ours in key and key.replace(ours, theirs) in ckpt:
                return key.replace(ours, theirs)
        if required:
            raise ValueError(f"{ckpt.path}: no tensor {key!r} (nor under a name transformers' renamings of "
                             f"{type(model).__name__} give it), which the loaded model has")
        return key

    return stored


def _float_layers(model) -> set[str]:
    """The layers a torch_qmm config could quantize that are float: nn.Linear and fused experts."""
    return {n for n, m in model.named_modules() if type(m) is nn.Linear} | {n for n, _ in fused_experts(model)}


def record_quantization_config(model) -> str | None:
    """Sets `model.config.quantization_config` to the TorchQmmConfig of its layers as they are, so
    that transformers' save_pretrained writes a folder from_pretrained rebuilds them from (exactly
    these layers quantized, each with its bits, the experts stored as their buffers:
    keep_quantized_experts_on_save). Returns why not where one config cannot hold them (group
    sizes or modes that differ between layers), leaving the config as it was."""
    keep_quantized_experts_on_save(model)  # (a folder that cannot be reloaded is still written)
    others = _undescribed_layers(model)
    if others:
        return (f"a quantization_config describes QuantLinear and QuantEmbedding layers and MoE experts, not "
                f"{', '.join(others[:4])}{f' and {len(others) - 4} more' if len(others) > 4 else ''}")
    layers = quantized_layers(model)
    if not layers:
        return None
    untied = _ties_not_rebuilt(model)
    if untied:
        return f"a reload would not tie these layers as they are: {', '.join(untied)}"
    formats = {(m.group_size, m.mode) for m in layers.values()}
    formats |= {(m.gate_up_proj.group_size, m.gate_up_proj.mode) for m in model.modules()
                if isinstance(m, QuantFusedExperts)}
    if len(formats) > 1:
        return f"its layers have more than one group size / mode ({sorted(formats)})"
    (group_size, mode), = formats
    bits = {n: m.bits for n, m in layers.items()}
    model.config.quantization_config = TorchQmmConfig(
        bits=next(iter(bits.values())) if len(set(bits.values())) == 1 else bits, group_size=group_size, mode=mode,
        modules_to_not_convert=sorted(_float_layers(model)),
        embeddings=sorted(n for n, m in model.named_modules() if isinstance(m, QuantEmbedding)) or None)
    return None


def _ties_not_rebuilt(model) -> list[str]:
    """The layers around quantized embeddings that a reload would not rebuild as they are, as
    "name (why)". A reload quantizes the input embedding alone (its tied modules untouched by
    other code) and makes TiedQuantLinear of each output layer the config ties to it: the output
    layer where tie_word_embeddings is set, and what the model lists as tied to it."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    inputs = _input_embedding(model)
    found = []
    for name, m in model.named_modules():
        if isinstance(m, QuantEmbedding):
            if m is not inputs:
                found.append(f"{name} (a QuantEmbedding that is not the model's input embedding)")
            for other in sorted(listed_as_tied(model, name)):
                layer = model.get_submodule(other)
                if not (isinstance(layer, TiedQuantLinear) and layer.embedding is m):
                    found.append(f"{other} (a {type(layer).__name__} of its own, which the config ties to {name})")
        elif isinstance(m, TiedQuantLinear) and not (tied and m.embedding is inputs):
            found.append(f"{name} (a TiedQuantLinear, which the config does not tie)")
    return found


def _input_embedding(model) -> nn.Module | None:
    """The model's input embedding (transformers' get_input_embeddings; the language model's in a
    multimodal model), the one embedding a torch_qmm config quantizes."""
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None


def _undescribed_layers(model) -> list[str]:
    """The torch_qmm modules outside MoE experts of MLX's formats that TorchQmmHfQuantizer cannot
    rebuild (GGUFLinear, GGUFSwitchLinear, QuantSwitchLinear), as "name (class)"."""
    from ..nn_moe import QuantSwitchLinear
    from .modules import GGUFLinear, GGUFSwitchLinear

    experts = [n for n, m in model.named_modules() if isinstance(m, QuantFusedExperts)
               and isinstance(m.gate_up_proj, QuantSwitchLinear) and isinstance(m.down_proj, QuantSwitchLinear)]
    return [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
            if isinstance(m, (GGUFLinear, GGUFSwitchLinear, QuantSwitchLinear))
            and not any(n.startswith(e + ".") for e in experts)]


def _own_config(model) -> None:
    """Gives `model` a copy of its config, in every module that holds it or one of its sub-configs
    (a multimodal model's text_config / vision_config): the loaders record the quantization in
    model.config, and a config the caller passed to from_config (which keeps the object it is
    given) must not gain it."""
    old = getattr(model, "config", None)
    if old is None:
        return
    memo: dict[int, Any] = {}  # id(original) -> copy; holds the originals, so no id is reused
    copy.deepcopy(old, memo)
    for m in model.modules():
        held = m.__dict__.get("config")
        if held is not None and id(held) in memo:
            m.config = memo[id(held)]


def record_loaded_model(model, loader: str) -> None:
    """After `loader` (load_mlx, load_gguf_llama) filled a transformers model: its config gets the
    TorchQmmConfig of its layers where one describes them (record_quantization_config), so that
    save_pretrained writes a folder from_pretrained rebuilds; else a quantization_config that
    makes that reload a ValueError saying why (instead of transformers building the layers it
    cannot match to the checkpoint with random weights, or failing on an MLX "quantization"
    entry read from the loaded folder's config.json)."""
    if getattr(model, "hf_quantizer", None) is not None:
        return
    _own_config(model)
    # MLX's "quantization" entry (read from the loaded folder's config.json) describes the file's
    # layers in MLX's terms; a save of this model is described by its quantization_config alone.
    if isinstance(vars(model.config).get("quantization"), dict):
        del model.config.quantization
    why_not = record_quantization_config(model)
    if why_not is None:
        return
    from .modules import GGUFLinear, GGUFSwitchLinear

    if any(isinstance(m, (GGUFLinear, GGUFSwitchLinear)) for m in model.modules()):  # save_mlx refuses these
        instead = ("Load the original file the way it was loaded (load_gguf_llama); `python -m torch_qmm convert "
                   "FILE.gguf OUT` writes a folder from_pretrained reloads")
    else:
        instead = (f"Load the original file the way it was loaded ({loader}), or write the model with "
                   "torch_qmm.interop.save_mlx, which holds these layers")
    model.config.quantization_config = {"quant_method": QUANT_METHOD,
                                        NOT_RELOADABLE: f"{why_not} (the model was loaded by {loader}). {instead}"}


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)


def _check_checkpoint_holds(files, buffers: Mapping[str, torch.dtype]) -> None:
    """ValueError for a safetensors checkpoint that holds no torch_qmm codes at all (no '.qweight'
    tensor) while its config.json's quantization_config makes torch_qmm layers: a float
    checkpoint under a torch_qmm config (a config copied, or recorded by quantize_model into the
    config object another model was built from). transformers would leave those layers' codes and
    scales as allocated, garbage, and name them only in its load report. Read from the files'
    headers (keys only). Checkpoints that are not all safetensors are left to transformers; single
    tensors missing from a torch_qmm checkpoint too (its keys may be renamed on the way in)."""
    files = [str(f) for f in (files or [])]
    if not files or not buffers or not all(f.endswith(".safetensors") for f in files):
        return
    from safetensors import safe_open

    keys: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt") as h:
            keys.update(h.keys())
    if any(k.endswith(".qweight") for k in keys):
        return
    first = next(iter(buffers))
    layer = first.rpartition(".")[0]
    raise ValueError(
        f"{files[0]}: config.json's quantization_config (quant_method 'torch_qmm') makes {layer!r} and "
        f"{len({k.rpartition('.')[0] for k in buffers}) - 1} more torch_qmm layers, but the checkpoint holds no "
        "torch_qmm codes (no '.qweight' tensor): a float checkpoint. To quantize it on load, remove "
        "quantization_config from its config.json and pass TorchQmmConfig(...) as quantization_config"
    )


def _check_every_buffer_loaded(model, buffers: Mapping[str, torch.dtype], files) -> None:
    """ValueError naming the torch_qmm layers whose codes or scales the checkpoint did not hold.
    transformers marks each tensor it loads from the checkpoint (`_is_hf_initialized`, after any
    renaming of checkpoint keys) and allocates the missing ones empty, unmarked: garbage that its
    load report only names. Where no tensor of these layers is marked at all (a way of loading
    that does not mark them), nothing can be told apart and nothing is checked."""
    missing = [k for k in buffers if not getattr(model.get_buffer(k), "_is_hf_initialized", False)]
    if not missing or len(missing) == len(buffers):
        return
    layers = sorted({k.rpartition(".")[0] for k in missing})
    files = [str(f) for f in (files or [])]
    where = "" if not files else f"{files[0]}: " if len(files) == 1 else f"{Path(files[0]).parent} ({len(files)} files): "
    raise ValueError(
        f"{where}the checkpoint lacks {len(missing)} tensor(s) of {len(layers)} torch_qmm layer(s) its "
        f"quantization_config makes, e.g. {missing[0]!r} (layers: {', '.join(layers[:4])}"
        f"{', ...' if len(layers) > 4 else ''}); they would hold uninitialized memory. The checkpoint is "
        "incomplete or was saved from another model"
    )


def _skip_parent_inits(model, layers: set[str]) -> None:
    """Marks the modules that hold the rebuilt torch_qmm layers `layers` as initialized
    (transformers' `_is_hf_initialized`), where they hold no tensor of their own and are not a model.
    After loading, transformers runs each model's _init_weights on every module, and some
    initialize a block's linear layers from the block (SigLIP's attention and MLP: xavier on
    `module.q_proj.weight`), which a QuantLinear does not have; the layers' tensors come from the
    checkpoint, and those blocks have nothing else to initialize."""
    from transformers import PreTrainedModel

    for name in layers:
        parent_name = name.rpartition(".")[0]
        if not parent_name:
            continue
        parent = model.get_submodule(parent_name)
        own = list(parent.parameters(recurse=False)) + list(parent.buffers(recurse=False))
        if not own and not isinstance(parent, PreTrainedModel):
            parent._is_hf_initialized = True


def _embedding_to_quantize(model, name: str, cfg: TorchQmmConfig) -> nn.Embedding:
    """The embedding `name` of cfg.embeddings, checked: the model's input embedding (another
    embedding's model code may read its .weight), a float embedding a QuantEmbedding can stand in
    for, its width a multiple of the group size, no other embedding sharing its weight, and bits for
    it; else ValueError naming it."""
    where = f"the torch_qmm quantization_config's 'embeddings' names {name!r}"
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{where}, which is not a module of this {type(model).__name__}") from None
    if not isinstance(module, nn.Embedding) or not replaceable_embedding(module) or module.max_norm is not None:
        raise ValueError(f"{where}, a {type(module).__name__}; expected an nn.Embedding without max_norm (or one of "
                         "transformers' scaled embeddings)")
    inputs = _input_embedding(model)
    if module is not inputs:
        input_name = next((n for n, m in model.named_modules() if m is inputs), None)
        raise ValueError(f"{where}, which is not the model's input embedding ({input_name}); only that one is "
                         "quantized")
    if module.embedding_dim % cfg.group_size:
        raise ValueError(f"{where}, whose width {module.embedding_dim} is not a multiple of group_size "
                         f"{cfg.group_size}")
    shared = [n for n in tied_to_embedding(model, name) if type(model.get_submodule(n)) is not nn.Linear]
    if shared:
        raise ValueError(f"{where}, whose weight {', '.join(shared)} share(s) too; a QuantEmbedding cannot stand in "
                         "for them")
    if isinstance(cfg.bits, dict) and name not in cfg.bits and "*" not in cfg.bits:
        raise ValueError(f"argument 'bits' gives no bits for the embedding {name!r} that 'embeddings' names (map it, "
                         "or give a '*' default)")
    return module


@register_quantizer(QUANT_METHOD)
class TorchQmmHfQuantizer(HfQuantizer):
    """Swaps nn.Linear for torch_qmm.nn.QuantLinear (quantize on load, or load saved QuantLinears)."""

    requires_calibration = False

    def validate_environment(self, *args, **kwargs) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("torch_qmm does not support offloading layers to disk (device_map has 'disk')")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # weights load as floats; the swap happens after loading

    def _eligible(self, model) -> list[str]:
        skip = self.modules_to_not_convert
        gs = self.quantization_config.group_size
        tied = getattr(self, "_tied_heads", set())  # they read the quantized embedding
        return [
            name for name, m in model.named_modules()
            if type(m) is nn.Linear and not _skipped(name, skip) and m.in_features % gs == 0 and name not in tied
        ]

    def _process_model_before_weight_loading(self, model, keep_in_fp32_modules=None, checkpoint_files=None,
                                             **kwargs):
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, self.quantization_config.modules_to_not_convert, keep_in_fp32_modules
        )
        if not self.pre_quantized:
            # The embeddings to quantize, checked before the weights load; the output layers tied
            # to them will read them (TiedQuantLinear), not become QuantLinear.
            cfg = self.quantization_config
            self._tied_heads = {head for name in cfg.embeddings or () if _embedding_to_quantize(model, name, cfg)
                                for head in tied_to_embedding(model, name)}
            return model
        # A saved torch_qmm model: build empty QuantLinears (on the linears' device, usually meta)
        # whose buffers the checkpoint fills.
        cfg = self.quantization_config
        self._buffer_dtypes: dict[str, torch.dtype] = {}  # of the quantized modules, checked after loading
        for name in cfg.embeddings or ():  # first: a tied head becomes a TiedQuantLinear, no QuantLinear
            embedding = _embedding_to_quantize(model, name, cfg)
            q = QuantEmbedding(embedding.num_embeddings, embedding.embedding_dim, bits=cfg.layer_bits(name),
                               group_size=cfg.group_size, device=embedding.weight.device,
                               dtype=embedding.weight.dtype, mode=cfg.mode, embed_scale=embedding_scale(embedding))
            replace_embedding(model, name, q)
            self._buffer_dtypes.update({f"{name}.{k}": b.dtype for k, b in q.named_buffers()
                                        if k not in q._non_persistent_buffers_set})
        for name in self._eligible(model):
            linear = model.get_submodule(name)
            q = QuantLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            bits=cfg.layer_bits(name), group_size=cfg.group_size, device=linear.weight.device,
                            dtype=linear.weight.dtype, mode=cfg.mode)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, q)
            self._buffer_dtypes.update({f"{name}.{k}": b.dtype for k, b in q.named_buffers()})
        for name, experts in fused_experts(model):
            if _skipped(name, self.modules_to_not_convert):
                continue
            gate_up_bits, down_bits = cfg.experts_bits(name)
            q = empty_quant_experts(experts, bits=gate_up_bits, group_size=cfg.group_size, mode=cfg.mode,
                                    dtype=experts.get_parameter("down_proj").dtype,
                                    down=(down_bits, cfg.group_size, cfg.mode))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, q)
            self._buffer_dtypes.update({f"{name}.{k}": b.dtype for k, b in q.named_buffers()})
        self._checkpoint_files = checkpoint_files
        _check_checkpoint_holds(checkpoint_files, self._buffer_dtypes)
        _skip_parent_inits(model, {k.rpartition(".")[0] for k in self._buffer_dtypes})
        return model

    def get_new_dtype(self, converter, param, dtype):
        # transformers casts a float checkpoint tensor to the dtype of the model's tensor: never
        # into packed or scale codes (uint32 / uint8), which would round them into other codes.
        # Kept as stored, a wrong dtype is refused after loading.
        new = super().get_new_dtype(converter, param, dtype)
        return None if new in (torch.uint32, torch.uint8) else new

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            buffers = getattr(self, "_buffer_dtypes", {})
            _check_every_buffer_loaded(model, buffers, getattr(self, "_checkpoint_files", None))
            # transformers assigns a checkpoint's integer tensors as stored: an int32 or int64
            # qweight, an integer scales tensor would load and fail (or compute garbage) later.
            for key, dtype in buffers.items():
                got = model.get_buffer(key).dtype
                if got != dtype:
                    raise ValueError(f"the checkpoint stores {key!r} as {got}; the torch_qmm layer built from its "
                                     f"quantization_config holds {dtype} there")
            return model
        cfg = self.quantization_config
        eligible = set(self._eligible(model)) | {
            n for n, _ in fused_experts(model) if not _skipped(n, self.modules_to_not_convert)}
        embeddings = set(cfg.embeddings or ())
        bits = {n: b for n, b in cfg.bits.items() if n not in embeddings} if isinstance(cfg.bits, dict) else cfg.bits
        quantize_model(model, bits=bits, group_size=cfg.group_size, filter_fn=lambda n, _: n in eligible,
                       method=cfg.method, calibration=cfg.calibration, mode=cfg.mode)
        for name in cfg.embeddings or ():
            embedding = _embedding_to_quantize(model, name, cfg)
            replace_embedding(model, name, QuantEmbedding.from_embedding(
                embedding, bits=cfg.layer_bits(name), group_size=cfg.group_size, mode=cfg.mode))
        # Record the bits every layer got (a budget or a "*" default resolves per layer).
        got = {n: m.bits for n, m in quantized_layers(model).items()}
        if type(cfg.bits) is not int:
            cfg.bits = next(iter(got.values())) if len(set(got.values())) == 1 else got
        # Saving writes QuantFusedExperts' buffers as they are: no reverse of the per-expert merge
        # that read the float checkpoint.
        keep_quantized_experts_on_save(model)
        # Record every float layer so that a reload rebuilds exactly these QuantLinears.
        cfg.modules_to_not_convert = sorted((set(self.modules_to_not_convert) | _float_layers(model))
                                            - set(cfg.embeddings or ()))
        return model

    def update_weight_conversions(self, weight_conversions, model):
        # Loading a saved torch_qmm model: its experts are stored as QuantFusedExperts buffers, which
        # transformers' merges of per-expert checkpoint tensors into gate_up_proj / down_proj must not touch.
        return _without_expert_converters(super().update_weight_conversions(weight_conversions, model), model)

    def is_serializable(self, safe_serialization=None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False
