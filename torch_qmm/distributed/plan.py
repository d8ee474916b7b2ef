"""A tensor-parallel plan for a transformers model from its own: transformers names each layer's
split as a string ("colwise", "rowwise", ...); this maps them to our styles."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from .styles import QuantColwiseParallel, QuantRowwiseParallel


def _style(kind: str, where: str, stage: bool | None) -> ParallelStyle:
    if kind == "colwise":
        return QuantColwiseParallel(stage=stage)
    if kind == "rowwise":
        return QuantRowwiseParallel(stage=stage)
    if kind == "embedding_rowwise":  # a vocabulary split: the ids come replicated
        return QuantRowwiseParallel(input_layouts=Replicate(), stage=stage)
    if kind == "colwise_gather_output":
        return QuantColwiseParallel(output_layouts=Replicate(), stage=stage)
    raise ValueError(f"tp plan entry {where!r}: {kind!r} has no torch_qmm style (known: 'colwise', 'rowwise', "
                     "'colwise_gather_output', 'embedding_rowwise')")


def tp_plan(model: nn.Module, stage: bool | None = None) -> dict[str, ParallelStyle]:
    """{module path pattern: style} for parallelize_module, from the transformers model's own plan
    (`model._tp_plan`: transformers gathers the base model's `config.base_model_tp_plan`, prefixed
    with the base model's name, and the head's entry there)."""
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (model._tp_plan, from "
                         "config.base_model_tp_plan) to build one from")
    return {k: _style(v, k, stage) for k, v in plan.items()}
