"""Cycles per (W row, x row, 256 weights) of the CPU exact kernels at small M, for comparing
builds of one kernel: W small enough to stay in L3 (N = 512 rows of K = 14336 by default), one
thread, the lowest time of many calls (a shared machine adds time, never removes it), converted at
the clock given (--ghz; 3.65 on the Zen 4 of benchmarks/README.md, from a dependent-add loop).

To compare two builds, run it alternately with PYTHONPATH on each, a few times
(benchmarks/README.md, "Run 13"):

    PYTHONPATH=. python benchmarks/kernel_cycles.py --format Q4_K --m 1,2,4,8
    PYTHONPATH=. python benchmarks/kernel_cycles.py --format affine8 --m 1,2,4,8
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_qmm
from torch_qmm.bench.kernels import _rand_affine, random_gguf_blocks

GGUF_TYPES = {"Q4_K": 12, "Q6_K": 14}
AFFINE = {"affine4": 4, "affine8": 8}


def call_for(fmt: str, n: int, k: int, x: torch.Tensor, gen: torch.Generator):
    """(route name, the call) for one format: GGUF blocks or affine g32 with float32 scales."""
    if fmt in GGUF_TYPES:
        t = GGUF_TYPES[fmt]
        blocks = random_gguf_blocks(n, k, fmt, "cpu", gen)
        route = torch.ops.torch_qmm._gguf_cpu_route(x, blocks, t, n, k)
        return route, lambda: torch.ops.torch_qmm.gguf_qmm(x, blocks, t, n, k)
    bits = AFFINE[fmt]
    wq, scales, biases = _rand_affine(n, k, bits, 32, torch.float32, "cpu", gen)
    route = torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, 32, True, "affine")
    return route, lambda: torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=32, bits=bits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=[*GGUF_TYPES, *AFFINE], default="Q4_K")
    ap.add_argument("--m", default="1,2,4,8", help="rows of x, comma-separated")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--ghz", type=float, default=3.65)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, args.k, generator=gen)
        route, call = call_for(args.format, args.n, args.k, x, torch.Generator().manual_seed(1))
        for _ in range(20):
            call()
        best = float("inf")
        for _ in range(args.calls):
            t0 = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t0)
        units = args.n * args.k / 256 * m
        print(f"{args.format} M={m} {route}: {best * 1e3:.3f} ms, "
              f"{best * args.ghz * 1e9 / units:.1f} cycles per (W row, x row, 256 weights)")


if __name__ == "__main__":
    main()
