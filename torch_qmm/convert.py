"""Model conversion: swap a model's nn.Linear layers for QuantLinear."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from .format_state import quant_state_values
from .formats import SUPPORTED_DTYPES
from .nn import QuantLinear, resolve_format

# Show a progress bar when at least this many layers are converted.
_PROGRESS_MIN_LAYERS = 32


# Modules that read these children's .weight instead of calling them, so a QuantLinear there would
# break them: MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward;
# TransformerEncoderLayer's eval fast path (and TransformerEncoder's) pass linear1/linear2.weight to
# one fused kernel.
_WEIGHT_READERS: tuple[tuple[type[nn.Module], tuple[str, ...]], ...] = (
    (nn.MultiheadAttention, ("out_proj",)),
    (nn.TransformerEncoderLayer, ("linear1", "linear2")),
)


@dataclasses.dataclass
class QuantizeSummary:
    """What quantize_model did."""

    converted: list[str]
    skipped: dict[str, str]  # layer name -> reason
    bytes_before: int  # weight (+bias) bytes of the converted layers before
    bytes_after: int  # qweight + scales + biases (+bias) bytes after
    model_bytes_before: int = 0  # all parameters and buffers of the model (shared storage once)
    model_bytes_after: int = 0
    already_quantized: list[str] = dataclasses.field(default_factory=list)  # in the asked format, left as they are
    experts: int = 0  # of `converted`, the MoE expert blocks (each a stack of the experts' projections)

    def __str__(self) -> str:
        ratio = f"{self.bytes_before / self.bytes_after:.2f}x smaller" if self.bytes_after else "none converted"
        already = f", {len(self.already_quantized)} already quantized with these settings" if self.already_quantized else ""
        layers = f"{len(self.converted) - self.experts} linear layers"
        if self.experts:
            layers += f" and {self.experts} MoE expert block{'s' if self.experts > 1 else ''}"
        return (
            f"{layers} quantized, {len(self.skipped)} skipped{already}; "
            f"those layers {self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB ({ratio}); "
            f"model {self.model_bytes_before / 2**20:.1f} MiB -> {self.model_bytes_after / 2**20:.1f} MiB"
        )


def _module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _model_bytes(model: nn.Module) -> int:
    """Bytes of the storages behind the parameters and buffers of `model`, each storage counted once
    (tied weights share one)."""
    seen: set = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr()) if storage.data_ptr() != 0 else id(t)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _why_not_convertible(model: nn.Module, name: str, linear: nn.Linear, owners: dict[int, set[int]],
                         group_size: int) -> str | None:
    if linear.in_features % group_size != 0:
        return f"in_features={linear.in_features} is not a multiple of group_size={group_size}"
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    for reader, children in _WEIGHT_READERS:
        if isinstance(parent, reader) and child in children:
            return f"its parent {type(parent).__name__} reads {child}.weight directly"
    for pname, p in linear.named_parameters(recurse=False):
        others = [o for o in owners[id(p)] if o != id(linear)]
        if others:
            shared = sorted({n for n, m in model.named_modules(remove_duplicate=False) if id(m) in others})
            return f"{pname} is shared with {', '.join(shared)} (tied; kept float so that the tie holds)"
    return None


def _already_quantized(model: nn.Module, filter_fn, bits, group_size: int, mode: str) -> list[str]:
    """Names of the quantized linear layers (accepted by filter_fn) already in the asked format;
    raises ValueError naming those in another format, which quantize_model does not re-quantize."""
    # Imported when called, so that `import torch_qmm` does not load the interop stack.
    from .interop.modules import GGUFLinear

    same, other = [], []
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, (QuantLinear, GGUFLinear)) or (filter_fn is not None and not filter_fn(name, module)):
            continue
        if (isinstance(module, QuantLinear) and type(bits) is int
                and module.format_values() == quant_state_values(bits, group_size, mode)):
            same.append(name)
        else:
            other.append(f"{name} ({module.describe_format(module.format_values())})")
    if other:
        raise ValueError(
            f"quantize_model(bits={bits}, group_size={group_size}, mode={mode!r}): the model already holds quantized layers "
            f"in another format: {', '.join(other)}; they are not re-quantized (that would compound the "
            "rounding). Quantize the float model, or pass a filter_fn that leaves these layers out to quantize "
            "only the others"
        )
    return same


def _transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the outermost transformers models in `model`: itself, or the submodules no
    other transformers model contains (a sentence-transformers model, or any wrapper, holds its
    transformers model as a submodule, and saves it with that submodule's save_pretrained).
    Containment is by identity: a wrapper may also register a part of a model under another name."""
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported
    if transformers is None:
        return []
    models = [(n, m) for n, m in model.named_modules() if isinstance(m, transformers.PreTrainedModel)]
    inner = {id(sub) for _, m in models for sub in m.modules() if sub is not m}
    return [(n, m) for n, m in models if id(m) not in inner]


def _record_for_transformers(model: nn.Module) -> None:
    """Each transformers model in `model` quantized here (not by its own from_pretrained, whose
    quantizer records the config itself) gets the torch_qmm quantization_config of its layers, so
    that save_pretrained writes a folder that reloads into them; where none can describe them, a
    warning says so."""
    from .interop.transformers import record_quantization_config

    for name, hf_model in _transformers_models(model):
        if getattr(hf_model, "hf_quantizer", None) is not None:
            continue
        why_not = record_quantization_config(hf_model)
        if why_not is not None:
            which = "this model's" if name == "" else f"{name}'s"
            warnings.warn(f"save_pretrained cannot record {which} torch_qmm layers: {why_not}; a reload would "
                          "build float layers. Save with torch_qmm.interop.save_mlx instead", stacklevel=3)


CONV1D_NOT_CONVERTED = "a transformers Conv1D (GPT-2 style), not an nn.Linear: left float"


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (pytorch_utils.Conv1D: GPT-2-style models' linear layers, y = x @ W + b
    with W [in, out]), which no torch_qmm module replaces."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def record_loaded_model(model: nn.Module, loader: str) -> None:
    """For a transformers model that `loader` filled with torch_qmm layers: records in its config
    what save_pretrained needs (torch_qmm.interop.transformers.record_loaded_model)."""
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return
    from .interop.transformers import record_loaded_model as record

    record(model, loader)


def _check_compute_dtypes(dtype: torch.dtype | None, layers: list[tuple[str, nn.Module]]) -> None:
    """TypeError, before any layer is changed, when `dtype` or (dtype None) the float weights of a
    layer to quantize are not a dtype the quantized layers compute in (float64 weights: the layers
    would be built and then refused one by one, leaving the model half converted)."""
    if dtype is not None:
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"quantize_model: argument 'dtype' must be one of {SUPPORTED_DTYPES} or None, got {dtype}")
        return
    bad = {}
    for name, module in layers:
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype not in SUPPORTED_DTYPES:
                bad.setdefault(name, p.dtype)
    if bad:
        listed = ", ".join(f"{n or '<model>'} ({d})" for n, d in list(bad.items())[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise TypeError(
            f"quantize_model: quantized layers compute in {', '.join(str(d) for d in SUPPORTED_DTYPES)}; these "
            f"layers' weights have another dtype: {listed}{more}. Pass dtype= (e.g. dtype=torch.float32) and "
            f"cast the model to it (model.to(dtype)), or leave them out with filter_fn"
        )


def quantize_model(
    model: nn.Module,
    bits=None,
    group_size: int | None = None,
    filter_fn: Callable[[str, nn.Linear], bool] | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    method="rtn",
    calibration: Iterable | None = None,
    mode: str = "affine",
    experts: bool = True,
    quantize_gates: bool = False,
) -> QuantizeSummary:
    """Swaps eligible nn.Linear layers of `model` for QuantLinear, in place, and the fused experts of
    MoE blocks (transformers' Mixtral, Qwen-MoE, OLMoE, gpt-oss, ...) for QuantFusedExperts.

    Args:
        model: any module; its nn.Linear children (at any depth) are candidates.
        bits, group_size, mode: the format, mode a key of torch_qmm.formats.FORMATS; bits /
            group_size None: the mode's defaults (MLX's; affine 4 / 64).
        filter_fn: (qualified name, layer) -> bool; only layers it accepts are converted. It is
            also asked about the layers that are already quantized (QuantLinear, GGUFLinear).
        dtype: compute dtype of the quantized layers (default: each layer's weight dtype). Their
            input must come in that dtype, as for nn.Linear: with another dtype than the model's,
            cast the model too (model.to(dtype)).
        progress: show a tqdm bar (default: when there are many layers).
        method: a name of torch_qmm.quantizers.names(): "rtn" (MLX's round-to-nearest, bit for
            bit), "mse", "awq", "gptq", "gptq-clip", "awq-gptq", "gptq-refit", "awq-gptq-refit"; or
            torch_qmm.quantizers.GPTQ(...) /
            AWQ(...) options; all write the same affine format (the fp modes
            take rtn only). See torch_qmm.quantizers. `bits` may also be a mapping name -> bits or
            a MixedBits budget (affine).
        calibration: model inputs (token-id tensors [1, T] or dicts of model kwargs) for awq/gptq
            (and for measuring sensitivity with a MixedBits budget).
        experts: quantize the fused experts modules (torch_qmm.interop.experts) that filter_fn
            accepts, with rtn and one bit width (per-layer methods skip them, with a warning).
        quantize_gates: also quantize the nn.Linear gates of MoE blocks (GATE_LINEARS, e.g.
            shared_expert_gate); by default they stay float, as do the routers (not nn.Linear).

    Skipped with a warning: layers whose in_features is not a multiple of group_size, layers whose
    weight (or bias) another module shares (a tied output head stays tied to its float embedding),
    and layers whose parent reads their .weight instead of calling them (nn.TransformerEncoderLayer's
    linear1/linear2, read by its fast path). Only nn.Linear itself is converted, not its subclasses:
    nn.MultiheadAttention's out_proj (a NonDynamicallyQuantizableLinear) stays float without a warning.

    Already quantized layers (that filter_fn accepts) are left as they are when they have the asked
    bits (an int) and group_size (summary.already_quantized, so a repeated call is a no-op); in any
    other format (or with per-layer bits) ValueError names each of them and both formats, before
    anything is changed.
    """
    from .quantizers import resolve

    bits_per_layer = bits is not None and type(bits) is not int
    per_layer = resolve(method).kind != "rtn" or bits_per_layer or calibration is not None
    experts_not_per_layer = ("fused experts are quantized by rtn with one bit width, not "
                             + ("per-layer bits" if bits_per_layer else f"method={method!r}"))
    # Per-layer bits (a mapping or a budget) are checked by the quantizers.
    uniform_bits, group_size = resolve_format(mode, bits if bits is None or type(bits) is int else None, group_size)
    if bits is None or type(bits) is int:
        bits = uniform_bits
    if per_layer and mode != "affine":
        raise ValueError(f"mode={mode!r} is quantized by rtn with one bit width (the format allows only "
                         f"bits={uniform_bits}); method={method!r}, per-layer bits and calibration are for mode 'affine'")
    already = _already_quantized(model, filter_fn, bits, group_size, mode)
    owners: dict[int, set[int]] = {}  # id(parameter) -> ids of the modules holding it
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    model_before = _model_bytes(model)
    # remove_duplicate=False: a layer registered under several names (shared) is replaced at every
    # one of them by one QuantLinear, quantized once (named_modules() would yield only the first).
    from .interop.experts import experts_not_quantizable, fused_experts, is_gate_linear, quantize_experts

    candidates = [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if type(module) is nn.Linear and (filter_fn is None or filter_fn(name, module))
        and (quantize_gates or not is_gate_linear(name))
    ]
    experts_modules = [(n, m) for n, m in (fused_experts(model) if experts else [])
                       if filter_fn is None or filter_fn(n, m)]
    _check_compute_dtypes(dtype, candidates + experts_modules)
    summary = QuantizeSummary(converted=[], skipped={}, bytes_before=0, bytes_after=0, already_quantized=already)
    for name, module in model.named_modules():
        if is_conv1d(module) and (filter_fn is None or filter_fn(name, module)):
            summary.skipped[name] = CONV1D_NOT_CONVERTED
    for name, module in experts_modules:
        if per_layer:
            summary.skipped[name] = experts_not_per_layer
            continue
        why_not = experts_not_quantizable(module, group_size)
        if why_not is not None:
            summary.skipped[name] = why_not
            continue
        before = _module_bytes(module)
        quantized = quantize_experts(module, bits=bits, group_size=group_size, mode=mode, dtype=dtype)
        summary.bytes_before += before
        summary.bytes_after += _module_bytes(quantized)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
        summary.converted.append(name)
        summary.experts += 1
    show = bool(candidates) and (progress if progress is not None else len(candidates) >= _PROGRESS_MIN_LAYERS)
    # Everything the swap needs is taken from the layers now, and from here on they are held only
    # by the model, so that each float layer is freed as soon as it is swapped at all its names
    # (unless the caller holds it): the swap never holds a float and a quantized copy of the model.
    why_not = {n: _why_not_convertible(model, n, m, owners, group_size) for n, m in candidates}
    first: dict[str, str] = {}  # name -> the first name of the same layer (each layer quantized once)
    first_of_id: dict[int, str] = {}
    bytes_before: dict[str, int] = {}
    for n, m in candidates:
        if why_not[n] is None:
            first[n] = first_of_id.setdefault(id(m), n)
            bytes_before.setdefault(first[n], _module_bytes(m))
    aliases: dict[str, list[str]] = {}
    for n, f in first.items():
        aliases.setdefault(f, []).append(n)
    names = [n for n, _ in candidates]
    del candidates, first_of_id
    if isinstance(bits, Mapping):
        left_float = {n: why_not[n] for n in bits if why_not.get(n) is not None}
        if left_float:
            raise ValueError("argument 'bits' names layers that quantize_model leaves float: "
                             + "; ".join(f"{n} ({why})" for n, why in left_float.items()))
    plan = None
    if per_layer:
        from .quantizers import prepare

        plan = prepare(model, list(aliases), bits, group_size, method, calibration, dtype,
                       bool(show) and bool(aliases), aliases)
    done: dict[str, QuantLinear] = {}  # first name of a layer -> its replacement
    for name in tqdm(names, desc="quantizing", disable=not show, unit="layer"):
        if why_not[name] is not None:
            summary.skipped[name] = why_not[name]
            continue
        quantized = done.get(first[name])
        if quantized is None:
            # the float layer, or the calibrated pass's Dequantized stand-in of it
            linear = model.get_submodule(name)
            quantized = (plan.build(first[name], linear) if plan is not None
                         else QuantLinear.from_linear(linear, bits=bits, group_size=group_size, dtype=dtype, mode=mode))
            del linear
            done[first[name]] = quantized
            summary.bytes_before += bytes_before[first[name]]
            summary.bytes_after += _module_bytes(quantized)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantized)
        summary.converted.append(name)
    summary.model_bytes_before, summary.model_bytes_after = model_before, _model_bytes(model)
    _record_for_transformers(model)
    if summary.skipped:
        warnings.warn(
            "quantize_model skipped "
            + ", ".join(f"{n} ({why})" for n, why in summary.skipped.items()),
            stacklevel=2,
        )
    return summary
