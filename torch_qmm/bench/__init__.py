"""`python -m torch_qmm bench`: affine_qmm against its peers, saved as JSON (+ a plot).

    python -m torch_qmm bench --quick                     # small subset, < 1 min
    python -m torch_qmm bench --shapes 14336x5120 --m 1,4,16,64,256 --bits 4,8 --dtype bfloat16
    python -m torch_qmm bench --model [PATH]               # small transformer (or a transformers folder), M=1 and M=128
    python -m torch_qmm bench --device metalsim [--full]   # simulated traffic of the Metal kernels

Kernel rows: kernels.py (Config -> Result, method); output: report.py; model: model.py;
metalsim traffic (bytes per buffer vs compulsory, no time): metalsim_traffic.py.
Peers in the same run: F.linear float32/float16/bfloat16, torch._weight_int8pack_mm,
PyTorch's int4 weight-only matmul where the device has it, mlx.core.quantized_matmul when
importable. Performance is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..devices import best_device
from . import metalsim_traffic
from .kernels import Config, run_config
from .model import format_model, run_model
from .report import (copy_bandwidth_gbps, default_result_path, format_table, last_level_cache_bytes, machine_info,
                     save_json, save_plot)

# The seed's production shapes, out x in (N x K).
SHAPES = ["4096x4096", "5120x5120", "14336x5120", "5120x14336", "27648x5120"]
MS = [1, 2, 4, 8, 16, 32, 128, 512]
BITS = [4, 8]
DTYPES = ["float32", "float16", "bfloat16"]
QUICK = {"shapes": ["4096x4096"], "m": [1, 16, 128], "bits": [4], "dtype": ["bfloat16"]}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _strs(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, mps, cuda, metalsim (default: the best present)")
    parser.add_argument("--quick", action="store_true", help="a small subset (one shape, M in 1/16/128, 4-bit)")
    parser.add_argument("--shapes", type=_strs, default=None, help=f"N x K list (default {','.join(SHAPES)})")
    parser.add_argument("--m", type=_ints, default=None, help=f"rows of x (default {','.join(map(str, MS))})")
    parser.add_argument("--bits", type=_ints, default=None, help="default 4,8")
    parser.add_argument("--dtype", type=_strs, default=None, help="default float32,float16,bfloat16")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--gguf", type=_strs, default=None,
                        help="native GGUF types (Q4_K, Q6_K): time gguf_qmm on random blocks instead of "
                             "affine_qmm (--bits ignored)")
    parser.add_argument("--peers", type=_strs, default=None,
                        help="only these peers (linear_float32, linear_float16, linear_bfloat16, int8pack, "
                             "int4pack, mlx); default all")
    parser.add_argument("--float32-precision", choices=["highest", "high", "medium"], default=None,
                        help="torch.set_float32_matmul_precision for the run (all implementations; "
                             "default: leave as is). torch_qmm's CPU 4-bit M=1 kernel then keeps float32 x "
                             "as 2 (high) or 1 (medium) bfloat16 terms instead of 3")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (fewer for slow calls)")
    parser.add_argument("--mlx-max-m", type=int, default=16, help="time MLX only up to this M (slow on CPU)")
    parser.add_argument("--model", nargs="?", const="tiny", default=None, metavar="CONFIG_OR_PATH",
                        help="model benchmark instead: 'tiny', a JSON file of ModelConfig fields, or a transformers model folder")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/<tag>-<device>-<time>.json)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--full", action="store_true",
                        help=f"--device metalsim: the seed shapes at full size (default: N, K / {metalsim_traffic.SCALE})")


def configs(args: argparse.Namespace, device: str) -> list[Config]:
    quick = QUICK if args.quick else {}
    shapes = args.shapes or quick.get("shapes") or SHAPES
    ms = args.m or quick.get("m") or MS
    bits = args.bits or quick.get("bits") or BITS
    dtypes = args.dtype or quick.get("dtype") or DTYPES
    formats = [("affine", b) for b in bits] if not args.gguf else [(f, 4) for f in args.gguf]
    out = []
    for shape in shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        for fmt, b in formats:
            for d in dtypes:
                out += [Config(n, k, m, b, d, args.group_size, device, fmt) for m in ms]
    return out


def run(args: argparse.Namespace) -> int:
    device = args.device or best_device()
    if args.float32_precision:
        torch.set_float32_matmul_precision(args.float32_precision)
    if device == "metalsim":  # byte counts instead of time: metalsim_traffic.py
        return metalsim_traffic.run(args, SHAPES, MS, QUICK)
    copy_gbps = copy_bandwidth_gbps(device)
    info = machine_info(device, copy_gbps)
    print(f"{info['processor']} ({info['cpu_threads']} threads), {info['os']}, torch {info['torch']}, "
          f"commit {info['commit']}; copy bandwidth {copy_gbps:.1f} GB/s; "
          f"float32 matmul precision {info['float32_matmul_precision']}")
    load = info["load_average"]
    if device == "cpu" and load is not None and load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load} on {os.cpu_count()} CPUs: other processes share the cores and "
              f"times will be noisy (see min_ms in the JSON)")

    if args.model is not None:
        dtypes = args.dtype or ["float32"]
        results = [run_model(args.model, device, getattr(torch, d), (args.bits or [4])[0], args.group_size,
                             max(1, args.repeats // 2)) for d in dtypes]
        for r in results:
            print(format_model(r))
        path = default_result_path(device, "model") if args.output is None else args.output
        save_json_path = __import__("pathlib").Path(path)
        save_json_path.parent.mkdir(parents=True, exist_ok=True)
        save_json_path.write_text(json.dumps({"machine": info, "models": results}, indent=1))
        print(f"saved {save_json_path}")
        return 0

    cache = last_level_cache_bytes()
    peer_ok = (lambda p: p in args.peers) if args.peers else (lambda p: True)
    peer_cache: dict = {}
    results = []
    for cfg in configs(args, device):
        r = run_config(cfg, args.repeats, cache, peer_ok, peer_cache, mlx_max_m=args.mlx_max_m)
        results.append(r)
        sp = ", ".join(f"{p} {v:.2f}x" for p, v in r.speedups().items())
        print(f"  {cfg.n}x{cfg.k} M={cfg.m} {cfg.label} {cfg.dtype}: {r.times_ms['torch_qmm']:.3f} ms "
              f"({r.gbps():.1f} GB/s); {sp}", flush=True)
    skipped = {p: why for r in results for p, why in r.skipped.items()}
    print()
    print(format_table(results, copy_gbps))
    for p, why in skipped.items():
        print(f"  peer {p} not run: {why}")
    from pathlib import Path

    path = Path(args.output) if args.output else default_result_path(device, "quick" if args.quick else "kernels")
    save_json(path, info, results)
    print(f"saved {path}")
    if not args.no_plot:
        print(save_plot(path.with_suffix(".png"), results, info))
    return 0
