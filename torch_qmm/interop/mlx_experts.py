"""MLX-LM's names and layout of MoE tensors, and the fused experts of a transformers model.

mlx_lm keeps the routed experts of a block as a SwitchGLU of three SwitchLinear layers,
``<experts>.gate_proj``, ``<experts>.up_proj`` and ``<experts>.down_proj``, each [E, out, in]
(quantized: ``.weight`` uint32 [E, out, in*bits/32], ``.scales`` / ``.biases`` [E, out, in/group];
optional ``.bias`` [E, out]). transformers keeps gate and up as one gate_up_proj (its rows in the
order QuantFusedExperts.gate_and_up_rows reads), so a save splits the rows of the stored tensors
and a load joins them: each row is quantized on its own, so this is exact.

Where the SwitchGLU sits is the family's (mlx_lm's models/<model_type>.py): MLX_LM_RENAMES maps
the transformers key of a tensor to mlx_lm's, by the model_type of config.json.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..nn_moe import QuantFusedExperts, join_gate_up, split_gate_up
from ..ops import dequantize
from .experts import empty_quant_experts, expert_shapes, float_weights, fused_experts, layout_of

# model_type -> (transformers key part, mlx_lm key part), applied in order to every key.
_SWITCH = ((".mlp.experts.", ".mlp.switch_mlp."),)
MLX_LM_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".mlp.experts.", ".block_sparse_moe.switch_mlp."), (".mlp.gate.", ".block_sparse_moe.gate.")),
    "qwen2_moe": _SWITCH,
    "qwen3_moe": _SWITCH,
    "olmoe": _SWITCH,
    "gpt_oss": (),  # mlx_lm keeps transformers' names (mlp.experts, mlp.router)
}

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stored_parts(spec) -> tuple[str, ...]:
    """The tensors a quantized layer of format `spec` (a QuantSpec) is stored as, after its path."""
    return ("weight", "scales", "biases") if spec.has_biases else ("weight", "scales")


def dequantized_stored(ckpt, p: str, spec) -> torch.Tensor:
    """float32 weight of the quantized layer stored at checkpoint path p (the values MLX
    multiplies by; its scales and biases checked finite). Its shapes are checked by the caller."""
    parts = [ckpt.finite_scales(f"{p}.{part}", ckpt.get(f"{p}.{part}")) for part in stored_parts(spec)]
    return dequantize(*parts, group_size=spec.group_size, bits=spec.bits, mode=spec.mode, dtype=torch.float32)


def to_mlx_key(key: str, model_type: str | None) -> str:
    for ours, theirs in MLX_LM_RENAMES.get(model_type, ()):
        key = key.replace(ours, theirs)
    return key


def from_mlx_key(key: str, model_type: str | None) -> str:
    for ours, theirs in reversed(MLX_LM_RENAMES.get(model_type, ())):
        key = key.replace(theirs, ours)
    return key


def mlx_experts_path(path: str, model_type: str | None) -> str:
    """mlx_lm's module path of the SwitchGLU that holds the experts module at `path`."""
    return to_mlx_key(path + ".", model_type)[:-1]


def split_experts(prefix: str, module: QuantFusedExperts) -> dict[str, torch.Tensor]:
    """The tensors of a QuantFusedExperts under mlx_lm's names (prefix: its mlx_lm path)."""
    out = {}
    gate_up, down = module.gate_up_proj, module.down_proj
    for leaf, name in (("qweight", "weight"), ("scales", "scales"), ("biases", "biases"), ("bias", "bias")):
        t = getattr(gate_up, leaf)
        if t is not None:
            gate, up = module.gate_and_up_rows(t)
            out[f"{prefix}.gate_proj.{name}"], out[f"{prefix}.up_proj.{name}"] = gate.contiguous(), up.contiguous()
        t = getattr(down, leaf)
        if t is not None:
            out[f"{prefix}.down_proj.{name}"] = t
    return out


def float_experts_tensors(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a float fused experts module under mlx_lm's names (prefix: its mlx_lm path)."""
    layout = layout_of(module)
    gate_up, down, gate_up_bias, down_bias = (t.detach() if t is not None else None
                                              for t in float_weights(module, layout))
    out = {}
    for leaf, fused, single in (("weight", gate_up, down), ("bias", gate_up_bias, down_bias)):
        if fused is None:
            continue
        gate, up = split_gate_up(fused, layout.interleaved)
        out[f"{prefix}.gate_proj.{leaf}"], out[f"{prefix}.up_proj.{leaf}"] = gate.contiguous(), up.contiguous()
        out[f"{prefix}.down_proj.{leaf}"] = single.contiguous()
    return out


def experts_specs(model: nn.Module, model_type: str | None) -> dict[str, tuple[int, int, str]]:
    """mlx_lm path of each quantized SwitchLinear -> (bits, group_size, mode)."""
    specs = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantFusedExperts):
            prefix = mlx_experts_path(name, model_type)
            for proj in PROJECTIONS:
                layer = m.down_proj if proj == "down_proj" else m.gate_up_proj
                specs[f"{prefix}.{proj}"] = (layer.bits, layer.group_size, layer.mode)
    return specs


def empty_stored_experts(ckpt, experts: nn.Module, prefix: str, spec_of, dtype: torch.dtype, check_shapes,
                         device: torch.device | str | None = None) -> tuple[QuantFusedExperts, str]:
    """The empty QuantFusedExperts (on `device`, default the module's) for the fused experts module
    `experts` that the checkpoint stores quantized under mlx_lm path `prefix`, and its format.
    Checks that the three projections are all quantized, gate_proj and up_proj in one format,
    and their stored shapes (spec_of and check_shapes as for load_experts)."""
    has = {proj: f"{prefix}.{proj}.scales" in ckpt for proj in PROJECTIONS}
    specs = {proj: spec_of(f"{prefix}.{proj}") if has[proj] else "float" for proj in PROJECTIONS}
    if not all(has.values()) or specs["gate_proj"] != specs["up_proj"]:
        raise ValueError(
            f"{ckpt.path}: the experts {prefix}.{{gate,up,down}}_proj must all be quantized, gate_proj and "
            f"up_proj in one format; got {', '.join(f'{p} {specs[p]}' for p in PROJECTIONS)}"
        )
    e, hidden, inter = expert_shapes(experts, layout_of(experts))
    for proj, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                               ("down_proj", (hidden, inter))):
        check_shapes(ckpt, f"{prefix}.{proj}", specs[proj], rows, cols, experts=e)
    gs, ds = specs["gate_proj"], specs["down_proj"]
    new = empty_quant_experts(experts, gs.bits, gs.group_size, gs.mode, dtype, device=device,
                              down=(ds.bits, ds.group_size, ds.mode))
    return new, str(gs) if gs == ds else f"gate/up {gs}, down {ds}"


def load_experts(model: nn.Module, ckpt, model_type: str | None, spec_of, dtype: torch.dtype,
                 check_shapes, check_dtype, meta=None) -> tuple[set[str], dict[str, str], list[str]]:
    """Fills the fused experts modules of `model` from an MLX checkpoint: quantized SwitchLinear
    tensors make a QuantFusedExperts (replacing the module), float ones fill its parameters.
    spec_of(mlx path) -> QuantSpec; check_shapes(ckpt, path, spec, rows, cols) checks the stored
    shapes and dtypes of the quantized layers; check_dtype(ckpt, key, dst) that of each stored
    tensor read into `dst` (a float one must be stored as a float: copy_ would convert the
    integers of another dtype into other values). meta: the MetaTensors of a model built on the meta device (the new
    QuantFusedExperts are created on its device, float expert weights get storage there before
    they are filled). Returns (checkpoint keys used, {module path: format} of the quantized, the
    paths of the experts modules filled)."""
    used: set[str] = set()
    quantized: dict[str, str] = {}
    filled: list[str] = []
    for name, experts in fused_experts(model):
        prefix = mlx_experts_path(name, model_type)
        layout = layout_of(experts)
        has = {proj: f"{prefix}.{proj}.scales" in ckpt for proj in PROJECTIONS}
        if not any(f"{prefix}.{proj}.weight" in ckpt for proj in PROJECTIONS):
            continue
        filled.append(name)
        specs = {proj: spec_of(f"{prefix}.{proj}") if has[proj] else None for proj in PROJECTIONS}
        if any(has.values()) and not (all(has.values()) and specs["gate_proj"] == specs["up_proj"]):
            # mlx_lm quantizes each SwitchLinear on its own and leaves one whose input is smaller
            # than the group size float; a QuantFusedExperts holds gate/up in one format and down
            # in one: such experts load float, their quantized projections dequantized.
            warnings.warn(f"{ckpt.path}: the experts {prefix} store "
                          + ", ".join(f"{p} {specs[p] or 'float'}" for p in PROJECTIONS)
                          + "; torch_qmm's quantized experts hold gate_proj and up_proj in one format and all three "
                          "quantized, so these load float (the quantized ones dequantized: the weights MLX "
                          "multiplies by)", stacklevel=3)
            has = {proj: False for proj in PROJECTIONS}
        if any(has.values()):
            new, fmt = empty_stored_experts(ckpt, experts, prefix, spec_of, dtype, check_shapes,
                                            device=None if meta is None else meta.device)
            for layer, projs in ((new.gate_up_proj, ("gate_proj", "up_proj")), (new.down_proj, ("down_proj",))):
                for leaf, stored in (("qweight", "weight"), ("scales", "scales"), ("biases", "biases"), ("bias", "bias")):
                    dst = getattr(layer, leaf)
                    keys = [f"{prefix}.{p}.{stored}" for p in projs]
                    present = [k in ckpt for k in keys]
                    if dst is None:
                        if any(present):
                            raise ValueError(f"{ckpt.path}: {keys[0]} is stored, but the model's experts have no {leaf}")
                        continue
                    if not all(present):
                        raise ValueError(f"{ckpt.path}: the model's experts {name} have a {leaf}; missing {keys}")
                    for k in keys:
                        check_dtype(ckpt, k, dst)
                    parts = [ckpt.finite_scales(k, ckpt.get(k)) for k in keys]
                    t = new.join_gate_and_up(*parts) if len(parts) == 2 else parts[0]
                    if tuple(t.shape) != tuple(dst.shape):
                        raise ValueError(f"{ckpt.path}: {keys} have shapes {[list(p.shape) for p in parts]}, the "
                                         f"experts {name} take {list(dst.shape)} ({leaf})")
                    with torch.no_grad():
                        dst.copy_(t)
                    used.update(keys)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            quantized[name] = fmt
        else:
            if meta is not None:
                for weight in layout.weight_names:
                    meta.real(experts, weight)
            gate_up, down, gate_up_bias, down_bias = float_weights(experts, layout)
            for dst, projs, leaf in ((gate_up, ("gate_proj", "up_proj"), "weight"), (down, ("down_proj",), "weight"),
                                     (gate_up_bias, ("gate_proj", "up_proj"), "bias"),
                                     (down_bias, ("down_proj",), "bias")):
                if dst is None:
                    continue
                keys = [f"{prefix}.{p}.{leaf}" for p in projs]
                missing = [k for k in keys if k not in ckpt]
                if missing:
                    raise ValueError(f"{ckpt.path}: the experts {name} need {missing}")
                parts = []
                for p, k in zip(projs, keys):
                    spec = specs[p] if leaf == "weight" else None
                    if spec is None:
                        check_dtype(ckpt, k, dst)
                        parts.append(ckpt.get(k))
                        continue
                    rows, cols = dst.shape[1] // len(projs), dst.shape[2]
                    check_shapes(ckpt, f"{prefix}.{p}", spec, rows, cols, experts=dst.shape[0])
                    parts.append(dequantized_stored(ckpt, f"{prefix}.{p}", spec))
                    used.update(f"{prefix}.{p}.{t}" for t in stored_parts(spec))
                t = join_gate_up(*parts, layout.interleaved) if len(parts) == 2 else parts[0]
                if tuple(t.shape) != tuple(dst.shape):
                    raise ValueError(f"{ckpt.path}: {keys} have shapes {[list(p.shape) for p in parts]}, the "
                                     f"experts {name} take {list(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(t)
                used.update(keys)
    return used, quantized, filled

