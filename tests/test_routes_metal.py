"""Every Metal affine_qmm route (csrc/plan.cpp) reached on purpose at and around its boundaries, on
metalsim, checked bit for bit with the exact problems of tests/exact_cases.py.

For each route the shapes below sit on both sides of its limits: M at each threshold of the
routing table (1 | 2 | 3-4 | 5-8 | 9-16 | 17+; transpose=False 1-3 | 4+), K one group below, at
and above the K-block (qmv: 512 codes for bits <= 5, 256 for 6 and 8; bm: 256; mma: 32), N not a
multiple of the tile (37, 33) or, for the aligned M = 1 kernel, a multiple of its 8 rows, and
transpose=False N across the 256 columns of a qvm threadgroup. Every bit width and every dtype
runs each shape; each case first asserts the route the plan chose. The rounding problem makes
float32 accumulation exact, so the output must be the exact product rounded to nearest even in
the output dtype (the mma tiles' stores included); the selection problem makes y copies of x
values, so x must reach the product unrounded. A subset runs again in checked mode
(TORCH_QMM_METALSIM_CHECK: races, barriers, out-of-bounds), where any fault raises.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import torch_qmm
from exact_cases import assert_bitwise, rounding_case, selection_case
from metal_helpers import BITS, DTYPES, plan, require_clang

pytestmark = pytest.mark.usefixtures("_clang")


@pytest.fixture(scope="module")
def _clang():
    require_clang()


def qmv_block_k(bits: int) -> int:
    return 512 if bits <= 5 else 256


# (route, M, N, K, transpose); K may depend on bits (callable).
SHAPES = [
    ("qmv_fast", 1, 40, qmv_block_k, True),
    ("qmv_fast", 1, 8, lambda b: 2 * qmv_block_k(b), True),
    ("qmv_bounded", 1, 40, lambda b: qmv_block_k(b) // 2, True),  # aligned to another width's block only
    ("qmv_bounded", 1, 40, lambda b: qmv_block_k(b) + 32, True),
    ("qmv_bounded", 1, 37, lambda b: qmv_block_k(b), True),
    ("qmm_t_bm2", 2, 37, 288, True),
    ("qmm_t_bm4", 3, 37, 224, True),
    ("qmm_t_bm4", 4, 37, 256, True),
    ("qmm_t_bm8", 5, 37, 288, True),
    ("qmm_t_bm8", 8, 9, 544, True),
    ("qmm_t_mma16", 9, 37, 96, True),
    ("qmm_t_mma16", 16, 33, 160, True),
    ("qmm_t_mma32", 17, 37, 96, True),
    ("qmm_t_mma32", 33, 65, 64, True),
    ("qvm_bounded", 1, 288, 45, False),
    ("qvm_bounded", 3, 224, 33, False),
    ("qmm_n_mma32", 4, 96, 45, False),
    ("qmm_n_mma32", 33, 288, 31, False),
]

CASES = [(i, bits, dtype) for i in range(len(SHAPES)) for bits in BITS for dtype in DTYPES]


def _resolve(i, bits):
    route, M, N, K, transpose = SHAPES[i]
    return route, M, N, K(bits) if callable(K) else K, transpose


def _id(case):
    i, bits, dtype = case
    route, M, N, K, t = _resolve(i, bits)
    return f"{route}-M{M}-N{N}-K{K}-{'T' if t else 'N'}-b{bits}-{str(dtype).split('.')[1]}"


def _run(case, make, check=None):
    from torch_qmm.metalsim import backend, last_launches

    i, bits, dtype = case
    route, M, N, K, transpose = _resolve(i, bits)
    gs = 32
    c = make(M, N, K, bits, gs, dtype, transpose, seed=zlib.crc32(_id(case).encode()) % 10_000)
    if make is rounding_case and dtype != torch.float32:
        assert c.rounded_fraction() > 0.1, "the problem must need rounding in this dtype"
    with backend(check=check):
        y = torch_qmm.quantized_matmul(*c.operands, transpose=transpose, group_size=gs, bits=bits)
    (ran,) = last_launches()
    # The output first (a wrong route must also give a wrong or a right answer, never pass
    # unnoticed), then that this shape took the route it is here for.
    assert_bitwise(y, c.expected(), f"{make.__name__} {_id(case)} ({ran.route})")
    assert ran.route == route, f"{_id(case)}: the plan chose {ran.route}"
    (launch,) = plan("qmm", M, N, K, bits, gs, dtype, transpose)
    assert launch["route"] == route


# Checked mode: each route shape once, bit widths and dtypes rotating. First in the file: an
# out-of-bounds store that checked mode reports as a KernelFault would, unchecked, write past the
# tensor and can end the process before any later test runs.
@pytest.mark.parametrize(
    "case", [(i, BITS[i % len(BITS)], DTYPES[i % len(DTYPES)]) for i in range(len(SHAPES))], ids=_id)
def test_metal_route_runs_clean_in_checked_mode(case):
    _run(case, rounding_case, check=True)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_metal_route_rounds_exactly(case):
    _run(case, rounding_case)


# x precision: every route, every x dtype, two bit widths (the x path does not depend on bits).
@pytest.mark.parametrize("case", [c for c in CASES if c[1] in (4, 6)], ids=_id)
def test_metal_route_uses_x_unrounded(case):
    _run(case, selection_case)


def test_every_metal_qmm_route_is_reached():
    from metal_helpers import routes

    want = {r["route"] for r in routes() if r["op"] == "qmm"}
    assert want == {s[0] for s in SHAPES}


# Sparse x with every bit of its dtype against weights with nonzero biases (the selection problem
# has biases 0): each output sums a few products, so every route must be within a few roundings of
# the terms it adds (reference.qmm_magnitude), far below ACC_RTOL: a bias sum of x kept in half, x
# read as half or a scale rounded fails. Each route shape once, bit widths rotating.
@pytest.mark.parametrize(
    "case", [(i, BITS[(i + 1) % len(BITS)], DTYPES[i % 2]) for i in range(len(SHAPES))], ids=_id)
def test_metal_route_sums_sparse_x_within_a_few_roundings(case):
    from metal_helpers import qmm_case
    from tolerance import assert_within_few_roundings, sparse_x
    from torch_qmm import reference
    from torch_qmm.metalsim import backend, last_launches

    i, bits, dtype = case
    route, M, N, K, transpose = _resolve(i, bits)
    gs = 32
    seed = zlib.crc32(_id(case).encode()) % 10_000
    _, wq, s, b = qmm_case(M, N, K, bits, gs, dtype, transpose, seed)
    values = min(4, max(1, K // gs))
    x = sparse_x(M, K, values, gs if K >= gs else K, dtype, seed)
    with backend():
        y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=gs, bits=bits)
    (ran,) = last_launches()
    assert_within_few_roundings(y, reference.qmm(x, wq, s, b, bits, gs, transpose),
                                reference.qmm_magnitude(x, wq, s, b, bits, gs, transpose), dtype, values,
                                f"{_id(case)} ({ran.route})")
    assert ran.route == route
