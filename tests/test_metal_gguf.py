"""gguf_qmm's Metal kernels (metal/gguf_qmm.h) on metalsim, through the planner (csrc/plan.cpp) and
the metalsim executor, against gguf.quants.dequantize (the gguf package's decoder) + a float64
matmul: every GGUF route, Q4_K and Q6_K, three dtypes, odd N, M across the routing thresholds;
checked mode; simulated traffic (metalsim byte counters)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from gguf import quants

from gguf_helpers import Q4_K, Q6_K, k_quant_magnitude, random_k_blocks
from metal_helpers import DTYPES, require_clang, routes
from tolerance import assert_matches_reference
from torch_qmm.ops import gguf_matmul

TYPES = (Q4_K, Q6_K)
# One problem (M, N, K) per GGUF row of the routing table; N odd, K = 3 super-blocks (fewer than
# the Q4_K lane teams of a SIMD-group, more than Q6_K's: both loop tails are exercised).
GGUF_ROUTE_PROBLEMS = {
    "gguf_qmv": (1, 37, 768),
    "gguf_qmm_bm2": (2, 37, 768),
    "gguf_qmm_bm4": (3, 37, 768),
    "gguf_qmm_bm8": (9, 37, 768),
    "gguf_qmm_mma32": (33, 37, 768),
}
SWEEP_MS = (1, 2, 3, 5, 8, 9, 17, 33)
BUF = {"blocks": 0, "x": 1, "y": 2}  # Must match GGUFBuffer in metal/gguf_params.h


@pytest.fixture(scope="module")
def _clang():
    require_clang()


needs_clang = pytest.mark.usefixtures("_clang")


def plan_gguf(M, N, K, ggml_type, dtype) -> list[dict]:
    return json.loads(torch.ops.torch_qmm._plan_gguf(M, N, K, int(ggml_type), dtype))


def gguf_case(ggml_type, M, N, K, dtype, seed):
    """blocks uint8 [N, K/256*B], W float64 [N, K] (gguf's decode), x [M, K]."""
    blocks = random_k_blocks(ggml_type, N, K, np.random.default_rng(seed))
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return torch.from_numpy(blocks), w, x


def run_gguf(ggml_type, M, N, K, dtype, seed, check=None, count=False):
    from torch_qmm.metalsim import backend, last_launches

    blocks, w, x = gguf_case(ggml_type, M, N, K, dtype, seed)
    with backend(check=check, count=count):
        y = gguf_matmul(x, blocks, int(ggml_type), N, K)
    (launch,) = last_launches()
    xd = x.double()
    assert_matches_reference(y, xd @ w.T, k_quant_magnitude(x, blocks, ggml_type), dtype,
                             f"{launch.kernel} M={M} N={N} K={K}")
    return launch, blocks, x


# ---- the planner ------------------------------------------------------------------------------

def test_every_gguf_route_has_a_problem_that_selects_it():
    table = {r["route"] for r in routes() if r["op"] == "gguf_qmm"}
    assert table == set(GGUF_ROUTE_PROBLEMS)
    for route, (M, N, K) in GGUF_ROUTE_PROBLEMS.items():
        for t in TYPES:
            assert [l["route"] for l in plan_gguf(M, N, K, t, torch.float16)] == [route]


def test_gguf_routing_by_m_matches_the_table():
    expect = {1: "gguf_qmv", 2: "gguf_qmm_bm2", 3: "gguf_qmm_bm4", 4: "gguf_qmm_bm4", 5: "gguf_qmm_bm8",
              8: "gguf_qmm_bm8", 9: "gguf_qmm_bm8", 16: "gguf_qmm_bm8", 17: "gguf_qmm_mma32", 300: "gguf_qmm_mma32"}
    for M, route in expect.items():
        assert plan_gguf(M, 40, 256, Q6_K, torch.float32)[0]["route"] == route, M


def test_gguf_kernel_names_geometry_and_bindings():
    (l,) = plan_gguf(1, 4096, 4096, Q4_K, torch.float32)
    assert l["kernel"] == "gguf_qmv_float_q4_K"
    assert l["threadgroups"] == [512, 1, 1] and l["threads_per_threadgroup"] == [64, 1, 1]
    assert {b["operand"]: b["index"] for b in l["buffers"]} == BUF
    assert l["bytes"] == [{"index": 3, "u32": [1, 4096, 4096, 16]}]
    assert l["tile"] == [1, 8]
    (l,) = plan_gguf(9, 37, 512, Q6_K, torch.float16)
    assert l["kernel"] == "gguf_qmm_bm8_float16_t_q6_K"
    assert l["threadgroups"] == [5, 2, 1] and l["tile"] == [8, 8]
    (l,) = plan_gguf(33, 37, 512, Q4_K, torch.float32)
    assert l["kernel"] == "gguf_qmm_mma32_float_q4_K"
    assert l["threadgroups"] == [2, 2, 1] and l["threads_per_threadgroup"] == [128, 1, 1] and l["tile"] == [32, 32]
    (l,) = plan_gguf(2, 37, 512, Q4_K, torch.bfloat16)
    assert l["kernel"] == "gguf_qmm_bm2_bfloat16_t_q4_K" and l["threadgroups"] == [5, 1, 1]
    assert plan_gguf(0, 37, 512, Q4_K, torch.float32) == [] and plan_gguf(3, 0, 512, Q4_K, torch.float32) == []


def test_plan_gguf_rejects_what_has_no_kernel():
    with pytest.raises(ValueError, match="ggml_type"):
        plan_gguf(1, 8, 256, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of 256"):
        plan_gguf(1, 8, 300, Q4_K, torch.float32)


def test_plan_for_gguf_runs_the_cpu_checks():
    blocks, _, x = gguf_case(Q4_K, 2, 3, 512, torch.float32, seed=0)
    for args in ((x, blocks, 13, 3, 512), (x, blocks, int(Q4_K), 4, 512), (x[:, :256], blocks, int(Q4_K), 3, 512),
                 (x.double(), blocks, int(Q4_K), 3, 512)):
        with pytest.raises((ValueError, TypeError)) as cpu:
            torch.ops.torch_qmm.gguf_qmm(*args)
        with pytest.raises(cpu.type) as planned:
            torch.ops.torch_qmm._plan_for_gguf(*args)
        assert str(planned.value).splitlines()[0] == str(cpu.value).splitlines()[0]


@needs_clang
def test_every_gguf_kernel_a_plan_can_name_exists_in_the_library():
    from torch_qmm.metalsim_backend import gguf_library

    named = {l["kernel"] for t, dtype, (M, N, K) in itertools.product(TYPES, DTYPES, GGUF_ROUTE_PROBLEMS.values())
             for l in plan_gguf(M, N, K, t, dtype)}
    assert len(named) == len(TYPES) * len(DTYPES) * len(GGUF_ROUTE_PROBLEMS)
    assert named == set(gguf_library().kernels), "metal/gguf.metal and the GGUF routes disagree"


# ---- the kernels --------------------------------------------------------------------------------

@needs_clang
@pytest.mark.parametrize("ggml_type,dtype", list(itertools.product(TYPES, DTYPES)),
                         ids=lambda v: getattr(v, "name", str(v).replace("torch.", "")))
def test_gguf_qmm_on_metalsim_matches_gguf_dequantize(ggml_type, dtype):
    for i, M in enumerate(SWEEP_MS):
        N, K = (37, 768) if i % 2 == 0 else (13, 512)
        run_gguf(ggml_type, M, N, K, dtype, seed=10 * i + int(ggml_type))
    run_gguf(ggml_type, 1, 1, 256, dtype, seed=1)  # one row, one super-block
    run_gguf(ggml_type, 1, 64, 2048, dtype, seed=2)  # several super-blocks per lane team


@needs_clang
@pytest.mark.parametrize("route", sorted(GGUF_ROUTE_PROBLEMS))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_kernels_run_clean_in_checked_mode(route, ggml_type):
    M, N, K = GGUF_ROUTE_PROBLEMS[route]
    dtype = DTYPES[(sorted(GGUF_ROUTE_PROBLEMS).index(route) + int(ggml_type)) % len(DTYPES)]
    launch, _, _ = run_gguf(ggml_type, M, N, K, dtype, seed=7, check=True)
    assert launch.route == route


@needs_clang
def test_gguf_batched_strided_x_and_unaligned_blocks():
    from torch_qmm.metalsim import backend

    blocks, w, _ = gguf_case(Q6_K, 1, 9, 512, torch.float32, seed=3)
    x = torch.randn(2, 3, 1024)[..., ::2]  # non-contiguous [2, 3, 512]
    # blocks starting 2 bytes into their storage: the executor re-aligns them for uint32 loads.
    raw = torch.zeros(blocks.numel() + 2, dtype=torch.uint8)
    raw[2:] = blocks.reshape(-1)
    shifted = raw[2:].view(blocks.shape)
    with backend(check=True):
        y = gguf_matmul(x, shifted, int(Q6_K), 9, 512)
    assert y.shape == (2, 3, 9)
    xd = x.reshape(6, 512).double()
    assert_matches_reference(y.reshape(6, 9), xd @ w.T, k_quant_magnitude(xd, blocks, Q6_K), torch.float32, "batched")


@needs_clang
def test_gguf_bad_arguments_raise_the_cpu_errors_on_metalsim():
    from torch_qmm.metalsim import backend

    blocks, _, x = gguf_case(Q4_K, 2, 3, 512, torch.float32, seed=0)
    for args in ((x, blocks, 8, 3, 512), (x, blocks, int(Q4_K), 3, 256)):
        with pytest.raises(ValueError) as cpu:
            gguf_matmul(*args)
        with backend(), pytest.raises(ValueError) as sim:
            gguf_matmul(*args)
        assert str(sim.value).splitlines()[0] == str(cpu.value).splitlines()[0]


# ---- simulated traffic ----------------------------------------------------------------------------
# tg_footprint (sum over threadgroups of each one's distinct bytes): at M = 1 every block byte is
# fetched once (<= 1.02x the blocks buffer); for M >= 2 W at most ceil(M / tile rows) times and x at
# most ceil(N / tile columns) times.

@needs_clang
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16, 40])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_traffic_within_the_tile_bounds(ggml_type, M):
    N, K = 40, 1024
    launch, blocks, x = run_gguf(ggml_type, M, N, K, torch.float16, seed=M, count=True)
    w_ratio = launch.stats.buffers[BUF["blocks"]].tg_footprint / blocks.numel()
    x_ratio = launch.stats.buffers[BUF["x"]].tg_footprint / (x.numel() * x.element_size())
    rows, cols = launch.tile
    if M == 1:
        assert w_ratio <= 1.02, f"{launch.kernel}: blocks fetched {w_ratio:.3f}x at M=1"
    assert w_ratio <= math.ceil(M / rows) + 1e-9, f"{launch.kernel}: W {w_ratio:.3f}x > ceil({M}/{rows})"
    assert x_ratio <= math.ceil(N / cols) + 1e-9, f"{launch.kernel}: x {x_ratio:.3f}x > ceil({N}/{cols})"
