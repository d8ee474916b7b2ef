"""`python -m torch_qmm demo`: quantize a small built-in transformer and report error, memory, speed."""

from __future__ import annotations

import argparse
import copy

import torch

from .convert import quantize_model
from .bench.model import ModelConfig, TinyTransformer
from .devices import best_device, median_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, mps, ... (default: the best present)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=1, help="rows M of the input (1 = decode)")


def run(args: argparse.Namespace) -> int:
    device = args.device or best_device()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = ModelConfig(dim=1024, hidden=2816, layers=4, heads=16, vocab=8192)
    model = TinyTransformer(config).to(device=device, dtype=dtype).eval()
    quantized = copy.deepcopy(model)
    summary = quantize_model(quantized, bits=args.bits, group_size=args.group_size)
    x = torch.randint(0, config.vocab, (1, args.tokens), device=device)  # token ids
    with torch.no_grad():
        y_ref = model(x).double()
        y = quantized(x).double()
        rel_err = ((y - y_ref).norm() / y_ref.norm()).item()
        t_float = median_ms(lambda: model(x), device)
        t_quant = median_ms(lambda: quantized(x), device)
    print(f"device {device}, dtype {args.dtype}, {args.bits}-bit, group size {args.group_size}, M={args.tokens}")
    print(f"  {summary}")
    print(f"  relative output error vs the {args.dtype} model: {rel_err:.4f}")
    print(f"  forward: {t_float:.2f} ms float, {t_quant:.2f} ms quantized ({t_float / t_quant:.2f}x)")
    return 0
