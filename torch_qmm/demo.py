"""`python -m torch_qmm demo`: quantize a small built-in model and report error, memory, speed."""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from .convert import quantize_model
from .devices import best_device, synchronize


class TinyMLPStack(nn.Module):
    """A stack of transformer-style MLP blocks (up, gate, down projections), no downloads."""

    def __init__(self, dim: int = 1024, hidden: int = 2816, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"up": nn.Linear(dim, hidden, bias=False), "gate": nn.Linear(dim, hidden, bias=False),
                 "down": nn.Linear(hidden, dim, bias=False)}
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["down"](torch.nn.functional.silu(b["gate"](x)) * b["up"](x))
        return x


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, mps, ... (default: the best present)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=1, help="rows M of the input (1 = decode)")


def _median_ms(fn, device: str, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    device = args.device or best_device()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = TinyMLPStack().to(device=device, dtype=dtype).eval()
    quantized = copy.deepcopy(model)
    summary = quantize_model(quantized, bits=args.bits, group_size=args.group_size)
    x = torch.randn(args.tokens, 1024, device=device, dtype=dtype)
    with torch.no_grad():
        y_ref = model(x).double()
        y = quantized(x).double()
        rel_err = ((y - y_ref).norm() / y_ref.norm()).item()
        t_float = _median_ms(lambda: model(x), device)
        t_quant = _median_ms(lambda: quantized(x), device)
    print(f"device {device}, dtype {args.dtype}, {args.bits}-bit, group size {args.group_size}, M={args.tokens}")
    print(f"  {summary}")
    print(f"  relative output error vs the {args.dtype} model: {rel_err:.4f}")
    print(f"  forward: {t_float:.2f} ms float, {t_quant:.2f} ms quantized ({t_float / t_quant:.2f}x)")
    return 0
