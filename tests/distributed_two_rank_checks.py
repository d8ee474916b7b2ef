"""What each rank of tests/test_distributed_two_ranks.py runs (two spawned gloo processes,
distributed_checks.worker): int8 activations through tensor-parallel experts, and checkpoints the
sharded loaders must refuse (non-finite expert scales, ranks given different checkpoints). Each
check returns facts the tests assert on."""

from __future__ import annotations

import copy
import os
import shutil

import torch
import torch.distributed as dist

from distributed_moe_checks import dequantized, quantized_moe, tiny_moe

SCRATCH = ""  # a folder all ranks share (set by the worker)


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] quantized to int8 per block of 32 along K and dequantized, float64 (the definition
    in docs/activation-quantization.md; tests/test_cpu_actq_gather.py's quantize_x)."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1.0)), 0.0).clamp(-127, 127)
    return (q.double() * d.double()).reshape(x.shape)


def check_int8_switch_linear(rank: int, world: int, mesh) -> dict:
    """A lone QuantSwitchLinear(activations="int8") colwise and rowwise: its output against float64
    of the dequantized experts times int8-quantized x, and against the same layer whole."""
    from torch import nn
    from torch.distributed.tensor import Replicate
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize
    from torch_qmm.nn_moe import QuantSwitchLinear

    g = torch.Generator().manual_seed(4)
    e, n, kdim, tokens, k = 3, 8 * world, 64 * world, 5, 2
    layer = QuantSwitchLinear.from_float(torch.randn(e, n, kdim, generator=g) / kdim**0.5,
                                         torch.randn(e, n, generator=g), group_size=32, activations="int8")
    w, b = dequantized(layer), layer.bias.double()
    x = torch.randn(tokens, 1, 1, kdim, generator=g)
    index = torch.randint(0, e, (tokens, k), generator=g)
    x_deq = quantize_x(x[:, 0, 0])  # int8 blocks of 32: whole blocks on every rank of the rowwise split
    y_ref = torch.einsum("ti,tkoi->tko", x_deq, w[index]).unsqueeze(-2) + b[index].unsqueeze(-2)
    y_mag = torch.einsum("ti,tkoi->tko", x_deq.abs(), w[index].abs()).unsqueeze(-2) + b[index].abs().unsqueeze(-2)
    with torch.no_grad():
        whole = layer(x, index)
        exact = copy.deepcopy(layer).requires_grad_(False)
        exact.activations = None
        exact = exact(x, index)
    out = {}
    for name, style in (("colwise", QuantColwiseParallel), ("rowwise", QuantRowwiseParallel)):
        tp = parallelize(nn.ModuleDict({"s": copy.deepcopy(layer)}), mesh, {"s": style(output_layouts=Replicate())})
        with torch.no_grad():
            y = tp["s"](x if name == "colwise" else x.chunk(world, -1)[rank], index)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        # float32 roundings of the magnitude: the int8 kernels' sums (K/32 + K/group_size + 8, the
        # bound of tests/test_cpu_actq_gather.py) and the split's (a bias; rowwise: the partial sums,
        # the all-reduce and the bias, 2S)
        roundings = 1 if name == "colwise" else 2 * world
        bound = (kdim // 32 + kdim // 32 + 8 + roundings) * 2.0**-24 * y_mag
        out[name] = {"ratio": ((y.double() - y_ref).abs() / bound).max().item(),
                     "whole_ratio": ((whole.double() - y_ref).abs() / bound).max().item(),
                     "equal_whole": bool(torch.equal(y, whole)),
                     "exact_ratio": ((exact.double() - y_ref).abs() / bound).max().item(),
                     "activations": tp["s"].activations}
    return out


def _edit(folder, key: str, edit) -> str:
    """Rewrites the safetensors file of `folder` holding `key` with edit(tensors) applied; its path."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = next(p for p in sorted(os.listdir(folder)) if p.endswith(".safetensors")
                and key in safe_open(os.path.join(folder, p), framework="pt").keys())
    path = os.path.join(folder, path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=metadata)
    return path


def _sharded_load(loader, family: str, folder) -> str | None:
    """loader's refusal of `folder` (a checkpoint of the tiny `family` model), or None if it loads."""
    import moe_helpers
    from torch_qmm.distributed import empty_parameters, tp_plan

    config = tiny_moe(family, 32 * _MESH.size(), _MESH.size()).config
    with empty_parameters():
        model = moe_helpers.FAMILIES[family][1](config).eval()
    try:
        loader(model, folder, _MESH, tp_plan(model))
    except ValueError as e:
        return str(e)
    return None


_MESH = None


def check_non_finite_expert_scales(rank: int, world: int, mesh) -> dict:
    """Quantized experts whose scales or biases hold NaN or Inf (every rank's slice of them): an
    MLX folder (gate_proj / up_proj joined per rank) and save_pretrained folders (gate_up stored
    packed: two runs of rows, or one where they interleave, gpt-oss). Each rank's refusal."""
    global _MESH
    _MESH = mesh
    from torch_qmm.distributed import load_mlx_sharded, load_pretrained_sharded
    from torch_qmm.interop import save_mlx

    cases = {  # case: (family, loader, tensor, index, value)
        "mlx up_proj scales": ("qwen3_moe", load_mlx_sharded, "model.layers.1.mlp.switch_mlp.up_proj.scales", 2,
                               float("nan")),
        "mlx gate_proj biases": ("qwen3_moe", load_mlx_sharded, "model.layers.0.mlp.switch_mlp.gate_proj.biases", 0,
                                 float("inf")),
        "pretrained gate_up scales": ("qwen3_moe", load_pretrained_sharded,
                                      "model.layers.1.mlp.experts.gate_up_proj.scales", 1, float("nan")),
        "pretrained interleaved gate_up biases": ("gpt_oss", load_pretrained_sharded,
                                                  "model.layers.0.mlp.experts.gate_up_proj.biases", 3, float("-inf")),
    }
    out = {}
    for case, (family, loader, key, index, value) in cases.items():
        folder = os.path.join(SCRATCH, case.replace(" ", "-"))
        if rank == 0:
            model = quantized_moe(family, world)
            save_mlx(model, folder) if loader is load_mlx_sharded else model.save_pretrained(folder)
            _edit(folder, key, lambda t: t[key][index].fill_(value))
        dist.barrier()
        out[case] = {"refused": _sharded_load(loader, family, folder), "key": key}
    return out


def check_other_checkpoints(rank: int, world: int, mesh) -> dict:
    """The last rank given a copy of the first rank's MLX folder that differs in config.json alone
    (one value), or in one tensor's dtype alone, or in one tensor's shape alone: every rank's
    refusal."""
    global _MESH
    _MESH = mesh
    from torch_qmm.distributed import load_mlx_sharded
    from torch_qmm.interop import save_mlx

    base = os.path.join(SCRATCH, "mlx-qwen3")
    edits = {
        "config": lambda folder: _write_json(os.path.join(folder, "config.json"), lambda c: c.update(
            rms_norm_eps=c["rms_norm_eps"] * 10)),
        "dtype": lambda folder: _edit(folder, "model.norm.weight", lambda t: t.update(
            {"model.norm.weight": t["model.norm.weight"].half()})),
        "shape": lambda folder: _edit(folder, "model.norm.weight", lambda t: t.update(
            {"model.norm.weight": torch.cat((t["model.norm.weight"], t["model.norm.weight"][:1]))})),
    }
    if rank == 0:
        save_mlx(quantized_moe("qwen3_moe", world), base)
        for name, edit in edits.items():
            shutil.copytree(base, f"{base}-{name}")
            edit(f"{base}-{name}")
    dist.barrier()
    out = {"folders": [base, *(f"{base}-{name}" for name in edits)]}
    for name in edits:
        folder = f"{base}-{name}" if rank == world - 1 else base
        out[name] = _sharded_load(load_mlx_sharded, "qwen3_moe", folder)
    return out


def _write_json(path, edit) -> None:
    import json

    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)


CHECKS = {
    "int8_switch_linear": check_int8_switch_linear,
    "non_finite_expert_scales": check_non_finite_expert_scales,
    "other_checkpoints": check_other_checkpoints,
}
