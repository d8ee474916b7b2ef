"""Tensor-parallel styles for torch_qmm's layers: QuantColwiseParallel and QuantRowwiseParallel,
PyTorch's ColwiseParallel / RowwiseParallel (torch.distributed.tensor.parallel) extended to
QuantLinear, QuantEmbedding, GGUFLinear and QuantSwitchLinear. Float nn.Linear / nn.Embedding are partitioned by
PyTorch's own partition functions, so one plan can name both kinds of layer.

What each style does with a quantized layer (W [N, K] quantized along K; an embedding table
[num, dim] quantized along dim):

| layer | colwise | rowwise |
|---|---|---|
| QuantLinear | qweight, scales, biases, bias Shard(0) (N) | qweight, scales, biases Shard(1) (K, whole groups); bias Replicate, added once |
| QuantEmbedding | Shard(1) (dim, whole groups) | Shard(0) (num); ids outside a rank's rows give zeros, summed (Partial) |
| GGUFLinear | blocks, bias Shard(0) | blocks Shard(1) (whole super-blocks); bias Replicate |
| QuantSwitchLinear [E, N, K] | qweight, scales, biases, bias Shard(1) (N) | qweight, scales, biases Shard(2) (K, whole groups); bias Replicate, added once |

The experts of a MoE block (QuantFusedExperts) take QuantExpertsParallel (experts.py), which
splits its two layers as the colwise / rowwise rows above and sums once at the block's output.

Input and output layouts, their defaults and use_local_output mean what they mean for PyTorch's
styles (the same prepare-input / prepare-output steps, through staging.redistribute so that a
model on MPS runs its collectives on CPU). Each rank keeps only its slice of a layer's tensors:
the slice is cut locally (no scatter: gloo has no uint32 collectives, and every rank of a loaded
model holds the same full tensors or, with torch_qmm.distributed.load_mlx_sharded, only its own
slice).

QuantLinear's buffers become DTensors and its forward runs unchanged: op_sharding.py registers
qmm's sharding rules with DTensor. QuantEmbedding, GGUFLinear and QuantSwitchLinear take sizes
their ops read as arguments, so their forward runs on the local slices (the module's class is
swapped for a subclass, as FSDP2's fully_shard does) and wraps the result as a DTensor. Both
styles read what to do with a layer from one table (Split, _colwise, _rowwise below) and share
one partition function and one _apply.
"""

from __future__ import annotations

import dataclasses
import types
from functools import partial

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from ..interop.gguf_types import block_info
from ..interop.modules import GGUFLinear, QuantEmbedding, TiedQuantLinear
from ..nn import QuantLinear
from ..ops import gguf_matmul
from ..nn_moe import QuantSwitchLinear
from . import op_sharding  # noqa: F401  (qmm's DTensor sharding rules)
from .experts import ShardedQuantSwitchLinear, switch_linear_placements
from .partition import (NAMES, check_whole_groups, check_whole_heads, describe, global_output, local, matches, shard,
                        shard_locally, swap_class)
from .staging import redistribute

__all__ = ["QuantColwiseParallel", "QuantRowwiseParallel", "ReplicatedGradAllReduce", "check_whole_groups",
           "parallelize", "shard_locally"]


def parallelize(model: nn.Module, mesh: DeviceMesh, plan) -> nn.Module:
    """torch.distributed.tensor.parallel.parallelize_module, with the layers' paths remembered so
    that a refused split names the layer, and the attention heads checked (check_whole_heads)
    before any layer is split."""
    for name, m in model.named_modules():
        NAMES[m] = name
    check_whole_heads(model, plan, mesh.size())
    _check_tied_tables(model, plan)
    return parallelize_module(model, mesh, plan)


def _check_tied_tables(model: nn.Module, plan) -> None:
    """An embedding whose table a TiedQuantLinear output layer shares cannot be split while that
    layer reads the whole table: refused before any layer is split (its forward would mix a
    sharded table with replicated tensors)."""
    from .plan import tied_tables

    if not isinstance(plan, dict):
        return
    for head, embedding in tied_tables(model).items():
        if any(matches(k, embedding) for k in plan) and not any(matches(k, head) for k in plan):
            raise NotImplementedError(
                f"the plan splits {embedding!r}, whose table the output layer {head!r} shares (TiedQuantLinear); "
                "leave both replicated (tp_plan does), or load with load_mlx_sharded, which unties them")


def _refuse(module: nn.Module, style: str) -> None:
    if isinstance(module, TiedQuantLinear):
        raise NotImplementedError(
            f"{style}: {describe(module)} is tied to a QuantEmbedding's table; shard the embedding (QuantRowwiseParallel "
            "for a vocabulary split) and untie the output layer, or leave both replicated"
        )
    raise NotImplementedError(
        f"{style} supports nn.Linear, nn.Embedding, QuantLinear, QuantEmbedding, GGUFLinear and QuantSwitchLinear "
        f"(a QuantFusedExperts takes QuantExpertsParallel), got {describe(module)}"
    )


# ---- local forwards for layers whose ops take the local sizes ---------------------------------

def _check_ids(module: QuantEmbedding, ids: torch.Tensor) -> None:
    # QuantEmbedding.forward's checks against the whole table, before a rank looks at its rows.
    if ids.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(f"QuantEmbedding: argument 'ids' must be an int64 or int32 tensor, got {ids.dtype}")
    flat = ids.reshape(-1)
    if flat.numel() != 0:
        lo, hi = torch.stack(torch.aminmax(flat)).tolist()
        if lo < 0 or hi >= module.num_embeddings:
            raise IndexError(f"QuantEmbedding: argument 'ids' must be in [0, {module.num_embeddings}), "
                             f"got {lo if lo < 0 else hi}")


class ShardedQuantEmbedding(QuantEmbedding):
    """A QuantEmbedding whose table is sharded by a style (module.tp_split: 0 rows, 1 columns)."""

    tp_split: int

    def forward(self, ids) -> DTensor:
        mesh = self.qweight.device_mesh
        ids = local(ids)
        qweight, scales, biases = (local(t) for t in (self.qweight, self.scales, self.biases))
        rows_here = qweight.shape[0]
        if self.tp_split == 0:
            _check_ids(self, ids)
            _, (start, _) = compute_local_shape_and_global_offset(self.qweight.shape, mesh, self.qweight.placements)
            local_ids = ids - start
            outside = (local_ids < 0) | (local_ids >= rows_here)
            ids = local_ids.masked_fill(outside, 0)
        view = types.SimpleNamespace(
            qweight=qweight, scales=scales, biases=biases, num_embeddings=rows_here,
            embedding_dim=qweight.shape[1] * 32 // self.bits, group_size=self.group_size, bits=self.bits,
            mode=self.mode, compute_dtype=self.compute_dtype, _embed_scales=self._embed_scales)
        rows = QuantEmbedding.forward(view, ids)
        if self.tp_split == 0:
            return global_output(rows.masked_fill(outside.unsqueeze(-1), 0), mesh, Partial(), self.embedding_dim)
        return global_output(rows, mesh, Shard(rows.dim() - 1), self.embedding_dim)


class ShardedGGUFLinear(GGUFLinear):
    """A GGUFLinear whose blocks are sharded by a style (module.tp_split: 0 rows N, 1 blocks of K)."""

    tp_split: int

    def forward(self, x) -> DTensor:
        mesh = self.blocks.device_mesh
        blocks = self.blocks.to_local()
        per_block, block_bytes = block_info(self.ggml_type)
        in_here = blocks.shape[1] // block_bytes * per_block
        x_local = x.to_local(grad_placements=(Partial(),) if self.tp_split == 0 else None)
        y = gguf_matmul(x_local, blocks, self.ggml_type, blocks.shape[0], in_here)
        if self.tp_split == 0:
            if self.bias is not None:
                y = y + self.bias.to_local().to(y.dtype)
            return global_output(y, mesh, Shard(y.dim() - 1), self.out_features)
        y = global_output(y, mesh, Partial(), self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


# ---- what each style does to each layer (the module's table) ---------------------------------

@dataclasses.dataclass(frozen=True)
class Split:
    """A layer's split under a style: the placement of each of its tensors, the subclass whose
    forward runs on the slices (None: the forward runs unchanged on DTensors), the quantized
    axis when it is cut (its size attribute and the group it must be cut in whole), and the
    input layout the layer computes from."""

    placements: dict[str, Placement]
    local_class: type | None = None
    tp_split: int = 0
    axis: str | None = None
    group: int = 0
    unit: str = "group_size"
    input_layout: Placement = Replicate()


_Q = ("qweight", "scales", "biases")


def _colwise(module: nn.Module) -> Split | None:
    if isinstance(module, QuantLinear):
        return Split(dict.fromkeys(_Q + ("bias",), Shard(0)))
    if isinstance(module, QuantEmbedding):
        return Split(dict.fromkeys(_Q, Shard(1)), ShardedQuantEmbedding, 1, "embedding_dim", module.group_size)
    if isinstance(module, GGUFLinear):
        return Split(dict.fromkeys(("blocks", "bias"), Shard(0)), ShardedGGUFLinear, 0)
    if isinstance(module, QuantSwitchLinear):
        return Split(switch_linear_placements(1), ShardedQuantSwitchLinear, 1)
    return None


def _rowwise(module: nn.Module) -> Split | None:
    if isinstance(module, QuantLinear):
        return Split({**dict.fromkeys(_Q, Shard(1)), "bias": Replicate()}, None, 1, "in_features", module.group_size,
                     input_layout=Shard(-1))
    if isinstance(module, QuantEmbedding):
        return Split(dict.fromkeys(_Q, Shard(0)), ShardedQuantEmbedding, 0)
    if isinstance(module, GGUFLinear):
        return Split({"blocks": Shard(1), "bias": Replicate()}, ShardedGGUFLinear, 1, "in_features",
                     block_info(module.ggml_type)[0], "weights per GGUF super-block", Shard(-1))
    if isinstance(module, QuantSwitchLinear):
        return Split(switch_linear_placements(2), ShardedQuantSwitchLinear, 2, "in_features", module.group_size,
                     input_layout=Shard(-1))
    return None


def _partition(split: Split, style: str, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if name:  # distribute_module visits every submodule; the layer is the root
        return
    if split.axis is not None:
        check_whole_groups(module, style, split.axis, getattr(module, split.axis), split.group, mesh.size(), split.unit)
    shard(module, mesh, split.placements)
    if split.local_class is not None:
        swap_class(module, split.local_class, split.tp_split)


# ---- the styles -----------------------------------------------------------------------------

def _prepare_input(input_layouts, desired_input_layouts, stage, mod, inputs, device_mesh):
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
    return (redistribute(x, desired_input_layouts, stage), *inputs[1:])


def _prepare_output(output_layouts, use_local_output, stage, mod, outputs, device_mesh):
    outputs = redistribute(outputs, output_layouts, stage)
    return outputs.to_local() if use_local_output else outputs


class _QuantStyle:
    """What the two styles share: the layouts of PyTorch's style, `stage` (collectives through CPU:
    None decides by the tensors' device, see staging.py), the choice of a layer's partition (ours
    from the table, PyTorch's for float layers) and distribute_module with our steps."""

    splits: "staticmethod"  # module -> Split | None
    float_inputs: tuple[Placement, Placement]  # nn.Linear's, nn.Embedding's desired input layout

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 stage: bool | None = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.stage = stage

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        split = type(self).splits(module)
        if split is not None:
            fn, desired = partial(_partition, split, type(self).__name__), split.input_layout
        elif isinstance(module, nn.Linear):
            fn, desired = self._partition_linear_fn, self.float_inputs[0]
        elif isinstance(module, nn.Embedding):
            fn, desired = self._partition_embedding_fn, self.float_inputs[1]
        else:
            _refuse(module, type(self).__name__)
        self.desired_input_layouts = (desired,)
        return distribute_module(
            module, device_mesh, fn,
            partial(_prepare_input, self.input_layouts, self.desired_input_layouts, self.stage),
            partial(_prepare_output, self.output_layouts, self.use_local_output, self.stage),
        )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output}, stage={self.stage})")


class QuantColwiseParallel(_QuantStyle, ColwiseParallel):
    """ColwiseParallel for torch_qmm's layers too (see the module's table). Keyword arguments:
    PyTorch's (input_layouts, output_layouts, use_local_output) and `stage`."""

    splits = staticmethod(_colwise)
    float_inputs = (Replicate(), Replicate())


class QuantRowwiseParallel(_QuantStyle, RowwiseParallel):
    """RowwiseParallel for torch_qmm's layers too (see the module's table). Keyword arguments:
    PyTorch's (input_layouts, output_layouts, use_local_output) and `stage`."""

    splits = staticmethod(_rowwise)
    float_inputs = (Shard(-1), Replicate())


def _sum_gradient(mesh: DeviceMesh, stage: bool | None, grad: torch.Tensor) -> torch.Tensor:
    summed = redistribute(DTensor.from_local(grad, mesh, (Partial(),), run_check=False), (Replicate(),), stage)
    out = summed.to_local()
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


class ReplicatedGradAllReduce(ParallelStyle):
    """A module kept whole on every rank that sees only its rank's part of the activations (a norm
    over the heads of a colwise projection, as Qwen3's q_norm): forward unchanged, its parameters'
    gradients summed over the ranks (transformers' "replicated_with_grad_allreduce")."""

    def __init__(self, *, stage: bool | None = None):
        super().__init__()
        self.stage = stage

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(partial(_sum_gradient, device_mesh, self.stage))
        return module
