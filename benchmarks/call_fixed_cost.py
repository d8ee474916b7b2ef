"""The fixed cost of a CPU chunk-kernel call at M=1: a call at N=16 (one span of W, so one thread
multiplies while the pool's others find no work) is the per-call work (checking and converting x,
preparing it, the parallel region, the result) plus 16 rows of products (about 9 us of the Q4_K
float32 kernel at K=14336). Median of many calls per kernel family, same x every call.

To compare two builds, run it alternately with PYTHONPATH on each, a few times, and take the
medians (benchmarks/README.md, "Run 10"):

    PYTHONPATH=. python benchmarks/call_fixed_cost.py --threads 1 [--k 14336] [--calls 4000]
"""

from __future__ import annotations

import argparse
import json

import torch

import torch_qmm
from torch_qmm.bench.kernels import random_gguf_blocks
from x_preparation import median_us  # this folder: the script's own

N = 16  # one span (csrc/cpu/work_split.h SpanSchedule: at least 16 rows)


def calls(K: int, gen: torch.Generator):
    """(name, call) for the M=1 exact chunk kernels of Q4_K, Q6_K and affine 4/8-bit g32."""
    out = []
    for name, t in (("Q4_K", 12), ("Q6_K", 14)):
        blocks = random_gguf_blocks(N, K, name, "cpu", gen)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, K, generator=gen).to(dtype)
            out.append((f"{name} {str(dtype)[6:]} x", lambda x=x, b=blocks, t=t: torch.ops.torch_qmm.gguf_qmm(x, b, t, N, K)))
    for bits in (4, 8):
        w = torch.randn(N, K, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            wq, s, b = torch_qmm.quantize(w.to(dtype), 32, bits)
            x = torch.randn(1, K, generator=gen).to(dtype)
            out.append((f"affine {bits}-bit g32 {str(dtype)[6:]} x",
                        lambda x=x, wq=wq, s=s, b=b, bits=bits: torch.ops.torch_qmm.affine_qmm(x, wq, s, b, bits, 32, True)))
    return out


def warm_median_us(call, n: int) -> float:
    for _ in range(n // 10):
        call()
    return median_us(call, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--calls", type=int, default=4000, help="calls per kernel family (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of lines")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {name: round(warm_median_us(call, args.calls), 2) for name, call in calls(args.k, torch.Generator().manual_seed(0))}
    if args.json:
        print(json.dumps({"threads": args.threads, "k": args.k, "n": N, "median_us": result}))
    else:
        for name, us in result.items():
            print(f"{args.threads} thr  {name:28s} {us:7.1f} us")


if __name__ == "__main__":
    main()
