"""The fused experts of transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, ...)
and their quantized replacement, QuantFusedExperts.

transformers keeps the routed experts of a MoE block in one module holding 3-D parameters
``gate_up_proj`` and ``down_proj`` (plus ``*_bias`` for gpt-oss), and describes their layout on
the module through its ``use_experts_implementation`` decorator: ``is_transposed`` ([E, in, out]
rather than [E, out, in]), ``is_concatenated`` (gate rows then up rows, else alternating),
``has_bias``, ``has_gate`` and ``has_post_expert_norm``. ExpertsLayout reads that description
(one mechanism for every family; EXPERT_LAYOUTS takes a class whose module does not describe
itself), so quantizing, saving and loading never name a model family.

The router (the module choosing the experts) is not an nn.Linear in these models and stays float;
nn.Linear gates (Qwen2-MoE's shared_expert_gate, named in GATE_LINEARS) stay float unless asked.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..nn_moe import GateOfExperts, QuantFusedExperts, QuantSwitchLinear

# Names of nn.Linear layers that gate a MoE block (a sigmoid or softmax over their output); kept
# float by quantize_model unless quantize_gates=True.
GATE_LINEARS = ("shared_expert_gate",)


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How a fused experts module stores its weights (names as transformers spells them)."""

    transposed: bool = False  # gate_up_proj [E, H, 2I], down_proj [E, I, H]
    interleaved: bool = False  # gate_up rows alternate gate, up (else the I gate rows, then the I up rows)
    has_bias: bool = False  # gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"

    @property
    def weight_names(self) -> tuple[str, ...]:
        names = (self.gate_up, self.down)
        return names + tuple(f"{n}_bias" for n in names) if self.has_bias else names


# Class name -> layout, for experts modules that do not carry transformers' layout attributes.
EXPERT_LAYOUTS: dict[str, ExpertsLayout] = {}


def described_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout an experts module's class describes (EXPERT_LAYOUTS, or transformers' attributes),
    whether or not it holds its weights (GateOfExperts empties it); None for other modules."""
    layout = EXPERT_LAYOUTS.get(type(module).__name__)
    if layout is None:
        described = all(hasattr(module, a) for a in ("is_transposed", "is_concatenated", "has_bias", "has_gate"))
        if not described or not module.has_gate or getattr(module, "has_post_expert_norm", False):
            return None
        layout = ExpertsLayout(transposed=bool(module.is_transposed), interleaved=not module.is_concatenated,
                               has_bias=bool(module.has_bias))
    return layout


def layout_of(module: nn.Module) -> ExpertsLayout | None:
    """The layout of a fused experts module, or None when `module` is not one."""
    layout = described_layout(module)
    if layout is None:
        return None
    params = dict(module.named_parameters(recurse=False))
    if not all(n in params for n in layout.weight_names) or params[layout.gate_up].dim() != 3:
        return None
    return layout


def is_fused_experts(module: nn.Module) -> bool:
    return layout_of(module) is not None


def expert_shapes(module: nn.Module, layout: ExpertsLayout) -> tuple[int, int, int]:
    """(E, H, I) of a fused experts module."""
    e, a, b = module.get_parameter(layout.gate_up).shape
    hidden, two_i = (a, b) if layout.transposed else (b, a)
    return e, hidden, two_i // 2


def float_weights(module: nn.Module, layout: ExpertsLayout):
    """(gate_up [E, 2I, H], down [E, H, I], gate_up bias [E, 2I] or None, down bias [E, H] or None):
    MLX-LM's SwitchLinear orientation (rows = outputs), the gate / up rows in the module's order."""
    gate_up, down = module.get_parameter(layout.gate_up), module.get_parameter(layout.down)
    if layout.transposed:
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    biases = ((module.get_parameter(f"{layout.gate_up}_bias"), module.get_parameter(f"{layout.down}_bias"))
              if layout.has_bias else (None, None))
    return gate_up, down, *biases


def quantize_experts(module: nn.Module, bits: int | None = None, group_size: int | None = None,
                     mode: str = "affine", dtype: torch.dtype | None = None) -> QuantFusedExperts:
    """A QuantFusedExperts computing what `module` computes, its weights quantized (MLX's rounding
    of each output row along the input dimension, as mx.quantize of the [E, out, in] weight)."""
    layout = _layout_or_raise(module)
    gate_up, down, gate_up_bias, down_bias = float_weights(module, layout)
    return quant_experts_of(
        module,
        QuantSwitchLinear.from_float(gate_up.detach().contiguous(), gate_up_bias, bits, group_size, dtype, mode),
        QuantSwitchLinear.from_float(down.detach().contiguous(), down_bias, bits, group_size, dtype, mode))


def quant_experts_of(module: nn.Module, gate_up: QuantSwitchLinear, down: QuantSwitchLinear) -> QuantFusedExperts:
    """The QuantFusedExperts of `module` computing with gate_up / down and `module`'s gating;
    `module` loses its float expert weights (GateOfExperts)."""
    layout = _layout_or_raise(module)
    return QuantFusedExperts(gate_up, down, GateOfExperts(module, layout.weight_names), interleaved=layout.interleaved)


def empty_quant_layers(module: nn.Module, bits: int, group_size: int, mode: str, dtype: torch.dtype,
                       device: torch.device | str | None = None,
                       down: tuple[int, int, str] | None = None) -> tuple[QuantSwitchLinear, QuantSwitchLinear]:
    """(gate_up_proj, down_proj) QuantSwitchLinear of `module`'s shape with zero buffers, for a
    checkpoint to fill; `module` is left as it is. down: (bits, group_size, mode) of down_proj when
    it differs from gate_up_proj's."""
    layout = _layout_or_raise(module)
    e, hidden, inter = expert_shapes(module, layout)
    device = device if device is not None else module.get_parameter(layout.gate_up).device
    kw = dict(bias=layout.has_bias, device=device, dtype=dtype)
    d_bits, d_group, d_mode = down or (bits, group_size, mode)
    return (QuantSwitchLinear(e, hidden, 2 * inter, bits=bits, group_size=group_size, mode=mode, **kw),
            QuantSwitchLinear(e, inter, hidden, bits=d_bits, group_size=d_group, mode=d_mode, **kw))


def empty_quant_experts(module: nn.Module, bits: int, group_size: int, mode: str, dtype: torch.dtype,
                        device: torch.device | str | None = None,
                        down: tuple[int, int, str] | None = None) -> QuantFusedExperts:
    """A QuantFusedExperts of `module`'s shape with zero buffers, for a checkpoint to fill (the
    layers of empty_quant_layers); `module` loses its float expert weights."""
    return quant_experts_of(module, *empty_quant_layers(module, bits, group_size, mode, dtype, device, down))


def experts_not_quantizable(module: nn.Module, group_size: int) -> str | None:
    """Why a fused experts module cannot take group_size (its H or I not a multiple), or None."""
    _, hidden, inter = expert_shapes(module, _layout_or_raise(module))
    for name, v in (("hidden size", hidden), ("intermediate size", inter)):
        if v % group_size != 0:
            return f"its {name} {v} is not a multiple of group_size={group_size}"
    return None


def _layout_or_raise(module: nn.Module) -> ExpertsLayout:
    layout = layout_of(module)
    if layout is None:
        raise ValueError(f"{type(module).__name__} is not a fused experts module (3-D gate_up_proj / down_proj with "
                         "a layout described by transformers' use_experts_implementation or EXPERT_LAYOUTS)")
    return layout


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every fused experts module of `model`."""
    return [(n, m) for n, m in model.named_modules() if is_fused_experts(m)]


def is_gate_linear(name: str) -> bool:
    return name.rpartition(".")[2] in GATE_LINEARS
