"""The K tail of the chunk kernels: a layer whose K is not a whole number of chunks (the AVX-512
float32 affine kernel's chunks are 128 4-bit or 64 8-bit codes) multiplies the rest of each row
apart (its kernel's `rest`). Times a 1536-row affine layer at one row of x for K around such
tails (576 and 960 are the widths of SmolLM2-135M / 360M) against whole-chunk K, per route; the
ns per weight should not jump at the tails. Median of many calls, one thread.

    PYTHONPATH=. python benchmarks/k_tails.py [--bits 4] [--group-size 64] [--dtype float32] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

import torch_qmm
from x_preparation import median_us  # this folder: the script's own

N = 1536
KS = (512, 576, 640, 960, 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of lines")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in KS:
        w = torch.randn(N, k, generator=gen).to(dtype)
        x = torch.randn(1, k, generator=gen).to(dtype)
        wq, s, b = torch_qmm.quantize(w, group_size=args.group_size, bits=args.bits)
        route = torch.ops.torch_qmm._cpu_route(x, wq, s, b, args.bits, args.group_size, True)
        with torch.inference_mode():
            call = lambda: torch.ops.torch_qmm.qmm(x, wq, s, b, "affine", args.bits, args.group_size, True)  # noqa: E731
            for _ in range(args.calls // 10):
                call()
            us = median_us(call, args.calls)
        rows.append({"n": N, "k": k, "route": route, "median_us": round(us, 1), "ns_per_weight": round(us * 1e3 / (N * k), 4)})
    if args.json:
        print(json.dumps({"bits": args.bits, "group_size": args.group_size, "dtype": args.dtype, "rows": rows}))
    else:
        for r in rows:
            print(f"{r['n']} x {r['k']:5d} {r['route']:20s} {r['median_us']:8.1f} us  {r['ns_per_weight']:.4f} ns/weight")


if __name__ == "__main__":
    main()
