"""gather_qmm's Metal kernels (metal/quant_gather.h) on metalsim, through the planner, against the
float64 references nobody here wrote differently per pair: torch_qmm/reference.py (affine) and
reference_fp.py (MLX's fp modes), one exact product x[lhs[i]] @ W[rhs[i]] per pair, and
mlx.core.gather_qmm for the broadcasting of absent indices.

Tolerance (tests/tolerance.py, per dtype): half an ulp of the output dtype (float32 2^-24,
float16 2^-11, bfloat16 2^-8 relative) + the float32 accumulation bound times sum |x w|: the
kernels accumulate in float32 and round y once, as the qmm kernels do.

Every route of the routing table's gather_qmm rows (csrc/plan.cpp) x every quantized mode x a
few bit widths / group sizes x dtypes; unsorted and sorted indices; N not a multiple of the tiles
(transpose=True); experts repeated across pairs and within one token; runs longer than a block
of 8 rows and runs crossing a 32-row tile. Checked mode (out-of-bounds, races, barrier
divergence) runs each route x mode once; the traffic tests show an expert's W is read once.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import torch_qmm
from metal_helpers import DTYPES, require_clang, routes
from tolerance import assert_matches_reference
from torch_qmm import metalsim_backend, reference, reference_fp

pytestmark = pytest.mark.usefixtures("_clang")


@pytest.fixture(scope="module")
def _clang():
    require_clang()


# (mode, bits, group size): affine at three widths / group sizes, each fp mode at its own.
CELLS = [("affine", 4, 64), ("affine", 3, 32), ("affine", 8, 128), ("mxfp4", 4, 32), ("nvfp4", 4, 16),
         ("mxfp8", 8, 32)]


def _weights(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = shape[-2]
    w = torch.randn(*shape, generator=g) * torch.logspace(-1, 1, rows).reshape(rows, 1)
    return w.to(dtype)


def _quantize(w, mode, bits, gs):
    """(wq, scales, biases or None) of stacked W [E, rows, cols], quantized along the last axis."""
    if mode == "affine":
        return torch_qmm.quantize(w, group_size=gs, bits=bits)
    wq, scales = reference_fp.quantize_fp(w.reshape(-1, w.shape[-1]), mode)
    return wq.reshape(*w.shape[:-1], -1), scales.reshape(*w.shape[:-1], -1), None


def _pair_reference(x2, wq, scales, biases, mode, bits, gs, transpose):
    if mode == "affine":
        return (reference.qmm(x2, wq, scales, biases, bits, gs, transpose),
                reference.qmm_magnitude(x2, wq, scales, biases, bits, gs, transpose))
    return (reference_fp.qmm_fp(x2, wq, scales, mode, transpose=transpose),
            reference_fp.qmm_fp_magnitude(x2, wq, scales, mode, transpose=transpose))


def gather_reference(x, wq, scales, biases, lhs, rhs, mode, bits, gs, transpose):
    """float64 (y, sum |x w|) [*lhs.shape, M, N]: one reference product per pair (lhs, rhs given,
    same shape; x [Bx, M, K], W stacked [E, ...])."""
    ys, mags = [], []
    for i, e in zip(lhs.reshape(-1).tolist(), rhs.reshape(-1).tolist()):
        y, m = _pair_reference(x[i], wq[e], scales[e], None if biases is None else biases[e], mode, bits, gs,
                               transpose)
        ys.append(y)
        mags.append(m)
    shape = tuple(lhs.shape) + tuple(ys[0].shape)
    return torch.stack(ys).reshape(shape), torch.stack(mags).reshape(shape)


def run_gather(x, wq, scales, biases, lhs, rhs, mode, bits, gs, transpose=True, sorted_indices=False, check=None,
               count=False):
    y = metalsim_backend._gather_qmm(x, wq, scales, biases, lhs, rhs, mode, bits, gs, transpose, sorted_indices,
                                     check=check, count=count)
    return y, metalsim_backend.last_launches()


# Index patterns: (route, name, x batch, M, experts, rhs (list), lhs (list or None = pair i reads
# x batch i), sorted_indices).
_DECODE_RHS = [3, 1, 1, 4, 3, 3]  # tokens of k = 2: experts repeated across and within tokens
# With M = 2: a run of 7 pairs = 14 rows (two blocks of 8); 5 experts, so that 18 rows stay
# below the tiles' 4 rows per expert.
_LONG_RUN = [2] * 6 + [0, 2, 1]
_SORTED_TILES = [0] * 5 + [1] * 30 + [2] * 5  # runs crossing the 32-row tile boundary
# Prefill, 20 tokens x k = 2 of 3 experts as the router gives them (unsorted): the executor orders
# the 40 pairs by expert, runs of 13-14 pairs crossing the 32-row tile.
_UNSORTED_PREFILL = [(7 * i + i // 3) % 3 for i in range(40)]
PATTERNS = [
    ("gather_qmv", "decode-unsorted", 6, 1, 5, _DECODE_RHS, None, False),
    ("gather_qmv", "long-run-m2", 4, 2, 5, _LONG_RUN, [0, 1, 2, 3, 0, 1, 2, 3, 1], False),
    ("gather_qmv", "sorted-few-rows", 4, 1, 6, [0, 1, 1, 5], None, True),
    ("gather_qmm_mma32", "sorted-tiles", 40, 1, 3, _SORTED_TILES, None, True),
    ("gather_qmm_mma32", "sorted-m3", 5, 3, 2, [0] * 6 + [1] * 8, [i % 5 for i in range(14)], True),
    ("gather_qmm_mma32", "unsorted-prefill", 20, 1, 3, _UNSORTED_PREFILL, [i // 2 for i in range(40)], False),
    ("gather_qmm_n_mma32", "unsorted-n", 6, 2, 3, [2, 0, 2, 1, 0, 2, 1, 1, 0, 2, 2, 2, 0, 1, 0, 0, 2],
     [i % 6 for i in range(17)], False),
]


def _n_k(route, gs):
    # transpose=True: N = 37 (not a multiple of 8 or 32); transpose=False: N a multiple of the group
    # size (and of the tile only for gs >= 32), K odd.
    return (3 * gs, 45) if route == "gather_qmm_n_mma32" else (37, 3 * gs)


def _case(route, name, x_batch, M, experts, rhs, lhs, sorted_indices, mode, bits, gs, dtype, seed):
    transpose = route != "gather_qmm_n_mma32"
    N, K = _n_k(route, gs)
    rows, cols = (N, K) if transpose else (K, N)
    wq, scales, biases = _quantize(_weights((experts, rows, cols), dtype, seed), mode, bits, gs)
    x = torch.randn(x_batch, M, K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    rhs_t = torch.tensor(rhs, dtype=torch.int32)
    lhs_t = torch.tensor(lhs if lhs is not None else list(range(len(rhs))), dtype=torch.int32)
    return x, wq, scales, biases, lhs_t, rhs_t, transpose


def _check_case(pattern, cell, dtype, check=None):
    route, name, x_batch, M, experts, rhs, lhs, sorted_indices = pattern
    mode, bits, gs = cell
    seed = 11 * CELLS.index(cell) + len(name)
    x, wq, scales, biases, lhs_t, rhs_t, transpose = _case(*pattern, *cell, dtype, seed)
    y, launches = run_gather(x, wq, scales, biases, lhs_t if lhs is not None else None, rhs_t, mode, bits, gs,
                             transpose, sorted_indices, check=check)
    y_ref, magnitude = gather_reference(x, wq, scales, biases, lhs_t, rhs_t, mode, bits, gs, transpose)
    (launch,) = launches
    what = f"{launch.kernel} {name}"
    assert launch.route == route, f"{name}: the plan chose {launch.route}, not {route}"
    assert_matches_reference(y, y_ref, magnitude, dtype, what)
    want = {"x", "wq", "scales", "y", "lhs", "rhs", "order"} | ({"biases"} if mode == "affine" else set())
    assert set(launch.buffers.values()) == want


def _id(pattern, cell, dtype):
    return f"{pattern[0]}-{pattern[1]}-{cell[0]}-b{cell[1]}-gs{cell[2]}-{str(dtype).split('.')[1]}"


# Every route x mode cell x dtype for the transpose=True routes (one pattern each, rotating);
# transpose=False: every cell, dtypes rotating.
SWEEP = []
for ci, cell in enumerate(CELLS):
    for di, dtype in enumerate(DTYPES):
        for route in ("gather_qmv", "gather_qmm_mma32"):
            patterns = [p for p in PATTERNS if p[0] == route]
            SWEEP.append((patterns[(ci + di) % len(patterns)], cell, dtype))
    n_pattern = [p for p in PATTERNS if p[0] == "gather_qmm_n_mma32"][0]
    SWEEP.append((n_pattern, cell, DTYPES[ci % len(DTYPES)]))


@pytest.mark.parametrize("pattern,cell,dtype", SWEEP, ids=[_id(*c) for c in SWEEP])
def test_gather_route_matches_reference(pattern, cell, dtype):
    _check_case(pattern, cell, dtype)


# Checked mode: every pattern (hence every route) once per mode family, dtypes rotating.
CHECKED = [(p, CELLS[(i * 5) % len(CELLS)], DTYPES[i % len(DTYPES)]) for i, p in enumerate(PATTERNS)]
CHECKED += [(PATTERNS[0], cell, DTYPES[1]) for cell in CELLS if cell[0] != "affine"]


@pytest.mark.parametrize("pattern,cell,dtype", CHECKED, ids=[_id(*c) for c in CHECKED])
def test_gather_route_runs_clean_in_checked_mode(pattern, cell, dtype):
    _check_case(pattern, cell, dtype, check=True)


def _plan(M, N, K, pairs, experts, x_batch, sorted_indices, transpose=True, mode="affine", bits=4, gs=64,
          dtype=torch.float16):
    return json.loads(torch.ops.torch_qmm._plan_gather(M, N, K, pairs, experts, x_batch, bits, gs, dtype, transpose,
                                                       sorted_indices, mode))


def test_every_gather_route_is_reached_and_listed():
    listed = {r["route"]: r for r in routes() if r["op"] == "gather_qmm"}
    assert set(listed) == {p[0] for p in PATTERNS}
    for r in listed.values():
        assert {"affine", "mxfp4", "nvfp4", "mxfp8"} <= set(r["formats"]), r
    # The planner's choice at the thresholds (GATHER_MMA_MIN_ROWS_PER_EXPERT = 4 rows per expert).
    assert _plan(1, 64, 256, 8, 128, 1, False)[0]["route"] == "gather_qmv"
    assert _plan(1, 64, 256, 512, 128, 512, True)[0]["route"] == "gather_qmm_mma32"
    assert _plan(1, 64, 256, 511, 128, 511, True)[0]["route"] == "gather_qmv"
    # Unsorted: the same threshold, the executor ordering the pairs by expert for the tiles.
    (unsorted,) = _plan(1, 64, 256, 512, 128, 512, False)
    assert (unsorted["route"], unsorted["order"]) == ("gather_qmm_mma32", "by_expert")
    assert _plan(1, 64, 256, 511, 128, 511, False)[0]["route"] == "gather_qmv"
    assert _plan(4, 64, 256, 128, 128, 128, True)[0]["route"] == "gather_qmm_mma32"  # pairs * M
    assert _plan(1, 64, 45, 4, 2, 4, False, transpose=False)[0]["route"] == "gather_qmm_n_mma32"


def test_gather_plan_orders_pairs_by_expert_unless_sorted():
    assert _plan(1, 64, 256, 8, 16, 1, False)[0]["order"] == "by_expert"
    assert _plan(1, 64, 256, 8, 16, 1, True)[0]["order"] == "as_given"
    (launch,) = _plan(1, 37, 256, 8, 16, 1, False)
    assert launch["threadgroups"] == [5, 8, 1], "gather_qmv: a column of 8-row threadgroups per pair"
    assert _plan(1, 64, 256, 0, 16, 1, False) == [], "no pairs, no launch"


def test_gather_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="experts"):
        _plan(1, 64, 256, 8, 0, 1, False)


# Each operand's element count past 2^32 - 1, alone: (M, N, K, pairs, experts, x_batch) and the
# product the message must name, with its factors and value.
_TOO_LARGE = [
    ((1, 1 << 16, 1 << 16, 8, 2, 1), "W has experts * N * K = 2 * 65536 * 65536 = 8589934592 elements"),
    ((1, 64, 1 << 16, 1, 1, 1 << 16), "x has x_batch * M * K = 65536 * 1 * 65536 = 4294967296 elements"),
    ((1 << 16, 1 << 15, 64, 2, 1, 1), "y has pairs * M * N = 2 * 65536 * 32768 = 4294967296 elements"),
]


@pytest.mark.parametrize("dims,product", _TOO_LARGE, ids=["W", "x", "y"])
def test_gather_plan_too_large_names_the_product_it_checked(dims, product):
    M, N, K, pairs, experts, x_batch = dims
    with pytest.raises(ValueError) as e:
        _plan(M, N, K, pairs, experts, x_batch, False)
    message = str(e.value)
    assert "gather_qmm's " + product in message, message
    assert "32-bit indices" in message and "2^32 - 1 = 4294967295" in message, message


def test_gather_pairs_broadcast_like_mlx():
    """Absent indices and broadcasting against mlx.core.gather_qmm (shape and values)."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    T, k, E, N, K = 3, 2, 4, 40, 128
    w = _weights((E, N, K), torch.float32, 5)
    wq, scales, biases = torch_qmm.quantize(w, group_size=64, bits=4)
    x = torch.randn(T, 1, 1, K, generator=torch.Generator().manual_seed(6))
    rhs = torch.tensor([[1, 3], [3, 0], [2, 2]], dtype=torch.int32)
    y, (launch,) = run_gather(x, wq, scales, biases, None, rhs, "affine", 4, 64)
    ym = mx.gather_qmm(mx.array(x.numpy()), mx.array(wq.numpy()), mx.array(scales.numpy()),
                       mx.array(biases.numpy()), rhs_indices=mx.array(rhs.numpy()), transpose=True, group_size=64,
                       bits=4)
    assert tuple(y.shape) == tuple(ym.shape) == (T, k, 1, N)
    y_ref, magnitude = gather_reference(x.reshape(T, 1, K), wq, scales, biases,
                                        torch.arange(T).reshape(T, 1).expand(T, k), rhs, "affine", 4, 64, True)
    assert_matches_reference(y, y_ref, magnitude, torch.float32, "gather_qmv vs float64")
    # mlx's own float32 accumulation: the same bound applies to it.
    assert_matches_reference(torch.from_numpy(np.array(ym)), y_ref, magnitude, torch.float32, "mlx vs float64")


# ---- traffic: each expert's W is read once per launch -------------------------------------------

def _traffic(route, tokens, k, experts, N, K, sorted_indices, mode="affine", bits=4, gs=64, seed=3):
    wq, scales, biases = _quantize(_weights((experts, N, K), torch.float16, seed), mode, bits, gs)
    g = torch.Generator().manual_seed(seed + 1)
    rhs = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    if sorted_indices:
        rhs = rhs.reshape(-1).sort().values
    x = torch.randn(rhs.numel() if sorted_indices else tokens, 1, K, generator=g).to(torch.float16)
    lhs = None if sorted_indices else torch.arange(tokens, dtype=torch.int32).reshape(tokens, 1).expand(tokens, k)
    y, (launch,) = run_gather(x, wq, scales, biases, lhs, rhs, mode, bits, gs, True, sorted_indices, count=True)
    assert launch.route == route
    distinct = len(set(rhs.reshape(-1).tolist()))
    by_name = {launch.buffers[i]: b for i, b in launch.stats.buffers.items() if i in launch.buffers}
    return launch, by_name, distinct, wq[0].numel() * 4, scales[0].numel() * scales.element_size()


@pytest.mark.parametrize("mode,bits,gs", [("affine", 4, 64), ("mxfp4", 4, 32)])
def test_gather_qmv_reads_each_expert_once(mode, bits, gs):
    """Decode, 2 tokens x k = 4 of 16 experts (repeats between the tokens): the weight and scale
    bytes fetched (summed over threadgroups) equal those of the distinct experts exactly (N a
    multiple of the 8-row tile: no overfetch) -- not pairs x an expert."""
    launch, b, distinct, w_bytes, s_bytes = _traffic("gather_qmv", 2, 4, 16, 64, 256, False, mode, bits, gs, seed=9)
    assert distinct < 8, "the case must repeat an expert for the test to mean anything"
    assert b["wq"].tg_footprint == distinct * w_bytes
    assert b["wq"].bytes_loaded == distinct * w_bytes, "each weight byte loaded once"
    assert b["scales"].tg_footprint == distinct * s_bytes
    if mode == "affine":
        assert b["biases"].tg_footprint == distinct * s_bytes


def test_gather_qmm_mma_reads_each_expert_about_once_per_tile():
    """Prefill, sorted: an expert's W is fetched once per 32-row tile its rows touch (runs crossing
    a tile boundary are read by both tiles): at most (distinct + tiles - 1) experts' bytes x the
    column tiles' overfetch (N = 64: none)."""
    launch, b, distinct, w_bytes, _ = _traffic("gather_qmm_mma32", 16, 4, 8, 64, 256, True)
    tiles = launch.threadgroups[1]
    assert distinct * w_bytes <= b["wq"].tg_footprint <= (distinct + tiles - 1) * w_bytes


# ---- the op through the metalsim executor (torch_qmm.gather_qmm under metalsim_backend.backend) ---

def test_gather_qmm_op_runs_the_planned_kernels():
    """torch_qmm.gather_qmm on CPU tensors inside backend() runs the Metal kernels (the launch is
    the planned one) and matches the float64 reference; the CPU op agrees within the same bound."""
    E, N, K, T, k = 4, 37, 128, 3, 2
    wq, scales, biases = torch_qmm.quantize(_weights((E, N, K), torch.bfloat16, 21), group_size=64, bits=4)
    x = torch.randn(T, 1, 1, K, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    rhs = torch.tensor([[2, 0], [0, 3], [2, 2]], dtype=torch.int64)
    with metalsim_backend.backend():
        y = torch_qmm.gather_qmm(x, wq, scales, biases, rhs_indices=rhs, group_size=64, bits=4)
    (launch,) = metalsim_backend.last_launches()
    assert launch.route == "gather_qmv" and launch.kernel == "affine_gather_qmv_bfloat16_t_gs_64_b_4"
    y_ref, magnitude = gather_reference(x.reshape(T, 1, K), wq, scales, biases,
                                        torch.arange(T).reshape(T, 1).expand(T, k), rhs, "affine", 4, 64, True)
    assert_matches_reference(y, y_ref, magnitude, torch.bfloat16, "gather_qmm op on metalsim")
    y_cpu = torch_qmm.gather_qmm(x, wq, scales, biases, rhs_indices=rhs, group_size=64, bits=4)
    assert_matches_reference(y_cpu, y_ref, magnitude, torch.bfloat16, "gather_qmm op on CPU")


def test_gather_qmm_op_refuses_bad_indices_before_any_launch():
    E, N, K = 3, 16, 64
    wq, scales, biases = torch_qmm.quantize(_weights((E, N, K), torch.float32, 23), group_size=64, bits=4)
    x = torch.randn(2, 1, K)
    with metalsim_backend.backend():
        with pytest.raises(ValueError, match="rhs_indices"):
            torch_qmm.gather_qmm(x, wq, scales, biases, rhs_indices=torch.tensor([[0], [3]]), group_size=64, bits=4)
        with pytest.raises(ValueError, match="lhs_indices"):
            torch_qmm.gather_qmm(x, wq, scales, biases, lhs_indices=torch.tensor([2]), rhs_indices=torch.tensor([0]),
                                 group_size=64, bits=4)


# Sparse x with every bit of its dtype (tests/tolerance.py sparse_x): each output sums a few
# products, so both the Metal routes and the CPU op must be within a few roundings of the terms
# they add, far below ACC_RTOL: a pair reading another row or expert's group scale, x read as
# half, or a bias sum kept narrow fails. Every pattern, affine with biases and an fp mode.
SPARSE = [(p, CELLS[[0, 1, 3, 4][i % 4]], torch.float32) for i, p in enumerate(PATTERNS)]


@pytest.mark.parametrize("pattern,cell,dtype", SPARSE, ids=[_id(*c) for c in SPARSE])
def test_gather_sums_sparse_x_within_a_few_roundings(pattern, cell, dtype):
    from tolerance import assert_within_few_roundings, sparse_x

    route, name, x_batch, M, experts, rhs, lhs, sorted_indices = pattern
    mode, bits, gs = cell
    seed = 7 * CELLS.index(cell) + len(name)
    _, wq, scales, biases, lhs_t, rhs_t, transpose = _case(*pattern, *cell, dtype, seed)
    K = wq.shape[-1] * 32 // bits if transpose else wq.shape[-2]
    values = min(4, max(1, K // 32))
    x = sparse_x(x_batch * M, K, values, 32 if K >= 32 else K, dtype, seed).reshape(x_batch, M, K)
    lhs_arg = lhs_t if lhs is not None else None
    y_ref, magnitude = gather_reference(x, wq, scales, biases, lhs_t, rhs_t, mode, bits, gs, transpose)
    y, (launch,) = run_gather(x, wq, scales, biases, lhs_arg, rhs_t, mode, bits, gs, transpose, sorted_indices)
    assert launch.route == route
    assert_within_few_roundings(y, y_ref, magnitude, dtype, values, f"{launch.kernel} {name}")
    y_cpu = torch_qmm.gather_qmm(x, wq, scales, biases, lhs_arg, rhs_t, transpose=transpose, group_size=gs,
                                 bits=bits, mode=mode, sorted_indices=sorted_indices)
    assert_within_few_roundings(y_cpu, y_ref, magnitude, dtype, values, f"cpu {name}")
