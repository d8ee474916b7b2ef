"""Simulated device traffic of the qmm kernels (metalsim byte counters, issue 4 section 4).

tg_footprint (the sum over threadgroups of each threadgroup's distinct bytes) models device
traffic when caches give no reuse between threadgroups:
  M = 1 : the weight, scale and bias buffers stay within 1.02x their sizes (each byte fetched once);
  M >= 2: the weight buffer within ceil(M / tile_rows)x, x within ceil(N / tile_cols)x, for the
          kernel the planner chose (tile = rows of x, columns of y per threadgroup).

Run as a script for the table of the issue note (seed shapes scaled down, see SHAPES):
    python tests/test_metal_cost.py
"""

from __future__ import annotations

import math
import sys
import time

import pytest
import torch

import torch_qmm
from metal_helpers import require_clang

BUF = {"wq": 0, "scales": 1, "biases": 2, "x": 3, "y": 4}


def measure(M: int, N: int, K: int, bits: int, group_size: int, dtype, transpose: bool = True):
    from torch_qmm.metalsim import backend, last_launches

    rows, cols = (N, K) if transpose else (K, N)
    g = torch.Generator().manual_seed(M + N + K)
    wq, s, b = torch_qmm.quantize(torch.randn(rows, cols, generator=g).to(dtype), group_size=group_size, bits=bits)
    x = torch.randn(M, K, generator=g).to(dtype)
    t = time.perf_counter()
    with backend(count=True):
        torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=group_size, bits=bits)
    seconds = time.perf_counter() - t
    (launch,) = last_launches()
    sizes = {"wq": wq.numel() * 4, "scales": s.numel() * s.element_size(), "biases": b.numel() * b.element_size(),
             "x": x.numel() * x.element_size()}
    ratio = {k: launch.stats.buffers[BUF[k]].tg_footprint / v for k, v in sizes.items()}
    loaded = {k: launch.stats.buffers[BUF[k]].bytes_loaded / v for k, v in sizes.items()}
    return launch, ratio, loaded, seconds


def check_bounds(M, N, launch, ratio):
    if M == 1:
        for k in ("wq", "scales", "biases"):
            assert ratio[k] <= 1.02, f"{launch.kernel}: {k} fetched {ratio[k]:.3f}x at M=1"
    else:
        rows, cols = launch.tile
        assert ratio["wq"] <= math.ceil(M / rows) + 1e-9, f"{launch.kernel}: W {ratio['wq']:.3f}x > ceil({M}/{rows})"
        assert ratio["x"] <= math.ceil(N / cols) + 1e-9, f"{launch.kernel}: x {ratio['x']:.3f}x > ceil({N}/{cols})"


@pytest.mark.parametrize(
    "M,transpose",
    [(1, True), (2, True), (3, True), (7, True), (12, True), (16, True), (33, True), (64, True), (2, False), (40, False)],
)
@pytest.mark.parametrize("bits", [4, 3])
def test_traffic_within_the_tile_bounds(M, transpose, bits):
    require_clang()
    for N, K in ((64, 512), (40, 320)) if transpose else ((384, 96), (128, 45)):
        launch, ratio, _, _ = measure(M, N, K, bits, 64, torch.float16, transpose)
        check_bounds(M, N, launch, ratio)


# Seed shapes (N, K) = (4096, 4096), (14336, 5120), (5120, 14336) scaled down by 8 in each
# dimension (emulating the full sizes at M > 1 takes minutes per cell on one core).
SHAPES = [(512, 512), (1792, 640), (640, 1792)]
# --full: the seed's shapes at full size (minutes of emulation).
FULL_SHAPES = [(4096, 4096), (5120, 5120), (14336, 5120), (5120, 14336), (27648, 5120)]
MS = [1, 2, 4, 8, 16, 32, 64]


def main() -> None:
    full = "--full" in sys.argv
    shapes, ms = (FULL_SHAPES, [1, 8, 16, 32]) if full else (SHAPES, MS)
    print("| M | N x K | kernel | W tg/size | scales | biases | x tg/size | W loaded/size | x loaded/size | bound W / x | emu s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for (N, K) in shapes:
        for M in ms:
            launch, ratio, loaded, seconds = measure(M, N, K, 4, 64, torch.float16)
            rows, cols = launch.tile
            bound = "1.02 / -" if M == 1 else f"{math.ceil(M / rows)} / {math.ceil(N / cols)}"
            check_bounds(M, N, launch, ratio)
            print(f"| {M} | {N}x{K} | {launch.kernel} | {ratio['wq']:.3f} | {ratio['scales']:.3f} | {ratio['biases']:.3f} | "
                  f"{ratio['x']:.1f} | {loaded['wq']:.2f} | {loaded['x']:.1f} | {bound} | {seconds:.2f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
