"""Tensor-parallel styles for torch_qmm's layers: QuantColwiseParallel and QuantRowwiseParallel,
PyTorch's ColwiseParallel / RowwiseParallel (torch.distributed.tensor.parallel) extended to
QuantLinear, QuantEmbedding and GGUFLinear. Float nn.Linear / nn.Embedding are partitioned by
PyTorch's own partition functions, so one plan can name both kinds of layer.

What each style does with a quantized layer (W [N, K] quantized along K; an embedding table
[num, dim] quantized along dim):

| layer | colwise | rowwise |
|---|---|---|
| QuantLinear | qweight, scales, biases, bias Shard(0) (N) | qweight, scales, biases Shard(1) (K, whole groups); bias Replicate, added once |
| QuantEmbedding | Shard(1) (dim, whole groups) | Shard(0) (num); ids outside a rank's rows give zeros, summed (Partial) |
| GGUFLinear | blocks, bias Shard(0) | blocks Shard(1) (whole super-blocks); bias Replicate |

Input and output layouts, their defaults and use_local_output mean what they mean for PyTorch's
styles (the same prepare-input / prepare-output steps, through staging.redistribute so that a
model on MPS runs its collectives on CPU). Each rank keeps only its slice of a layer's tensors:
the slice is cut locally (no scatter: gloo has no uint32 collectives, and every rank of a loaded
model holds the same full tensors or, with torch_qmm.distributed.load_mlx_sharded, only its own
slice).

QuantLinear's buffers become DTensors and its forward runs unchanged: op_sharding.py registers
qmm's sharding rules with DTensor. QuantEmbedding and GGUFLinear take sizes their ops read as
arguments, so their forward runs on the local slices (the module's class is swapped for a
subclass, as FSDP2's fully_shard does) and wraps the result as a DTensor.
"""

from __future__ import annotations

import types
import weakref
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from ..interop.gguf_types import block_info
from ..interop.modules import GGUFLinear, QuantEmbedding, TiedQuantLinear
from ..nn import QuantLinear
from . import op_sharding  # noqa: F401  (qmm's DTensor sharding rules)
from .staging import redistribute

# Module -> its path in the model, for messages (filled by `parallelize`).
_NAMES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def describe(module: nn.Module) -> str:
    name = _NAMES.get(module)
    return f"layer {name!r}" if name is not None else f"{type(module).__name__}({module.extra_repr()})"


def parallelize(model: nn.Module, mesh: DeviceMesh, plan) -> nn.Module:
    """torch.distributed.tensor.parallel.parallelize_module, with the layers' paths remembered so
    that a refused split names the layer."""
    for name, m in model.named_modules():
        _NAMES[m] = name
    return parallelize_module(model, mesh, plan)


def shard_locally(t: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """The DTensor of a full tensor `t` that every rank holds, each rank keeping a copy of its
    slice only (DTensor's chunking, uneven splits included); no communication."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    local = t
    for dim, (n, start) in enumerate(zip(shape, offset)):
        if n != t.shape[dim]:
            local = local.narrow(dim, start, n)
    local = local.clone() if local is not t else local.contiguous()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _set_tensor(module: nn.Module, name: str, t: DTensor) -> None:
    if name in module._parameters:
        old = module._parameters[name]
        module.register_parameter(name, nn.Parameter(t, requires_grad=old.requires_grad))
    else:
        module.register_buffer(name, t, persistent=name not in module._non_persistent_buffers_set)


def _shard(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    for name, placement in placements.items():
        t = getattr(module, name)
        if t is not None:
            _set_tensor(module, name, shard_locally(t, mesh, (placement,)))


def check_whole_groups(module: nn.Module, style: str, cols_name: str, cols: int, group_size: int,
                       world: int, unit: str = "group_size") -> None:
    """A split of the quantized axis must give every rank whole groups (and so whole packed words)."""
    if cols % (world * group_size) != 0:
        raise ValueError(
            f"{style}: {describe(module)} cannot be split along its quantized axis: {cols_name}={cols} into "
            f"world_size={world} shards of whole groups ({unit}={group_size}) needs {cols_name} to be a multiple "
            f"of {world * group_size}; a split inside a group would cut a group (and its packed uint32 words)"
        )


def _refuse(module: nn.Module, style: str) -> None:
    if isinstance(module, TiedQuantLinear):
        raise NotImplementedError(
            f"{style}: {describe(module)} is tied to a QuantEmbedding's table; shard the embedding (QuantRowwiseParallel "
            "for a vocabulary split) and untie the output layer, or leave both replicated"
        )
    raise NotImplementedError(
        f"{style} supports nn.Linear, nn.Embedding, QuantLinear, QuantEmbedding and GGUFLinear, got {describe(module)}"
    )


# ---- local forwards for layers whose ops take the local sizes ---------------------------------

def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _global_output(local: torch.Tensor, mesh: DeviceMesh, placement: Placement, last: int) -> DTensor:
    shape = list(local.shape)
    shape[-1] = last
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape), stride=stride)


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
        ids = _local(ids)
        qweight, scales, biases = (_local(t) for t in (self.qweight, self.scales, self.biases))
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
            mode=self.mode, compute_dtype=self.compute_dtype)
        rows = QuantEmbedding.forward(view, ids)
        if self.tp_split == 0:
            return _global_output(rows.masked_fill(outside.unsqueeze(-1), 0), mesh, Partial(), self.embedding_dim)
        return _global_output(rows, mesh, Shard(rows.dim() - 1), self.embedding_dim)


class ShardedGGUFLinear(GGUFLinear):
    """A GGUFLinear whose blocks are sharded by a style (module.tp_split: 0 rows N, 1 blocks of K)."""

    tp_split: int

    def forward(self, x) -> DTensor:
        mesh = self.blocks.device_mesh
        blocks = self.blocks.to_local()
        per_block, block_bytes = block_info(self.ggml_type)
        in_here = blocks.shape[1] // block_bytes * per_block
        x_local = x.to_local(grad_placements=(Partial(),) if self.tp_split == 0 else None)
        y = torch.ops.torch_qmm.gguf_qmm(x_local, blocks, self.ggml_type, blocks.shape[0], in_here)
        if self.tp_split == 0:
            if self.bias is not None:
                y = y + self.bias.to_local().to(y.dtype)
            return _global_output(y, mesh, Shard(y.dim() - 1), self.out_features)
        y = _global_output(y, mesh, Partial(), self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _swap_class(module: nn.Module, cls: type, split: int) -> None:
    module.__class__ = cls
    module.tp_split = split


# ---- the styles -----------------------------------------------------------------------------

def _prepare_input(input_layouts, desired_input_layouts, stage, mod, inputs, device_mesh):
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
    return redistribute(x, desired_input_layouts, stage)


def _prepare_output(output_layouts, use_local_output, stage, mod, outputs, device_mesh):
    outputs = redistribute(outputs, output_layouts, stage)
    return outputs.to_local() if use_local_output else outputs


class _QuantStyle:
    """What the two styles share: the layouts of PyTorch's style, `stage` (collectives through CPU:
    None decides by the tensors' device, see staging.py) and distribute_module with our steps."""

    name: str
    stage: bool | None

    def _distribute(self, module, mesh, partition_fn, desired_input_layouts):
        return distribute_module(
            module, mesh, partition_fn,
            partial(_prepare_input, self.input_layouts, desired_input_layouts, self.stage),
            partial(_prepare_output, self.output_layouts, self.use_local_output, self.stage),
        )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output}, stage={self.stage})")


class QuantColwiseParallel(_QuantStyle, ColwiseParallel):
    """ColwiseParallel for torch_qmm's layers too (see the module's table). Keyword arguments:
    PyTorch's (input_layouts, output_layouts, use_local_output) and `stage`."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 stage: bool | None = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.stage = stage

    def _partition(self, name, module, mesh):
        if name:  # distribute_module visits every submodule; the layer is the root
            return
        world = mesh.size()
        if isinstance(module, QuantLinear):
            _shard(module, mesh, dict.fromkeys(("qweight", "scales", "biases", "bias"), Shard(0)))
        elif isinstance(module, QuantEmbedding):
            check_whole_groups(module, type(self).__name__, "embedding_dim", module.embedding_dim,
                               module.group_size, world)
            _shard(module, mesh, dict.fromkeys(("qweight", "scales", "biases"), Shard(1)))
            _swap_class(module, ShardedQuantEmbedding, 1)
        elif isinstance(module, GGUFLinear):
            _shard(module, mesh, dict.fromkeys(("blocks", "bias"), Shard(0)))
            _swap_class(module, ShardedGGUFLinear, 0)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, (QuantLinear, QuantEmbedding, GGUFLinear)):
            partition = self._partition
        elif isinstance(module, nn.Linear):
            partition = self._partition_linear_fn
        elif isinstance(module, nn.Embedding):
            partition = self._partition_embedding_fn
        else:
            _refuse(module, type(self).__name__)
        return self._distribute(module, device_mesh, partition, self.desired_input_layouts)


class QuantRowwiseParallel(_QuantStyle, RowwiseParallel):
    """RowwiseParallel for torch_qmm's layers too (see the module's table). Keyword arguments:
    PyTorch's (input_layouts, output_layouts, use_local_output) and `stage`."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 stage: bool | None = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.stage = stage

    def _partition(self, name, module, mesh):
        if name:
            return
        world, style = mesh.size(), type(self).__name__
        if isinstance(module, QuantLinear):
            check_whole_groups(module, style, "in_features", module.in_features, module.group_size, world)
            _shard(module, mesh, {"qweight": Shard(1), "scales": Shard(1), "biases": Shard(1), "bias": Replicate()})
        elif isinstance(module, QuantEmbedding):
            _shard(module, mesh, dict.fromkeys(("qweight", "scales", "biases"), Shard(0)))
            _swap_class(module, ShardedQuantEmbedding, 0)
        elif isinstance(module, GGUFLinear):
            per_block, _ = block_info(module.ggml_type)
            check_whole_groups(module, style, "in_features", module.in_features, per_block, world,
                               unit="weights per GGUF super-block")
            _shard(module, mesh, {"blocks": Shard(1), "bias": Replicate()})
            _swap_class(module, ShardedGGUFLinear, 1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, (QuantLinear, GGUFLinear)):
            partition, desired = self._partition, (Shard(-1),)
        elif isinstance(module, QuantEmbedding):
            partition, desired = self._partition, (Replicate(),)
        elif isinstance(module, nn.Linear):
            partition, desired = self._partition_linear_fn, (Shard(-1),)
        elif isinstance(module, nn.Embedding):
            partition, desired = self._partition_embedding_fn, (Replicate(),)
        else:
            _refuse(module, type(self).__name__)
        self.desired_input_layouts = desired
        return self._distribute(module, device_mesh, partition, desired)
