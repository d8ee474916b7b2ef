"""`python -m torch_qmm demo`: quantize a small built-in transformer and report error, memory, speed."""

from __future__ import annotations

import argparse
import copy

import torch

from .convert import quantize_model
from .formats import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from .bench.model import ModelConfig, TinyTransformer
from .devices import best_device, busy_cpu_warning, check_usable, load_average, median_ms


DESCRIPTION = """\
Quantize a small built-in Llama-style transformer (random weights: dim 1024, 4 layers, vocabulary
8192; nothing is downloaded) with quantize_model and report:
  * memory of the linear layers before and after;
  * the relative output error ||y_q - y|| / ||y|| of the logits y_q of the quantized model
    against the logits y of the same model unquantized, in the same --dtype, for one random
    token sequence (norms computed in float64);
  * the median forward time of both models."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, mps, ... (default: the best present)")
    parser.add_argument("--bits", type=int, choices=SUPPORTED_BITS, default=4,
                        help="bits per quantized weight (default: %(default)s)")
    parser.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=64,
                        help="weights per scale/bias (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="dtype of the model and of the quantized layers' compute (default: %(default)s)")
    parser.add_argument("--tokens", type=_positive, default=1,
                        help="tokens per forward, the rows M of each matmul (default: %(default)s = decode)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    device = args.device or best_device()
    check_usable(device)
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
    print(f"  relative output error ||y_q - y|| / ||y|| of the logits against the unquantized {args.dtype} model: "
          f"{rel_err:.4f}")
    print(f"  forward: {t_float:.2f} ms float, {t_quant:.2f} ms quantized ({t_float / t_quant:.2f}x)")
    if warning := busy_cpu_warning(device, load_average()):
        print(warning)
    return 0
