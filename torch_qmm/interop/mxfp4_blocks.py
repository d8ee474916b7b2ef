"""transformers' mxfp4 checkpoints (gpt-oss; config.json "quantization_config": {"quant_method":
"mxfp4"}): the experts are stored as ``<experts>.<proj>_blocks`` uint8 [E, out, in/32, 16] and
``<experts>.<proj>_scales`` uint8 [E, out, in/32] (proj: gate_up_proj, down_proj; the biases and
every other tensor float). They load as QuantFusedExperts of mode "mxfp4" without dequantizing.

The two layouts hold the same bits. A block is one group of 32 E2M1 codes, code 2j in the low
nibble of byte j and code 2j+1 in its high nibble (transformers.integrations.mxfp4 reads
``blk & 0x0F`` into the even columns and ``blk >> 4`` into the odd ones); MLX packs 4-bit codes as
one little-endian bit stream per row, code j at bits [4j, 4j + 4), so the 16 bytes of a block are
the group's four uint32 words as they lie in memory. The scales are E8M0 exponents in both
(2 ** (s - 127)); the rows are [out, in] in both (transformers transposes after dequantizing).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..format_state import FORMAT_STATE_KEY
from ..nn_moe import QuantFusedExperts, QuantSwitchLinear
from .experts import empty_quant_layers, fused_experts, layout_of, quant_experts_of
from .json_files import read_json_object
from .meta import MetaTensors, cast_stored, check_no_meta, compute_buffers, resolve_device
from .mlx import _SAFETENSORS_DTYPES, LoadReport
from .safetensors_io import Checkpoint

BLOCK_BYTES = 16  # one group of 32 4-bit codes
GROUP_SIZE = 32


def blocks_to_words(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., groups, 16] -> uint32 [..., groups * 4]: the same bytes (MLX's mxfp4 words)."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"mxfp4 blocks must be uint8 [..., groups, {BLOCK_BYTES}], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    return blocks.contiguous().view(torch.uint32).flatten(-2)


def words_to_blocks(words: torch.Tensor) -> torch.Tensor:
    """The inverse of blocks_to_words."""
    return words.contiguous().view(torch.uint8).unflatten(-1, (-1, BLOCK_BYTES))


def load_mxfp4_checkpoint(model: nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None,
                          strict: bool = True, device: torch.device | str | None = None) -> LoadReport:
    """Loads a transformers mxfp4 checkpoint (folder or .safetensors file) into `model` (its float
    architecture, e.g. GptOssForCausalLM(config)): the fused experts become QuantFusedExperts
    holding the stored blocks and scales bit for bit, every other tensor is loaded by name (cast to
    `dtype`, default the stored float tensors' dtype).

    The model may be built on the meta device (``with torch.device("meta"): model =
    GptOssForCausalLM(config)``), which costs no memory: the QuantFusedExperts are then built on
    `device` (default: the CPU) from the stored blocks, so the float experts never exist; every
    other tensor the checkpoint holds is created there from it, the buffers the model computes
    rather than stores (the rotary embedding's frequencies) are computed again
    (torch_qmm.interop.meta.compute_buffers) and any tensor still without values is a ValueError
    naming it. A model built in memory is filled where it is, as before (`device` is only for a
    model built on meta).

    Every name, shape and dtype is checked and the expert tensors are read before `model` changes:
    a file that does not fit raises ValueError naming the file and the tensor, `model` as it was."""
    dev = resolve_device(model, device, "load_mxfp4_checkpoint")
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_path = folder / "config.json"
    if config_path.is_file():
        method = (read_json_object(config_path).get("quantization_config") or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"{config_path}: quantization_config.quant_method is {method!r}, expected 'mxfp4'")
    ckpt = Checkpoint(path)
    keys = ckpt.keys()
    if dtype is None:
        floats = [ckpt.dtype_name(k) for k in keys if ckpt.dtype_name(k) in _SAFETENSORS_DTYPES]
        dtype = _SAFETENSORS_DTYPES[max(set(floats), key=floats.count)] if floats else torch.float32
    report = LoadReport(quantized={}, float_tensors=0, bytes_read=0)
    layers: dict[str, tuple[nn.Module, QuantSwitchLinear, QuantSwitchLinear]] = {}  # name -> (experts, filled)
    used: set[str] = set()
    for name, experts in fused_experts(model):
        filled = _read_experts(ckpt, name, experts, dtype, used, dev)
        if filled is not None:
            layers[name] = (experts, *filled)
            report.quantized[name] = "mxfp4 b4 gs32"
    report.bytes_read += sum(ckpt.nbytes(k) for k in used)
    state = _state_after(model, {name: (gate_up, down) for name, (_, gate_up, down) in layers.items()})
    rest = [k for k in keys if k not in used]
    if strict:
        loaded_modules = tuple(f"{n}." for n in report.quantized)
        missing = sorted(k for k in state if k not in rest and not k.startswith(loaded_modules)
                         and k.rpartition(".")[2] != FORMAT_STATE_KEY)
        unexpected = sorted(k for k in rest if k not in state)
        if missing or unexpected:
            raise ValueError(f"{ckpt.path}: checkpoint does not match the model: missing {missing[:8]}, "
                             f"unexpected {unexpected[:8]}")
    rest = [k for k in rest if k in state]
    for k in rest:
        if ckpt.shape(k) != tuple(state[k].shape):
            raise ValueError(f"{_file_of(ckpt, k)}: tensor {k!r} has shape {list(ckpt.shape(k))}, the model expects "
                             f"{list(state[k].shape)}")
        if state[k].is_floating_point() and ckpt.dtype_name(k) not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{_file_of(ckpt, k)}: tensor {k!r} is stored as {ckpt.dtype_name(k)}, the model expects a "
                             f"float ({', '.join(_SAFETENSORS_DTYPES)})")
    # Every check has passed: the model changes from here on.
    cast_stored(model, dtype)
    meta = MetaTensors(model, dev) if dev is not None else None
    for name, (experts, gate_up, down) in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, quant_experts_of(experts, gate_up, down))
    state = model.state_dict()
    with torch.no_grad():
        for k in rest:
            t = ckpt.get(k)
            (state[k] if meta is None else meta.real_key(model, k)).copy_(t)
            report.float_tensors += 1
            report.bytes_read += t.numel() * t.element_size()
    if dev is not None:
        compute_buffers(model, dev, f"load_mxfp4_checkpoint: {ckpt.path}")
        check_no_meta(model, "load_mxfp4_checkpoint", ckpt.path)
        model.to(dev)  # the tensors the model had in memory before (a model only partly on meta)
    return report


def _read_experts(ckpt: Checkpoint, name: str, experts: nn.Module, dtype: torch.dtype, used: set[str],
                  device: torch.device | None = None) -> tuple[QuantSwitchLinear, QuantSwitchLinear] | None:
    """The experts module `name`'s (gate_up_proj, down_proj) filled from its stored blocks, scales
    and biases (their names added to `used`), None when the checkpoint stores it as float; ValueError
    naming the file and the tensor when they do not fit. `experts` is not changed. device: where
    the layers are built (default: where `experts` is; given for a model built on meta)."""
    layout = layout_of(experts)
    stored = {proj: (f"{name}.{proj}_blocks", f"{name}.{proj}_scales") for proj in (layout.gate_up, layout.down)}
    if not any(b in ckpt for b, _ in stored.values()):
        return None
    new = empty_quant_layers(experts, 4, GROUP_SIZE, "mxfp4", dtype, device)
    for proj, layer in zip((layout.gate_up, layout.down), new):
        blocks_key, scales_key = stored[proj]
        for k in stored[proj]:
            if k not in ckpt:
                raise ValueError(f"{ckpt.path}: the experts {name} store {proj} as mxfp4 but {k} is missing")
        want_blocks = (*layer.scales.shape, BLOCK_BYTES)
        if ckpt.shape(blocks_key) != want_blocks or ckpt.shape(scales_key) != tuple(layer.scales.shape):
            raise ValueError(
                f"{_file_of(ckpt, blocks_key)}: {blocks_key} {list(ckpt.shape(blocks_key))} and {scales_key} "
                f"{list(ckpt.shape(scales_key))} must be {list(want_blocks)} and {list(layer.scales.shape)} "
                f"for the experts {name} ([E, out, in] = {[layer.num_experts, layer.out_features, layer.in_features]})"
            )
        for k in stored[proj]:
            if ckpt.dtype_name(k) != "U8":
                raise ValueError(f"{_file_of(ckpt, k)}: {k} must be U8, got {ckpt.dtype_name(k)}")
        bias_key = f"{name}.{proj}_bias"
        if layer.bias is not None:
            if bias_key not in ckpt:
                raise ValueError(f"{ckpt.path}: the experts {name} have a {proj} bias; {bias_key} is missing")
            if ckpt.shape(bias_key) != tuple(layer.bias.shape):
                raise ValueError(f"{_file_of(ckpt, bias_key)}: {bias_key} {list(ckpt.shape(bias_key))} must be "
                                 f"{list(layer.bias.shape)} for the experts {name}")
            if ckpt.dtype_name(bias_key) not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{_file_of(ckpt, bias_key)}: {bias_key} must be a float ({', '.join(_SAFETENSORS_DTYPES)}), "
                                 f"got {ckpt.dtype_name(bias_key)}")
        with torch.no_grad():
            layer.qweight.copy_(blocks_to_words(ckpt.get(blocks_key)))
            layer.scales.copy_(ckpt.get(scales_key))
            if layer.bias is not None:
                layer.bias.copy_(ckpt.get(bias_key))
                used.add(bias_key)
        used.update(stored[proj])
    return new


def _state_after(model: nn.Module, layers: dict[str, tuple[QuantSwitchLinear, QuantSwitchLinear]]) -> dict:
    """model.state_dict() as it will be once each experts module `name` of `layers` is replaced by
    the QuantFusedExperts of its two layers (gate_up_proj, down_proj); `model` is not changed (the
    gating has no state, so a stand-in takes its place)."""
    prefixes = tuple(f"{name}." for name in layers)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
    for name, (gate_up, down) in layers.items():
        stand_in = QuantFusedExperts(gate_up, down, nn.Identity())
        state.update({f"{name}.{k}": v for k, v in stand_in.state_dict().items()})
    return state


def _file_of(ckpt: Checkpoint, name: str) -> Path:
    """The file that holds tensor `name` (one shard of a folder)."""
    return ckpt.where[name]
