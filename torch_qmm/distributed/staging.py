"""Collectives staged through CPU, for local tensors on a device the process group cannot read.

gloo (the backend of a CPU or two-Mac mesh) reads CPU tensors only, so a model computing on MPS
moves each tensor that crosses a collective to CPU, runs DTensor's redistribute there and moves
the result back. `redistribute` does this in both directions of autograd: its backward moves the
incoming gradient to CPU and redistributes it there to the layout the forward input had (Partial
read as Replicate, DTensor's own rule for gradients), so no collective ever sees a device tensor.
Not run on Apple hardware here (no Mac in CI); tests exercise the same path with CPU tensors by
forcing it (`stage=True`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

# Devices whose tensors gloo reads directly (gloo also serves CUDA tensors).
DIRECT_DEVICES = ("cpu", "cuda")


def needs_staging(t: torch.Tensor) -> bool:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.device.type not in DIRECT_DEVICES


def _to_cpu_dtensor(local: torch.Tensor, like: DTensor, placements: Sequence[Placement]) -> DTensor:
    return DTensor.from_local(local.cpu(), like.device_mesh, placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _grad_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


class _StagedRedistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.input_placements = t.placements
        ctx.mesh = t.device_mesh
        local = t.to_local()
        ctx.device = local.device
        out = _to_cpu_dtensor(local, t, t.placements).redistribute(placements=placements)
        return DTensor.from_local(out.to_local().to(local.device), t.device_mesh, out.placements,
                                  run_check=False, shape=out.shape, stride=out.stride())

    @staticmethod
    def backward(ctx, grad: DTensor):
        target = _grad_placements(ctx.input_placements)
        g = _to_cpu_dtensor(grad.to_local(), grad, grad.placements).redistribute(placements=target)
        return DTensor.from_local(g.to_local().to(ctx.device), ctx.mesh, g.placements, run_check=False,
                                  shape=g.shape, stride=g.stride()), None


def redistribute(t: DTensor, placements: Sequence[Placement], stage: bool | None = None) -> DTensor:
    """t.redistribute(placements), through CPU when `stage` (None: when t's local tensor is on a
    device outside DIRECT_DEVICES). Staged, it runs even when the placements already agree, so
    the backward's gradient is brought to the input's layout on CPU too."""
    placements = tuple(placements)
    if stage is None:
        stage = needs_staging(t)
    if stage:
        return _StagedRedistribute.apply(t, placements)
    if t.placements == placements:
        return t
    return t.redistribute(placements=placements, async_op=True)
