"""gather_qmm_mma32 where a 32-row tile starts inside a pair and the next pair has another expert:
the tile's first run must end at that pair's end. M = 3 does not divide 32, so tile 1 starts at
row 32, inside pair 10 (rows 30-32, expert 0); pair 11 (rows 33-35) is expert 1's. Against the
float64 reference of each pair (tolerance as tests/test_metal_gather.py: half an ulp of the output
dtype plus the float32 accumulation bound)."""

from __future__ import annotations

import pytest
import torch

from test_metal_gather import _check_case

pytestmark = pytest.mark.usefixtures("_clang")


@pytest.fixture(scope="module")
def _clang():
    from metal_helpers import require_clang

    require_clang()


RHS = [0] * 11 + [1] * 5  # 16 pairs of M = 3 rows: 48 rows, tiles [0, 32) and [32, 48)
PATTERN = ("gather_qmm_mma32", "tile-inside-a-pair", 5, 3, 2, RHS, [i % 5 for i in range(len(RHS))], True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[1])
def test_run_starting_inside_a_pair_ends_at_the_pair(dtype):
    _check_case(PATTERN, ("affine", 4, 64), dtype)
