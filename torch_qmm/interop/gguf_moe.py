"""The mixture-of-experts parts of llama-family GGUF files (qwen2moe, qwen3moe, and Mixtral, which
llama.cpp writes as architecture llama with experts): config fields, tensor names and shapes, and
the routed experts as a QuantFusedExperts.

Facts from llama.cpp (convert_hf_to_gguf.py's Qwen2MoeModel, src/models/qwen2moe.cpp, qwen3moe.cpp)
and transformers' GGUF loader (integrations/ggml.py, modeling_gguf_pytorch_utils.py):
* metadata: {arch}.expert_count (num_experts; Mixtral's num_local_experts), expert_used_count
  (num_experts_per_tok), expert_feed_forward_length (moe_intermediate_size; a Mixtral file's
  experts are feed_forward_length wide, its intermediate_size), expert_shared_feed_forward_length
  (qwen2moe's shared_expert_intermediate_size). Every block is a MoE block;
* the router is blk.N.ffn_gate_inp [E, H] (transformers' mlp.gate, a TopKRouter holding a float
  weight); the experts are 3-D tensors blk.N.ffn_{gate,up,down}_exps, [E, I, H] for gate and up,
  [E, H, I] for down, one expert's rows after another (Mixtral files of older llama.cpp
  converters: one 2-D tensor per expert, blk.N.ffn_{gate,up,down}.E.weight) (transformers keeps gate and up as one
  gate_up_proj [E, 2I, H], the gate rows first); qwen2moe's shared expert is
  blk.N.ffn_{gate,up,down}_shexp (mlp.shared_expert.{gate,up,down}_proj) gated by
  blk.N.ffn_gate_inp_shexp (mlp.shared_expert_gate, an nn.Linear(H, 1)), [1, H] as the converter
  writes it or [H] (llama.cpp reads both);
* llama.cpp normalizes the top-k routing weights of qwen3moe and not those of qwen2moe
  (norm_topk_prob, which the file does not carry); Mixtral's router always does.

The experts keep the file's formats: K-quant blocks (Q2_K .. Q6_K) as GGUFSwitchLinear (exact in
any dtype), the 32-weight block types as affine QuantSwitchLinear (to_affine: exact in float32),
both in one QuantFusedExperts. Gate and up share one module, so they must share a type;
where they do not, or where some projections are float in the file, the block's experts are
loaded float (decoded), with a warning.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..nn_moe import QuantFusedExperts, QuantSwitchLinear
from .experts import ExpertsLayout, expert_shapes, layout_of, quant_experts_of
from .gguf import GGUFTensor, dequantize, to_affine, to_blocks
from .gguf_types import AFFINE_TYPES, FLOAT_TYPES, NATIVE_TYPES, type_name
from .modules import GGUFSwitchLinear

@dataclass(frozen=True)
class ExpertFields:
    """How a MoE architecture's transformers config names its expert count and width, and the
    GGUF metadata key (after "<arch>.") of the width."""

    count: str = "num_experts"
    size: str = "moe_intermediate_size"
    size_key: str = "expert_feed_forward_length"


QWEN_EXPERTS = ExpertFields()
MIXTRAL_EXPERTS = ExpertFields("num_local_experts", "intermediate_size", "feed_forward_length")
# Config fields of the shared expert (qwen2moe) and their metadata keys.
SHARED_SIZE = ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")
# The MoE config fields that are positive integers when present.
INT_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")


def moe_config_keys(fields: ExpertFields, shared: bool) -> dict[str, str]:
    """GGUF metadata key (after "<arch>.") -> config field, for a MoE architecture."""
    keys = {"expert_count": fields.count, "expert_used_count": "num_experts_per_tok", fields.size_key: fields.size}
    return keys | (dict([SHARED_SIZE]) if shared else {})

# Applied before the dense names of gguf_llama (whose ffn_gate / ffn_up / ffn_down patterns need a
# dot after the name, so they do not match these).
MOE_RENAMES = [
    (r"\.ffn_gate_inp_shexp\.", ".mlp.shared_expert_gate."),
    (r"\.ffn_gate_inp\.", ".mlp.gate."),
    (r"\.ffn_(gate|up|down)_shexp\.", r".mlp.shared_expert.\1_proj."),
]

_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.\d+\.weight$")
PARTS = ("gate", "up", "down")


def expert_part(gguf_name: str) -> tuple[int, str] | None:
    """(block, "gate" / "up" / "down") of a routed-experts tensor name (stacked or one expert's),
    else None."""
    m = _EXPERTS.match(gguf_name) or _PER_EXPERT.match(gguf_name)
    return (int(m.group(1)), m.group(2)) if m else None


def per_expert_layout(f) -> bool:
    """Whether the file keeps one tensor per expert (older Mixtral files)."""
    return "blk.0.ffn_gate.0.weight" in f.tensors


def experts_module_name(block: int) -> str:
    return f"model.layers.{block}.mlp.experts"


def expected_shapes(i: int, c: dict, fields: ExpertFields, shared: bool,
                    per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """The MoE tensors of block i and their shapes, from the config fields c (per_expert: one
    tensor per expert, per_expert_layout)."""
    hidden, e, inter = c["hidden_size"], c[fields.count], c[fields.size]
    out = {f"blk.{i}.ffn_gate_inp.weight": (e, hidden)}
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for part, shape in shapes.items():
        if per_expert:
            out.update({f"blk.{i}.ffn_{part}.{j}.weight": shape for j in range(e)})
        else:
            out[f"blk.{i}.ffn_{part}_exps.weight"] = (e, *shape)
    if shared:
        s = c["shared_expert_intermediate_size"]
        out.update({
            f"blk.{i}.ffn_gate_inp_shexp.weight": (hidden,),
            f"blk.{i}.ffn_gate_shexp.weight": (s, hidden),
            f"blk.{i}.ffn_up_shexp.weight": (s, hidden),
            f"blk.{i}.ffn_down_shexp.weight": (hidden, s),
        })
    return out


def moe_config(f, arch: str, kwargs: dict, fields: ExpertFields, shared: bool) -> None:
    """Fills the MoE config fields the file's metadata leaves out from its block-0 tensors, and
    refuses a file without the two expert counts."""
    keys = moe_config_keys(fields, shared)
    for key in ("expert_count", "expert_used_count"):
        if keys[key] not in kwargs:
            raise ValueError(f"{f.path}: metadata '{arch}.{key}' (gives {keys[key]}) is missing")
    if kwargs["num_experts_per_tok"] > kwargs[fields.count]:
        raise ValueError(f"{f.path}: metadata '{arch}.expert_used_count' = {kwargs['num_experts_per_tok']} is more "
                         f"than '{arch}.expert_count' = {kwargs[fields.count]}")
    experts = ("blk.0.ffn_gate.0.weight", 0) if per_expert_layout(f) else ("blk.0.ffn_gate_exps.weight", 1)
    inferred = {fields.size: experts}
    if shared:
        inferred[SHARED_SIZE[1]] = ("blk.0.ffn_gate_shexp.weight", 0)
    for field, (tensor, dim) in inferred.items():
        if field in kwargs:
            continue
        t = f.tensors.get(tensor)
        if t is None or len(t.shape) != dim + 2:
            key = next(k for k, v in keys.items() if v == field)
            raise ValueError(f"{f.path}: no metadata '{arch}.{key}' and no {tensor} to infer {field} from")
        kwargs[field] = t.shape[dim]


_SHARED_GATE = ".ffn_gate_inp_shexp.weight"


def checked_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape as expected_shapes gives it: the shared-expert gate's [1, H] as [H]."""
    return shape[1:] if name.endswith(_SHARED_GATE) and len(shape) == 2 and shape[0] == 1 else shape


def shared_gate_tensor(t: GGUFTensor) -> GGUFTensor:
    """ffn_gate_inp_shexp [H] as the [1, H] weight of the nn.Linear(H, 1) it is; any other tensor as it is."""
    if t.name.endswith(_SHARED_GATE) and len(t.shape) == 1:
        return GGUFTensor(t.name, t.ggml_type, (1, t.shape[0]), t.raw.reshape(1, -1), t.source)
    return t


@dataclass(frozen=True)
class ExpertStack:
    """One projection of a block's experts: E matrices [rows, cols] of one GGUF type, each a view
    of the file's blocks (a slice of a 3-D tensor's rows, or one expert's own tensor). They are
    converted one expert at a time, so a block never costs more than its result and one expert."""

    name: str  # the 3-D tensor's name, or the per-expert tensors' pattern
    ggml_type: int
    shape: tuple[int, int, int]  # (E, rows, cols)
    experts: tuple[GGUFTensor, ...]

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


def _native(stacks: list[ExpertStack]) -> GGUFSwitchLinear:
    """One GGUFSwitchLinear of the stacks' rows (gate and up joined, gate first)."""
    e, _, cols = stacks[0].shape
    layer = GGUFSwitchLinear(e, cols, sum(st.shape[1] for st in stacks), stacks[0].ggml_type)
    off = 0
    for st in stacks:
        rows = st.shape[1]
        for j, t in enumerate(st.experts):
            layer.blocks[j, off:off + rows].copy_(to_blocks(t))
        off += rows
    return layer


def _affine(stacks: list[ExpertStack], dtype: torch.dtype) -> QuantSwitchLinear:
    """One affine QuantSwitchLinear of the stacks' rows (gate and up joined, gate first)."""
    e, _, cols = stacks[0].shape
    layer, off = None, 0
    for st in stacks:
        rows = st.shape[1]
        for j, t in enumerate(st.experts):
            wq, scales, biases, bits, group_size = to_affine(t, dtype)
            if layer is None:
                layer = QuantSwitchLinear(e, cols, sum(s.shape[1] for s in stacks), bits=bits, group_size=group_size,
                                          dtype=dtype)
            for buffer, value in ((layer.qweight, wq), (layer.scales, scales), (layer.biases, biases)):
                buffer[j, off:off + rows].copy_(value)
        off += rows
    return layer


def _quantized_layer(stacks: list[ExpertStack], dtype: torch.dtype) -> nn.Module:
    return _native(stacks) if stacks[0].ggml_type in NATIVE_TYPES else _affine(stacks, dtype)


def _kept_quantized(st: ExpertStack) -> bool:
    return st.ggml_type in NATIVE_TYPES or st.ggml_type in AFFINE_TYPES


def experts_from_gguf(module: nn.Module, parts: dict[str, ExpertStack], dtype: torch.dtype,
                      where: str) -> QuantFusedExperts | None:
    """The routed experts of one block from its three stacks (block_experts): a QuantFusedExperts,
    or None where they load float into `module` (fill_float_experts). `module` is transformers'
    experts module, whose layout must be gate rows then up rows, not transposed."""
    layout = layout_of(module)
    if layout is None or layout.transposed or layout.interleaved or layout.has_bias:
        got = "not a fused experts module" if layout is None else str(layout)
        raise ValueError(f"{where}: the model's experts module {type(module).__name__} does not hold GGUF's experts "
                         f"(gate_up_proj [E, 2I, H] with the gate rows first, down_proj [E, H, I]; it is {got})")
    gate, up, down = (parts[p] for p in PARTS)
    e, hidden, inter = expert_shapes(module, layout)
    for st, shape in ((gate, (e, inter, hidden)), (up, (e, inter, hidden)), (down, (e, hidden, inter))):
        if tuple(st.shape) != shape:
            raise ValueError(f"{where}: tensor {st.name!r} holds experts {list(st.shape)}, the model's experts expect "
                             f"{list(shape)} (config disagrees with the file)")
    if gate.ggml_type == up.ggml_type and all(_kept_quantized(st) for st in (gate, up, down)):
        return quant_experts_of(module, _quantized_layer([gate, up], dtype), _quantized_layer([down], dtype))
    if not all(st.ggml_type in FLOAT_TYPES for st in (gate, up, down)):
        warnings.warn(
            f"{where}: the experts are stored as gate {gate.type_name}, up {up.type_name}, down {down.type_name}; "
            "torch_qmm keeps experts quantized where gate and up share a type and every projection is of "
            f"{', '.join(type_name(t) for t in dict.fromkeys(AFFINE_TYPES + NATIVE_TYPES))}: this block's experts load float "
            "(decoded)",
            stacklevel=4,
        )
    return None


def fill_float_experts(targets: dict[str, torch.Tensor], parts: dict[str, ExpertStack]) -> None:
    """Writes the experts as gguf decodes them (float32, rounded once to the targets' dtype) into
    targets {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}, one expert at a time."""
    gate_up, down = targets[ExpertsLayout.gate_up], targets[ExpertsLayout.down]
    inter = parts["gate"].shape[1]
    with torch.no_grad():
        for j in range(parts["gate"].shape[0]):
            gate_up[j, :inter].copy_(dequantize(parts["gate"].experts[j]))
            gate_up[j, inter:].copy_(dequantize(parts["up"].experts[j]))
            down[j].copy_(dequantize(parts["down"].experts[j]))


def block_experts(f, block: int) -> dict[str, ExpertStack]:
    """The three expert stacks of block `block` of the file: a 3-D tensor's rows, or one tensor per
    expert. ValueError naming what is missing or does not stack."""
    return {part: _stack(f, block, part) for part in PARTS}


def _stack(f, block: int, part: str) -> ExpertStack:
    name = f"blk.{block}.ffn_{part}_exps.weight"
    t = f.tensors.get(name)
    if t is not None:
        if len(t.shape) != 3:
            raise ValueError(f"{f.path}: tensor {name!r} must be 3-D [experts, rows, cols], got {list(t.shape)}")
        e, rows, cols = t.shape
        views = tuple(GGUFTensor(f"{name}[{j}]", t.ggml_type, (rows, cols), t.raw[j * rows:(j + 1) * rows], t.source)
                      for j in range(e))
        return ExpertStack(name, t.ggml_type, (e, rows, cols), views)
    prefix = f"blk.{block}.ffn_{part}."
    count = sum(1 for n in f.tensors if _PER_EXPERT.match(n) and n.startswith(prefix))
    ts = [f.tensors.get(f"{prefix}{j}.weight") for j in range(count)]
    if not count or None in ts:
        missing = f"{prefix}{ts.index(None)}.weight" if None in ts else f"{prefix}0.weight"
        raise ValueError(f"{f.path}: block {block} has routed experts but no {name} nor {missing} (one tensor per "
                         f"expert, {count} of which the file names)")
    first = ts[0]
    for t in ts[1:]:
        if t.ggml_type != first.ggml_type or t.shape != first.shape or len(t.shape) != 2:
            raise ValueError(f"{f.path}: the experts of block {block} differ: {t.name!r} is {t.type_name} "
                             f"{list(t.shape)}, {first.name!r} {first.type_name} {list(first.shape)} (one expert "
                             "tensor stacks experts of one type and shape)")
    return ExpertStack(f"{prefix}E.weight", first.ggml_type, (count, *first.shape), tuple(ts))


def float_experts_module(experts: QuantFusedExperts, parts: dict[str, ExpertStack], dtype: torch.dtype) -> nn.Module:
    """The transformers experts module `experts` computes with (its GateOfExperts' module), given
    back its float weights as gguf decodes `parts` (rounded once to dtype)."""
    module = experts.activation.experts
    e, inter, hidden = parts["gate"].shape
    shapes = {ExpertsLayout.gate_up: (e, 2 * inter, hidden), ExpertsLayout.down: (e, hidden, inter)}
    for leaf, shape in shapes.items():
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    fill_float_experts({leaf: module.get_parameter(leaf) for leaf in shapes}, parts)
    return module


def describe(parts: dict[str, ExpertStack]) -> str:
    """The report's format of a block's experts ("experts gate Q4_K, up Q4_K, down Q6_K")."""
    return "experts " + ", ".join(f"{p} {parts[p].type_name}" for p in PARTS)


