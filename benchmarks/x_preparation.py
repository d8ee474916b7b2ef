"""What preparing x costs a CPU chunk-kernel call at M=1, and what splitting it over the threads
saves (csrc/cpu/chunk_driver.h: each row of x prepared in parts along K).

A call at N=32 (two spans of W of 16 rows, one per thread of two; a few hundred KB at K=14336)
is nearly all fixed cost: the parallel region, preparing x, a span of products per thread. Each kernel family the CPU takes for
M=1 is timed with x in one part per row (TORCH_QMM_CPU_X_PARTS=1: one thread prepares the whole
row while the others wait) and in the default parts (one per thread), in alternating order, on
1 and 2 threads; each cell the median of many calls. Each call first writes x afresh on the
calling thread (a copy from a source tensor, included in the time), as the op before a layer
does in a model: x then sits in that core's cache, not in every core's, as it would if the same
x were reused call after call. Same process, same inputs, same results (the environment variable
changes only the schedule; tests/test_cpu_slabs.py checks that).

    PYTHONPATH=. python benchmarks/x_preparation.py [--k 14336] [--calls 2000] [--json benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import torch_qmm
from torch_qmm.bench.kernels import random_gguf_blocks
from torch_qmm.ops import gguf_matmul, quantize, quantized_matmul

N = 32  # two spans (work_split.h SpanSchedule): a team of two threads


def families(K: int, gen: torch.Generator):
    """(name, route, call) for the M=1 chunk kernels of every format family benchmarked."""
    out = []
    for bits in (4, 8):
        w = torch.randn(N, K, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            wq, s, b = quantize(w.to(dtype), 32, bits)
            src = torch.randn(1, K, generator=gen).to(dtype)
            x = src.clone()
            for act in (None, "int8"):
                with torch_qmm.activation_quantization(act):
                    route = (torch.ops.torch_qmm._cpu_route_int8_activations(x, wq, s, b, "affine", bits, 32) if act
                             else torch.ops.torch_qmm._cpu_route(x, wq, s, b, bits, 32))

                def call(x=x, src=src, wq=wq, s=s, b=b, bits=bits, act=act):
                    x.copy_(src)
                    with torch_qmm.activation_quantization(act):
                        return quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=bits)

                out.append((f"affine {bits}-bit g32 {str(dtype)[6:]} x{' int8' if act else ''}", route, call))
    for name, t in (("Q4_K", 12), ("Q6_K", 14)):
        blocks = random_gguf_blocks(N, K, name, "cpu", gen)
        for dtype in (torch.float32, torch.bfloat16):
            src = torch.randn(1, K, generator=gen).to(dtype)
            x = src.clone()
            for act in (None, "int8"):
                route = (torch.ops.torch_qmm._gguf_cpu_route_int8_activations(x, blocks, t, N, K) if act
                         else torch.ops.torch_qmm._gguf_cpu_route(x, blocks, t, N, K))

                def call(x=x, src=src, blocks=blocks, t=t, act=act):
                    x.copy_(src)
                    with torch_qmm.activation_quantization(act):
                        return gguf_matmul(x, blocks, t, N, K)

                out.append((f"{name} {str(dtype)[6:]} x{' int8' if act else ''}", route, call))
    return out


def median_us(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--calls", type=int, default=2000, help="calls per cell and setting (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two settings (default: %(default)s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, route, call in families(args.k, gen):
            for _ in range(50):
                call()  # warm: the pool's threads started, W and x in cache
            per = {"1": [], "default": []}
            y = {}
            for _ in range(args.rounds):
                for setting in per:
                    if setting == "default":
                        os.environ.pop("TORCH_QMM_CPU_X_PARTS", None)
                    else:
                        os.environ["TORCH_QMM_CPU_X_PARTS"] = setting
                    y[setting] = call()
                    per[setting].append(median_us(call, args.calls))
            os.environ.pop("TORCH_QMM_CPU_X_PARTS", None)
            assert torch.equal(y["1"], y["default"]), name
            row = {"threads": threads, "family": name, "route": route,
                   "one_part_us": statistics.median(per["1"]), "default_parts_us": statistics.median(per["default"]),
                   "rounds_one_part_us": per["1"], "rounds_default_parts_us": per["default"]}
            rows.append(row)
            print(f"{threads} thr  {name:30s} {route:28s} one part {row['one_part_us']:7.1f} us   "
                  f"parts per thread {row['default_parts_us']:7.1f} us", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"N": N, "K": args.k, "M": 1, "calls": args.calls, "rounds": args.rounds, "commit": commit,
                       "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "load_average": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
