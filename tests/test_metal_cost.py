"""Simulated device traffic of the qmm kernels (metalsim byte counters).

tg_footprint (the sum over threadgroups of each threadgroup's distinct bytes) models device
traffic when caches give no reuse between threadgroups:
  M = 1 : the weight, scale and bias buffers stay within 1.02x their sizes (each byte fetched once);
  M >= 2: the weight buffer within ceil(M / tile_rows)x, x within ceil(N / tile_cols)x, for the
          kernel the planner chose (tile = rows of x, columns of y per threadgroup).
The measurement and the bounds live in torch_qmm/bench/metalsim_traffic.py (the bench's
--device metalsim table); this file asserts them on small odd shapes. The table itself:
    python -m torch_qmm bench --device metalsim          # or: python tests/test_metal_cost.py
"""

from __future__ import annotations

import sys

import pytest

from metal_helpers import require_clang
from torch_qmm.bench.kernels import Config
from torch_qmm.bench.metalsim_traffic import measure


@pytest.mark.parametrize(
    "M,transpose",
    [(1, True), (2, True), (3, True), (7, True), (12, True), (16, True), (33, True), (64, True), (2, False), (40, False)],
)
@pytest.mark.parametrize("bits", [4, 3])
def test_traffic_within_the_tile_bounds(M, transpose, bits):
    require_clang()
    for N, K in ((64, 512), (40, 320)) if transpose else ((384, 96), (128, 45)):
        t = measure(Config(N, K, M, bits, "float16", 64, "metalsim"), transpose=transpose)
        assert set(t.buffers) == {"wq", "scales", "biases", "x", "y"}
        checked = [name for name, b in t.buffers.items() if b.bound is not None]
        assert checked == (["wq", "scales", "biases"] if M == 1 else ["wq", "x"])
        assert t.holds, t.failures()


@pytest.mark.parametrize("M,transpose", [(1, True), (3, True), (12, True), (33, True), (2, False), (40, False)])
@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_fp_traffic_within_the_tile_bounds(M, transpose, mode):
    """The fp modes bind wq, scales (uint8 codes), x and y; at M = 1 each weight and scale byte is
    fetched once (tg_footprint within 1.02x of the buffer), at M >= 2 the tile bounds hold."""
    require_clang()
    from torch_qmm.formats import FORMATS

    if mode not in FORMATS:
        pytest.skip(f"mode {mode!r} is not in the format table yet")
    for N, K in ((64, 1024), (40, 320)) if transpose else ((384, 96), (160, 45)):
        t = measure(Config(N, K, M, 0, "float16", 0, "metalsim"), transpose=transpose, mode=mode)
        assert set(t.buffers) == {"wq", "scales", "x", "y"}
        checked = [name for name, b in t.buffers.items() if b.bound is not None]
        assert checked == (["wq", "scales"] if M == 1 else ["wq", "x"])
        assert t.holds, t.failures()


def test_bound_violation_is_reported():
    """The bound check can fail: a tg_footprint above the bound is flagged, not averaged away."""
    from torch_qmm.bench.metalsim_traffic import BufferTraffic

    b = BufferTraffic(compulsory=100, tg_footprint=103, loaded=103, stored=0, bound=1.02)
    assert b.holds is False and BufferTraffic(100, 102, 102, 0, 1.02).holds is True


if __name__ == "__main__":
    from torch_qmm.__main__ import main

    sys.exit(main(["bench", "--device", "metalsim", *sys.argv[1:]]))
