"""Tensor parallelism of quantized mixture-of-experts blocks: QuantExpertsParallel for a
QuantFusedExperts (the experts of a transformers MoE block), and the sharded QuantSwitchLinear
that QuantColwiseParallel / QuantRowwiseParallel make of a lone SwitchLinear.

Every rank holds every expert, a slice of each (the design of torchtitan's TensorParallel for
grouped experts and of transformers' "moe_tp_experts"; expert parallelism, experts split over
ranks with tokens routed to them, is not provided):

| tensor [E, rows, cols] | placement | what a rank holds |
|---|---|---|
| gate_up_proj qweight, scales, biases; bias [E, 2I] | packed rows | its I/S gate rows and the I/S up rows of the same intermediate features, in the layer's row order |
| down_proj qweight, scales, biases | Shard(2) | the same I/S features as columns: whole groups of K (refused otherwise) |
| down_proj bias [E, H] | Replicate | whole; added by the first rank only |

Non-interleaved gate_up (all gate rows, then all up rows) is DTensor's _StridedShard(1,
split_factor=2), interleaved rows (gpt-oss) a plain Shard(1). A rank then runs the whole block on
its slices (routing, the gate activation, the routing-weighted sum: all local) and one all-reduce
of the block's output [T, H] sums the ranks' parts. hidden_states and top_k_weights come in
replicated; their gradients (each rank's is a part) are all-reduced in the backward.
"""

from __future__ import annotations

import types
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..nn_moe import QuantFusedExperts, QuantSwitchLinear, join_gate_up, split_gate_up
from .partition import check_whole_groups, describe, global_output, local, rows_of_rank, set_tensor, shard, swap_class
from .staging import redistribute

QUANTIZED = ("qweight", "scales", "biases")


class ShardedQuantSwitchLinear(QuantSwitchLinear):
    """A QuantSwitchLinear whose tensors a style sharded (tp_split: 1 rows N, 2 columns K in
    whole groups). Given a DTensor (a style's input), it returns a DTensor: Shard(-1) for split
    rows, Partial for split columns. Given a plain tensor, it is taken as this rank's part (inside
    a sharded experts block) and the rank's part of the output comes back plain."""

    tp_split: int

    def forward(self, x, indices, sorted_indices: bool = False):
        mesh = self.qweight.device_mesh
        standalone = isinstance(x, DTensor)
        if standalone:
            x = x.to_local(grad_placements=(Partial(),) if self.tp_split == 1 else None)
        first = mesh.get_local_rank() == 0
        view = types.SimpleNamespace(
            qweight=local(self.qweight), scales=local(self.scales), biases=local(self.biases),
            bias=local(self.bias) if self.tp_split == 1 or first else None,  # a partial sum takes the bias once
            group_size=self.group_size, bits=self.bits, mode=self.mode, activations=self.activations)
        y = QuantSwitchLinear.forward(view, x, local(indices), sorted_indices)
        if not standalone:
            return y
        return global_output(y, mesh, Shard(y.dim() - 1) if self.tp_split == 1 else Partial(), self.out_features)


def switch_linear_placements(split: int) -> dict[str, Placement]:
    """QuantSwitchLinear's tensors split along rows (1) or whole groups of columns (2)."""
    placements = dict.fromkeys(QUANTIZED, Shard(split))
    placements["bias"] = Shard(1) if split == 1 else Replicate()
    return placements


def packed_placement(interleaved: bool) -> Placement:
    return Shard(1) if interleaved else _StridedShard(1, split_factor=2)


def packed_local(t: torch.Tensor, interleaved: bool, rank: int, world: int) -> torch.Tensor:
    """Rank's part of a gate_up tensor [E, 2I, ...]: its share of the gate rows and of the up rows
    (the same intermediate features), in the tensor's own row order."""
    gate, up = split_gate_up(t, interleaved)
    start, n = rows_of_rank(gate.shape[1], rank, world)
    return join_gate_up(gate.narrow(1, start, n), up.narrow(1, start, n), interleaved).contiguous()


def _replicated_input(t, mesh: DeviceMesh, stage: bool | None):
    """Identity forward; the backward sums the ranks' gradients (each rank's is a part)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    if isinstance(t, DTensor):
        t = t.redistribute(placements=(Replicate(),)).to_local()
    d = redistribute(DTensor.from_local(t, mesh, (Replicate(),), run_check=False), (Replicate(),), stage)
    return d.to_local(grad_placements=(Partial(),))


def _experts_input(mesh, stage, module, args, kwargs):
    args = list(args)
    for pos, name in ((0, "hidden_states"), (2, "top_k_weights")):
        if pos < len(args):
            args[pos] = _replicated_input(args[pos], mesh, stage)
        elif name in kwargs:
            kwargs[name] = _replicated_input(kwargs[name], mesh, stage)
    return tuple(args), kwargs


def _experts_output(mesh, stage, module, args, output):
    return redistribute(DTensor.from_local(output, mesh, (Partial(),), run_check=False), (Replicate(),),
                        stage).to_local()


class QuantExpertsParallel(ParallelStyle):
    """Tensor parallelism of a QuantFusedExperts (the module's table): each rank computes its part
    of every expert, one all-reduce sums the block's output. stage: collectives through CPU (None
    decides by the tensors' device, see staging.py)."""

    def __init__(self, *, stage: bool | None = None):
        super().__init__()
        self.stage = stage

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        if not isinstance(module, QuantFusedExperts):
            raise NotImplementedError(f"{style} shards a QuantFusedExperts (quantize the experts with "
                                      f"torch_qmm.quantize_model), got {describe(module)}")
        gguf = [f"{n} ({type(m).__name__})" for n, m in (("gate_up_proj", module.gate_up_proj),
                                                          ("down_proj", module.down_proj))
                if not isinstance(m, QuantSwitchLinear)]
        if gguf:
            raise NotImplementedError(f"{style} shards experts of MLX's formats (QuantSwitchLinear); {describe(module)} "
                                      f"holds {', '.join(gguf)}: GGUF blocks are not split across ranks. Leave the "
                                      "experts replicated (drop them from the plan), or convert the GGUF file "
                                      "(`python -m torch_qmm convert FILE.gguf OUT --format mlx`: Q4_K / Q5_K / IQ4_XS and the "
                                      "32-weight types exactly, experts with a Q2_K / Q3_K / Q6_K / lattice i-quant projection only with "
                                      "--requantize rest) and load that folder with load_mlx_sharded")
        world, rank = device_mesh.size(), device_mesh.get_local_rank()
        gate_up, down = module.gate_up_proj, module.down_proj
        check_whole_groups(down, style, "in_features", down.in_features, down.group_size, world)
        placement = packed_placement(module.interleaved)
        for name in QUANTIZED + ("bias",):
            t = getattr(gate_up, name)
            if t is not None:
                part = packed_local(t, module.interleaved, rank, world)
                set_tensor(gate_up, name, DTensor.from_local(part, device_mesh, (placement,), run_check=False,
                                                             shape=t.shape, stride=t.stride()))
        swap_class(gate_up, ShardedQuantSwitchLinear, 1)
        shard(down, device_mesh, switch_linear_placements(2))
        swap_class(down, ShardedQuantSwitchLinear, 2)
        module.register_forward_pre_hook(partial(_experts_input, device_mesh, self.stage), with_kwargs=True)
        module.register_forward_hook(partial(_experts_output, device_mesh, self.stage))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage={self.stage})"
