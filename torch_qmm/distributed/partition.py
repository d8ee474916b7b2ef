"""What every tensor-parallel style of torch_qmm does to a layer's tensors: cut each rank's slice
locally and wrap it as a DTensor (shard_locally, packed_local), check that a split of a quantized
axis gives whole groups and a split of an attention's projections whole heads, and name the layer
in a refusal."""

from __future__ import annotations

import weakref
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import Placement

# Module -> its path in the model, for messages (filled by styles.parallelize).
NAMES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def describe(module: nn.Module) -> str:
    name = NAMES.get(module)
    return f"layer {name!r}" if name is not None else f"{type(module).__name__}({module.extra_repr()})"


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


def rows_of_rank(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank's equal share of n rows (n a multiple of world)."""
    return rank * (n // world), n // world


def set_tensor(module: nn.Module, name: str, t: torch.Tensor) -> None:
    """Replaces a parameter or buffer of `module`, keeping its kind (requires_grad, persistence)."""
    if name in module._parameters:
        old = module._parameters[name]
        module.register_parameter(name, nn.Parameter(t, requires_grad=old.requires_grad))
    else:
        module.register_buffer(name, t, persistent=name not in module._non_persistent_buffers_set)


def shard(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """Each named tensor of `module` (those it has) becomes a DTensor of this rank's slice."""
    for name, placement in placements.items():
        t = getattr(module, name)
        if t is not None:
            set_tensor(module, name, shard_locally(t, mesh, (placement,)))


def check_whole_groups(module: nn.Module, style: str, cols_name: str, cols: int, group_size: int,
                       world: int, unit: str = "group_size") -> None:
    """A split of the quantized axis must give every rank whole groups (and so whole packed words)."""
    if cols % (world * group_size) != 0:
        raise ValueError(
            f"{style}: {describe(module)} cannot be split along its quantized axis: {cols_name}={cols} into "
            f"world_size={world} shards of whole groups ({unit}={group_size}) needs {cols_name} to be a multiple "
            f"of {world * group_size}; a split inside a group would cut a group (and its packed uint32 words)"
        )


def matches(pattern: str, path: str) -> bool:
    """parallelize_module's matching of a plan key to a module path: atom by atom (a wildcard does
    not cross a dot)."""
    atoms, parts = pattern.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatch(p, a) for a, p in zip(atoms, parts))


def check_whole_heads(model: nn.Module, plan, world: int) -> None:
    """A colwise split whose output stays split (transformers' "colwise" q_proj / k_proj / v_proj)
    of a layer of an attention module (a module with `head_dim` and `config.num_attention_heads`,
    as transformers' are) leaves each rank the heads of its slice, and the attention runs on them:
    its config's num_attention_heads and num_key_value_heads must be multiples of the world size.
    `plan`: parallelize_module's ({module path pattern: style}; a single style checks nothing)."""
    if not isinstance(plan, dict):
        return
    seen = set()
    for name, module in model.named_modules():
        style = next((s for k, s in plan.items() if matches(k, name)), None)
        if not isinstance(style, ColwiseParallel) or all(p.is_replicate() for p in style.output_layouts):
            continue
        attention = model.get_submodule(name.rpartition(".")[0]) if name else None
        config = getattr(attention, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if attention in seen or not hasattr(attention, "head_dim") or not isinstance(heads, int):
            continue
        seen.add(attention)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if heads % world or kv % world:
            raise ValueError(
                f"{type(style).__name__}: {describe(attention)} cannot be split by heads ({describe(module)} is split "
                f"colwise): num_attention_heads={heads} and num_key_value_heads={kv} (its config) into "
                f"world_size={world} shards of whole heads need both to be multiples of {world}; each rank's "
                f"attention runs on the heads of its slices of q, k and v"
            )


def swap_class(module: nn.Module, cls: type, split: int) -> None:
    """Turns `module` into its sharded subclass (as FSDP2's fully_shard does); split: the dim cut."""
    module.__class__ = cls
    module.tp_split = split


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def global_output(local_y: torch.Tensor, mesh: DeviceMesh, placement: Placement, last: int) -> DTensor:
    """The DTensor of a layer output computed on local slices, whose full last dim is `last`."""
    shape = list(local_y.shape)
    shape[-1] = last
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_y, mesh, (placement,), run_check=False, shape=torch.Size(shape), stride=stride)
