"""The mixture-of-experts parts of llama-family GGUF files (qwen2moe, qwen3moe, gpt-oss, and
Mixtral, which llama.cpp writes as architecture llama with experts): config fields, tensor names
and shapes, and the routed experts as a QuantFusedExperts.

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
  (norm_topk_prob, which the file does not carry); Mixtral's router always does;
* gpt-oss (convert_hf_to_gguf.py's GptOssModel): the router has a bias (blk.N.ffn_gate_inp.bias
  [E], transformers' mlp.router, a GptOssTopKRouter), and so does every expert projection
  (blk.N.ffn_{gate,up,down}_exps.bias [E, rows]); the converter split transformers' gate_up_proj
  [E, H, 2I] (gate and up columns alternating) into gate = its even columns and up = its odd ones,
  transposed to [E, I, H]; the experts are MXFP4 blocks (ggml type 39).

The experts keep the file's formats: K-quant, IQ4_XS and lattice i-quant blocks as GGUFSwitchLinear (exact in
any dtype), the 32-weight block types as affine QuantSwitchLinear (to_affine: exact in float32),
MXFP4 as mxfp4 QuantSwitchLinear (to_fp: the same bits), in one QuantFusedExperts whose gate_up
rows follow the transformers module's order (gate rows then up rows, or alternating). Gate and up share one module, so they must share a type;
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
from .experts import ExpertsLayout, described_layout, expert_shapes, layout_of, quant_experts_of
from .gguf import GGUFTensor, dequantize, to_affine, to_blocks, to_fp
from .gguf_types import AFFINE_TYPES, FLOAT_TYPES, FP_TYPES, NATIVE_TYPES, QUANTIZED_TYPES, type_name
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
GPT_OSS_EXPERTS = ExpertFields("num_local_experts", "intermediate_size", "expert_feed_forward_length")
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

_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(?:weight|bias)$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.\d+\.weight$")
PARTS = ("gate", "up", "down")


def expert_part(gguf_name: str) -> tuple[int, str] | None:
    """(block, "gate" / "up" / "down") of a routed-experts tensor name (stacked or one expert's,
    weights and gpt-oss's biases), else None."""
    m = _EXPERTS.match(gguf_name) or _PER_EXPERT.match(gguf_name)
    return (int(m.group(1)), m.group(2)) if m else None


def per_expert_layout(f) -> bool:
    """Whether the file keeps one tensor per expert (older Mixtral files)."""
    return "blk.0.ffn_gate.0.weight" in f.tensors


def experts_module_name(block: int) -> str:
    return f"model.layers.{block}.mlp.experts"


def expected_shapes(i: int, c: dict, fields: ExpertFields, shared: bool,
                    per_expert: bool = False, biased: bool = False) -> dict[str, tuple[int, ...]]:
    """The MoE tensors of block i and their shapes, from the config fields c (per_expert: one
    tensor per expert, per_expert_layout; biased: the router and the experts have biases, as
    gpt-oss's)."""
    hidden, e, inter = c["hidden_size"], c[fields.count], c[fields.size]
    out = {f"blk.{i}.ffn_gate_inp.weight": (e, hidden)} | ({f"blk.{i}.ffn_gate_inp.bias": (e,)} if biased else {})
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for part, shape in shapes.items():
        if per_expert:
            out.update({f"blk.{i}.ffn_{part}.{j}.weight": shape for j in range(e)})
        else:
            out[f"blk.{i}.ffn_{part}_exps.weight"] = (e, *shape)
            if biased:
                out[f"blk.{i}.ffn_{part}_exps.bias"] = (e, shape[0])
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
        return t.part(t.name, (1, t.shape[0]), t.data.reshape(1, -1))
    return t


@dataclass(frozen=True)
class ExpertStack:
    """One projection of a block's experts: E matrices [rows, cols] of one GGUF type, each a view
    of the file's blocks (a slice of a 3-D tensor's rows, or one expert's own tensor), and their
    biases [E, rows] where the file has them (gpt-oss). They are converted one expert at a time,
    so a block never costs more than its result and one expert."""

    name: str  # the 3-D tensor's name, or the per-expert tensors' pattern
    ggml_type: int
    shape: tuple[int, int, int]  # (E, rows, cols)
    experts: tuple[GGUFTensor, ...]
    bias: GGUFTensor | None = None

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


def gate_up_rows(inter: int, interleaved: bool) -> dict[str, slice]:
    """Where the gate and up rows of one expert go among gate_up's 2 * inter rows: the gate rows
    then the up rows, or alternating (gate row i at 2i, up row i at 2i + 1)."""
    if interleaved:
        return {"gate": slice(0, 2 * inter, 2), "up": slice(1, 2 * inter, 2)}
    return {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}


# One layer's stacks with the rows each fills (gate_up: gate and up; down: down alone).
Placed = list[tuple[ExpertStack, slice]]


def _native(placed: Placed, rows: int, bias: bool, dtype: torch.dtype) -> GGUFSwitchLinear:
    """One GGUFSwitchLinear of `rows` rows filled from the stacks' blocks."""
    e, _, cols = placed[0][0].shape
    layer = GGUFSwitchLinear(e, cols, rows, placed[0][0].ggml_type, bias=bias, dtype=dtype)
    for st, where in placed:
        for j, t in enumerate(st.experts):
            layer.blocks[j, where].copy_(to_blocks(t))
    return layer


def _affine(placed: Placed, rows: int, bias: bool, dtype: torch.dtype) -> QuantSwitchLinear:
    """One affine QuantSwitchLinear of `rows` rows filled from the stacks (to_affine)."""
    e, _, cols = placed[0][0].shape
    layer = None
    for st, where in placed:
        for j, t in enumerate(st.experts):
            wq, scales, biases, bits, group_size = to_affine(t, dtype)
            if layer is None:
                layer = QuantSwitchLinear(e, cols, rows, bias=bias, bits=bits, group_size=group_size, dtype=dtype)
            for buffer, value in ((layer.qweight, wq), (layer.scales, scales), (layer.biases, biases)):
                buffer[j, where].copy_(value)
    return layer


def _fp(placed: Placed, rows: int, bias: bool, dtype: torch.dtype) -> QuantSwitchLinear:
    """One QuantSwitchLinear of an fp mode (FP_TYPES: MXFP4 as mxfp4) of `rows` rows (to_fp)."""
    e, _, cols = placed[0][0].shape
    layer = QuantSwitchLinear(e, cols, rows, bias=bias, mode=FP_TYPES[placed[0][0].ggml_type], dtype=dtype)
    for st, where in placed:
        for j, t in enumerate(st.experts):
            wq, scales, _ = to_fp(t)
            layer.qweight[j, where].copy_(wq)
            layer.scales[j, where].copy_(scales)
    return layer


def _quantized_layer(placed: Placed, rows: int, dtype: torch.dtype) -> nn.Module:
    ggml_type, bias = placed[0][0].ggml_type, placed[0][0].bias is not None
    build = _native if ggml_type in NATIVE_TYPES else _fp if ggml_type in FP_TYPES else _affine
    layer = build(placed, rows, bias, dtype)
    if bias:
        _fill_biases(layer.bias, placed)
    return layer


def _fill_biases(target: torch.Tensor, placed: Placed) -> None:
    """target [E, rows]: each stack's biases (as gguf decodes them, rounded once to target's dtype)
    at its rows."""
    with torch.no_grad():
        for st, where in placed:
            target[:, where].copy_(dequantize(st.bias))


def experts_from_gguf(module: nn.Module, parts: dict[str, ExpertStack], dtype: torch.dtype,
                      where: str) -> QuantFusedExperts | None:
    """The routed experts of one block from its three stacks (block_experts): a QuantFusedExperts,
    or None where they load float into `module` (fill_float_experts). `module` is transformers'
    experts module; its layout (ExpertsLayout: rows alternating or not, biases) places the rows."""
    layout = layout_of(module)
    if layout is None:
        raise ValueError(f"{where}: the model's experts module {type(module).__name__} is not a fused experts module "
                         "(3-D gate_up_proj and down_proj), which GGUF's experts load into")
    gate, up, down = (parts[p] for p in PARTS)
    e, hidden, inter = expert_shapes(module, layout)
    for st, shape in ((gate, (e, inter, hidden)), (up, (e, inter, hidden)), (down, (e, hidden, inter))):
        if tuple(st.shape) != shape:
            raise ValueError(f"{where}: tensor {st.name!r} holds experts {list(st.shape)}, the model's experts expect "
                             f"{list(shape)} (config disagrees with the file)")
        if (st.bias is not None) != layout.has_bias:
            has = "has biases" if layout.has_bias else "has no biases"
            raise ValueError(f"{where}: tensor {st.name!r} {'has no' if st.bias is None else 'has a'} bias tensor, "
                             f"the model's experts module {has}")
    if gate.ggml_type == up.ggml_type and all(st.ggml_type in QUANTIZED_TYPES for st in (gate, up, down)):
        return quant_experts_of(module,
                                _quantized_layer(projection_stacks(parts, "gate_up_proj", layout.interleaved), 2 * inter, dtype),
                                _quantized_layer(projection_stacks(parts, "down_proj", layout.interleaved), hidden, dtype))
    if not all(st.ggml_type in FLOAT_TYPES for st in (gate, up, down)):
        warnings.warn(
            f"{where}: the experts are stored as gate {gate.type_name}, up {up.type_name}, down {down.type_name}; "
            "torch_qmm keeps experts quantized where gate and up share a type and every projection is of "
            f"{', '.join(type_name(t) for t in QUANTIZED_TYPES)}: this block's experts load float (decoded)",
            stacklevel=4,
        )
    return None


def projection_stacks(parts: dict[str, ExpertStack], projection: str, interleaved: bool) -> Placed:
    """The stacks of one projection of a block's experts, "gate_up_proj" (gate and up, their rows
    as gate_up_rows places them) or "down_proj", with the rows each fills."""
    if projection == "down_proj":
        return [(parts["down"], slice(None))]
    rows = gate_up_rows(parts["gate"].shape[1], interleaved)
    return [(parts["gate"], rows["gate"]), (parts["up"], rows["up"])]


def fill_float(target: torch.Tensor, placed: Placed) -> None:
    """target [E, rows, cols]: each expert of the placed stacks as gguf decodes it (float32, rounded
    once to target's dtype) at its rows, one expert at a time."""
    with torch.no_grad():
        for st, where in placed:
            for j, t in enumerate(st.experts):
                target[j, where].copy_(dequantize(t))


def fill_float_experts(targets: dict[str, torch.Tensor], parts: dict[str, ExpertStack],
                       layout: ExpertsLayout = ExpertsLayout()) -> None:
    """Writes the experts as gguf decodes them (float32, rounded once to the targets' dtype) into
    the parameters of an experts module of `layout`, targets {"gate_up_proj": [E, 2I, H] (or [E,
    H, 2I] transposed), "down_proj": [E, H, I] (or [E, I, H]), and with biases "gate_up_proj_bias"
    [E, 2I], "down_proj_bias" [E, H]}, one expert at a time."""
    for projection, leaf in (("gate_up_proj", layout.gate_up), ("down_proj", layout.down)):
        target = targets[leaf].transpose(-1, -2) if layout.transposed else targets[leaf]
        placed = projection_stacks(parts, projection, layout.interleaved)
        fill_float(target, placed)
        if layout.has_bias:
            _fill_biases(targets[f"{leaf}_bias"], placed)


def block_experts(f, block: int) -> dict[str, ExpertStack]:
    """The three expert stacks of block `block` of the file: a 3-D tensor's rows, or one tensor per
    expert, with their biases where the file has them. ValueError naming what is missing or does
    not stack."""
    return {part: _stack(f, block, part) for part in PARTS}


def _stack(f, block: int, part: str) -> ExpertStack:
    name = f"blk.{block}.ffn_{part}_exps.weight"
    t = f.tensors.get(name)
    if t is not None:
        if len(t.shape) != 3:
            raise ValueError(f"{f.path}: tensor {name!r} must be 3-D [experts, rows, cols], got {list(t.shape)}")
        e, rows, cols = t.shape
        views = tuple(t.part(f"{name}[{j}]", (rows, cols), t.data[j * rows:(j + 1) * rows]) for j in range(e))
        bias = f.tensors.get(f"blk.{block}.ffn_{part}_exps.bias")
        if bias is not None and tuple(bias.shape) != (e, rows):
            raise ValueError(f"{f.path}: tensor {bias.name!r} must be [experts, rows] = {[e, rows]} for {name!r} "
                             f"{list(t.shape)}, got {list(bias.shape)}")
        return ExpertStack(name, t.ggml_type, (e, rows, cols), views, bias)
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
    layout = described_layout(module)
    e, inter, hidden = parts["gate"].shape
    shapes = {layout.gate_up: (e, 2 * inter, hidden), layout.down: (e, hidden, inter)}
    if layout.transposed:
        shapes = {leaf: (a, c, b) for leaf, (a, b, c) in shapes.items()}
    if layout.has_bias:
        shapes |= {f"{layout.gate_up}_bias": (e, 2 * inter), f"{layout.down}_bias": (e, hidden)}
    for leaf, shape in shapes.items():
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    fill_float_experts({leaf: module.get_parameter(leaf) for leaf in shapes}, parts, layout)
    return module


def describe(parts: dict[str, ExpertStack]) -> str:
    """The report's format of a block's experts ("experts gate Q4_K, up Q4_K, down Q6_K")."""
    return "experts " + ", ".join(f"{p} {parts[p].type_name}" for p in PARTS)


