"""A tensor-parallel plan for a transformers model from its own: transformers names each layer's
split as a string ("colwise", "rowwise", ...); this maps them to our styles. A MoE block's experts
("moe_tp_experts", with "packed_colwise" / "rowwise" for their two projections) become one
QuantExpertsParallel, which splits both projections itself; experts the model's plan does not
name (gpt-oss's) are added."""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from ..interop.experts import is_fused_experts
from ..interop.modules import TiedQuantLinear
from ..nn_moe import QuantFusedExperts
from .experts import QuantExpertsParallel
from .partition import matches
from .styles import QuantColwiseParallel, QuantRowwiseParallel, ReplicatedGradAllReduce

EXPERTS = "moe_tp_experts"


def _style(kind: str, where: str, stage: bool | None) -> ParallelStyle:
    if kind == "colwise":
        return QuantColwiseParallel(stage=stage)
    if kind == "rowwise":
        return QuantRowwiseParallel(stage=stage)
    if kind == "embedding_rowwise":  # a vocabulary split: the ids come replicated
        return QuantRowwiseParallel(input_layouts=Replicate(), stage=stage)
    if kind == "colwise_gather_output":
        return QuantColwiseParallel(output_layouts=Replicate(), stage=stage)
    if kind == "rowwise_split_input":  # the input comes replicated (after a colwise_gather_output)
        return QuantRowwiseParallel(input_layouts=Replicate(), stage=stage)
    if kind == "replicated_with_grad_allreduce":
        return ReplicatedGradAllReduce(stage=stage)
    if kind == EXPERTS:
        return QuantExpertsParallel(stage=stage)
    raise ValueError(f"tp plan entry {where!r}: {kind!r} has no torch_qmm style (known: 'colwise', 'rowwise', "
                     f"'colwise_gather_output', 'rowwise_split_input', 'embedding_rowwise', "
                     f"'replicated_with_grad_allreduce', {EXPERTS!r})")


def _pattern(path: str) -> str:
    """A module path with its layer numbers as wildcards (the form of transformers' plans)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)


def tp_plan(model: nn.Module, stage: bool | None = None) -> dict[str, ParallelStyle]:
    """{module path pattern: style} for parallelize_module, from the transformers model's own plan
    (`model._tp_plan`: transformers gathers the base model's `config.base_model_tp_plan`, prefixed
    with the base model's name, and the head's entry there). Entries that name no module of
    `model` (a dense MLP's in a model whose blocks are all MoE) are left out, and so are an output
    layer tied to a QuantEmbedding's table (TiedQuantLinear: load_gguf_llama, load_mlx of a tied
    model) and that embedding: one table cannot be split by vocabulary rows for the embedding and
    as the head's split, so both stay replicated (load_mlx_sharded unties them instead)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    for name, m in model.named_modules():
        if isinstance(m, QuantFusedExperts) or is_fused_experts(m):  # float ones: a loader may quantize them first
            plan.setdefault(_pattern(name), EXPERTS)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (model._tp_plan, from "
                         "config.base_model_tp_plan) to build one from")
    experts = [k for k, v in plan.items() if v == EXPERTS]
    names = [n for n, _ in model.named_modules()]
    tied = [n for pair in tied_tables(model).items() for n in pair]
    return {k: _style(v, k, stage) for k, v in plan.items()
            if not any(k.startswith(e + ".") for e in experts)  # the experts' own layers: QuantExpertsParallel's
            and any(matches(k, n) for n in names) and not any(matches(k, n) for n in tied)}


def tied_tables(model: nn.Module) -> dict[str, str]:
    """{output layer: its embedding} of the output layers tied to a QuantEmbedding's table."""
    path = {id(m): n for n, m in model.named_modules()}
    return {n: path[id(m.embedding)] for n, m in model.named_modules() if isinstance(m, TiedQuantLinear)}
