"""A tensor-parallel plan for a transformers model from its own: transformers names each layer's
split in `config.base_model_tp_plan` (keys relative to the base model) and the model class's
`_tp_plan` (the head), as strings; this maps them to our styles."""

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
    if kind == "colwise_gather_output":
        return QuantColwiseParallel(output_layouts=Replicate(), stage=stage)
    raise ValueError(f"tp plan entry {where!r}: {kind!r} has no torch_qmm style (known: 'colwise', 'rowwise', "
                     "'colwise_gather_output')")


def tp_plan(model: nn.Module, head: bool = True, stage: bool | None = None) -> dict[str, ParallelStyle]:
    """{module path pattern: style} for parallelize_module, from the transformers model's plan.

    head: include the output head's entry (`_tp_plan`, e.g. lm_head gathered to every rank).
    """
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    if not base:
        raise ValueError(f"{type(model).__name__} has no config.base_model_tp_plan to build a tp plan from")
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    plan = {f"{prefix}{k}": _style(v, k, stage) for k, v in base.items()}
    if head:
        plan.update({k: _style(v, k, stage) for k, v in (getattr(model, "_tp_plan", None) or {}).items()})
    return plan
