"""gguf_qmm's Metal kernels (metal/gguf_qmm.h) on metalsim, through the planner (csrc/plan.cpp) and
the metalsim executor, against gguf.quants.dequantize (the gguf package's decoder) + a float64
matmul: every GGUF route, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS and the lattice i-quants (IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), three dtypes, odd N, M across the
routing thresholds; bit-exact sums and one-hot weights at every position of a super-block (the
sub-block and bit mapping of each type), Q3_K's high bits, Q5_K's fifth bits, IQ4_XS's 64 sub-block
scales and 16 codes at every position; checked mode; simulated traffic (metalsim byte counters)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from gguf import quants

from gguf.constants import GGML_QUANT_SIZES

from gguf_helpers import IQ4_XS, LATTICE_TYPES, NATIVE_K_TYPES, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, exact_k_blocks, exact_x
from gguf_helpers import k_quant_magnitude, one_hot_k_blocks, random_k_blocks
from metal_helpers import DTYPES, require_clang, routes
from tolerance import assert_matches_reference
from torch_qmm.ops import gguf_matmul

TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) + LATTICE_TYPES
assert set(TYPES) == set(NATIVE_K_TYPES), "every native GGUF type has Metal kernels to test"
NEW_TYPES = (Q2_K, Q3_K)
# The one-hot test needs a zero weight (every code but one decodes to 0): not IQ4_XS, whose 16
# values (kIQ4Values) have no 0. Its codes are checked one by one in test_gguf_iq4xs_every_scale_and_code.
ONE_HOT_TYPES = (Q2_K, Q3_K, Q5_K)
# One problem (M, N, K) per GGUF row of the routing table; N odd, K = 3 super-blocks (fewer than
# the 4 Q4_K / Q5_K / IQ4_XS lane teams of a SIMD-group, more than the 2 of Q2_K / Q3_K / Q6_K (16
# lanes each): both loop tails are exercised).
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


# The tolerance (tolerance.py) bounds the float32 accumulation error by ACC_RTOL times
# k_quant_magnitude, |x| @ (|scaled| + |offset|).T, not |x| @ |w|.T: the kernels factor a run's
# offset out of its dot product. Q4_K, Q5_K and Q2_K: scale * sum(q x) - min * sum(x) (d*sc and
# dmin*m are exact products of an f16 and a small integer, and so is d*sc*q, at most 11 + 6 + 5 bits,
# so the reference's weight d*sc*q - dmin*m is one rounding of the same terms); where the two terms cancel the error is
# relative to their sum. Q6_K and Q3_K: codes shifted to q - 32 / q - 4 before the dot product,
# their weights d*sc*(q - 32) / d*sc*(q - 4) are exact in float32 (at most 11 + 7 + 5 and 11 + 6 + 3 significant bits),
# and the offset term only makes the magnitude larger than |x| @ |w|.T. IQ4_XS: scale * sum(value * x)
# with scale = d*(l - 32) and value = kIQ4Values[q], no offset; its weights d*(l - 32)*value are exact in
# float32 (at most 11 + 5 + 7 significant bits), and k_quant_terms' offset (the values as byte codes
# value + 128) again only makes the magnitude larger. The lattice i-quants: scale * sum(q * x), q a
# group's signed codebook value (IQ1: plus +-1/8), exact weights, no offset: |x| @ |w|.T.
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
    (l,) = plan_gguf(1, 4096, 4096, Q2_K, torch.float32)
    assert l["kernel"] == "gguf_qmv_float_q2_K" and l["threadgroups"] == [512, 1, 1]
    assert l["bytes"] == [{"index": 3, "u32": [1, 4096, 4096, 16]}]
    (l,) = plan_gguf(3, 37, 512, Q3_K, torch.bfloat16)
    assert l["kernel"] == "gguf_qmm_bm4_bfloat16_t_q3_K" and l["threadgroups"] == [5, 1, 1]
    (l,) = plan_gguf(40, 37, 512, Q3_K, torch.float16)
    assert l["kernel"] == "gguf_qmm_mma32_float16_t_q3_K" and l["threadgroups"] == [2, 2, 1]
    (l,) = plan_gguf(1, 4096, 4096, Q5_K, torch.float32)
    assert l["kernel"] == "gguf_qmv_float_q5_K" and l["threadgroups"] == [512, 1, 1]
    assert l["threads_per_threadgroup"] == [64, 1, 1] and l["bytes"] == [{"index": 3, "u32": [1, 4096, 4096, 16]}]
    (l,) = plan_gguf(5, 37, 512, Q5_K, torch.bfloat16)
    assert l["kernel"] == "gguf_qmm_bm8_bfloat16_t_q5_K" and l["threadgroups"] == [5, 1, 1]
    (l,) = plan_gguf(17, 37, 512, Q5_K, torch.float16)
    assert l["kernel"] == "gguf_qmm_mma32_float16_t_q5_K" and l["threadgroups"] == [2, 1, 1]
    (l,) = plan_gguf(1, 4096, 4096, IQ4_XS, torch.float32)
    assert l["kernel"] == "gguf_qmv_float_iq4_XS" and l["threadgroups"] == [512, 1, 1]
    assert l["threads_per_threadgroup"] == [64, 1, 1] and l["bytes"] == [{"index": 3, "u32": [1, 4096, 4096, 16]}]
    (l,) = plan_gguf(4, 37, 512, IQ4_XS, torch.bfloat16)
    assert l["kernel"] == "gguf_qmm_bm4_bfloat16_t_iq4_XS" and l["threadgroups"] == [5, 1, 1]
    (l,) = plan_gguf(33, 37, 512, IQ4_XS, torch.float16)
    assert l["kernel"] == "gguf_qmm_mma32_float16_t_iq4_XS" and l["threadgroups"] == [2, 2, 1]
    assert plan_gguf(0, 37, 512, Q4_K, torch.float32) == [] and plan_gguf(3, 0, 512, Q4_K, torch.float32) == []


def test_plan_gguf_rejects_what_has_no_kernel():
    with pytest.raises(ValueError, match="ggml_type"):
        plan_gguf(1, 8, 256, 8, torch.float32)
    with pytest.raises(ValueError, match="ggml_type"):
        plan_gguf(1, 8, 256, 7, torch.float32)  # Q5_1: converted on load, no kernel
    (l,) = plan_gguf(1, 8, 256, 13, torch.float32)  # Q5_K has kernels
    assert l["kernel"] == "gguf_qmv_float_q5_K"
    (l,) = plan_gguf(1, 8, 256, 23, torch.float32)  # and IQ4_XS
    assert l["kernel"] == "gguf_qmv_float_iq4_XS"
    with pytest.raises(ValueError, match="multiple of 256"):
        plan_gguf(1, 8, 300, Q4_K, torch.float32)


def test_plan_for_gguf_runs_the_cpu_checks():
    blocks, _, x = gguf_case(Q4_K, 2, 3, 512, torch.float32, seed=0)
    for args in ((x, blocks, 7, 3, 512), (x, blocks, int(Q4_K), 4, 512), (x[:, :256], blocks, int(Q4_K), 3, 512),
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
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_batched_strided_x_and_unaligned_blocks(ggml_type):
    from torch_qmm.metalsim import backend

    blocks, w, _ = gguf_case(ggml_type, 1, 9, 512, torch.float32, seed=3)
    x = torch.randn(2, 3, 1024)[..., ::2]  # non-contiguous [2, 3, 512]
    # blocks starting 2 bytes into their storage: the executor re-aligns them for uint32 loads.
    raw = torch.zeros(blocks.numel() + 2, dtype=torch.uint8)
    raw[2:] = blocks.reshape(-1)
    shifted = raw[2:].view(blocks.shape)
    with backend(check=True):
        y = gguf_matmul(x, shifted, int(ggml_type), 9, 512)
    assert y.shape == (2, 3, 9)
    xd = x.reshape(6, 512).double()
    assert_matches_reference(y.reshape(6, 9), xd @ w.T, k_quant_magnitude(xd, blocks, ggml_type), torch.float32,
                             f"batched {ggml_type.name}")


# ---- the sub-block and bit mapping --------------------------------------------------------------

def _sub_block_scales(blocks: np.ndarray, ggml_type) -> np.ndarray:
    """float64 [n, k/256, 16]: each 16-weight sub-block's d*sc, read through gguf's decoder from a
    copy of the blocks with every code set so that w = d*sc (Q2_K: q = 1, dmin = 0) or -4*d*sc
    (Q3_K: low bits 0, high bits 0); asserts the weights of each sub-block agree."""
    _, bb = GGML_QUANT_SIZES[ggml_type]
    raw = blocks.reshape(blocks.shape[0], -1, bb).copy()
    if ggml_type == Q2_K:
        raw[..., 16:80] = 0x55
        raw[..., 82:84] = 0
        div = 1.0
    else:
        raw[..., 0:96] = 0
        div = -4.0
    w = quants.dequantize(raw.reshape(blocks.shape), ggml_type).astype(np.float64) / div
    w = w.reshape(raw.shape[0], raw.shape[1], 16, 16)
    assert (w == w[..., :1]).all()
    return w[..., 0]


def _iq4xs_sub_block_scales(blocks: np.ndarray) -> np.ndarray:
    """float64 [n, k/256, 8]: each IQ4_XS sub-block's d*(l - 32), read through gguf's decoder from a
    copy of the blocks with every code 8 (value 1); asserts the weights of each sub-block agree."""
    raw = blocks.reshape(blocks.shape[0], -1, 136).copy()
    raw[..., 8:] = 0x88
    w = quants.dequantize(raw.reshape(blocks.shape), IQ4_XS).astype(np.float64)
    w = w.reshape(raw.shape[0], raw.shape[1], 8, 32)
    assert (w == w[..., :1]).all()
    return w[..., 0]


@needs_clang
@pytest.mark.parametrize("route", sorted(GGUF_ROUTE_PROBLEMS))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_exact_sums_on_every_route(ggml_type, route):
    """exact_k_blocks / exact_x: every product and partial sum is exact in float32, so y is the
    float64 product rounded once to the dtype, bit for bit. The blocks' codes and sub-block scales
    (Q2_K, Q4_K, Q5_K also mins; Q5_K's fifth bits; IQ4_XS's scales in 28..35) are random bytes, different
    from sub-block to sub-block: a weight read from
    the wrong code bits, or scaled with another sub-block's scale, changes y."""
    from torch_qmm.metalsim import backend, last_launches

    M, N, K = GGUF_ROUTE_PROBLEMS[route]
    rng = np.random.default_rng(40 + int(ggml_type))
    blocks = exact_k_blocks(ggml_type, N, K, rng)
    if ggml_type in NEW_TYPES:
        scales = _sub_block_scales(blocks, ggml_type)
        assert min(len(set(s.tolist())) for s in scales.reshape(-1, 16)) >= 6
    if ggml_type == IQ4_XS:  # scales d*(l - 32), l - 32 in -4..3
        scales = _iq4xs_sub_block_scales(blocks)
        assert min(len(set(s.tolist())) for s in scales.reshape(-1, 8)) >= 3
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    x32 = torch.from_numpy(exact_x(M, K, rng))
    for dtype in DTYPES:
        x = x32.to(dtype)
        with backend():
            y = gguf_matmul(x, torch.from_numpy(blocks), int(ggml_type), N, K)
        (launch,) = last_launches()
        assert launch.route == route
        expect = (x.double() @ w.T).to(dtype)
        assert torch.equal(y, expect), f"{launch.kernel}: {(y.double() - expect.double()).abs().max().item():.3e}"


def _one_hot_blocks(ggml_type, cols: list[int], signs: list[int], k: int,
                    fifth: list[bool] | None = None) -> np.ndarray:
    """gguf_helpers.one_hot_k_blocks (W[n, cols[n]] = 1, every other weight 0; Q3_K: every high
    bit set, codes 4) with W[n, cols[n]] = -1 where signs[n] < 0 (Q3_K only): that weight's code
    3 (low bits 3, its high bit cleared). Weight 128h + 32t + p (p < 32) of a super-block has its
    low bits at bits 2t, 2t+1 of qs[32h + p] and its high bit at bit 4h + t of hmask[p].
    Q5_K rows n with fifth[n]: the 1 comes from the fifth bit alone (d = 2^-4, code 16: low bits 0,
    bit s of qh[p] set for weight 32s + p, sub-block s)."""
    blocks = one_hot_k_blocks(ggml_type, cols, k).reshape(len(cols), k // 256, -1)
    for n, col in enumerate(cols):
        if not (fifth and fifth[n]):
            continue
        assert ggml_type == Q5_K
        b, j = divmod(col, 256)
        s, p = divmod(j, 32)
        blocks[n, :, 0:2] = np.array([2.0**-4], "<f2").view(np.uint8)
        blocks[n, b, 48 + 32 * (s // 2) + p] = 0
        blocks[n, b, 16 + p] = 1 << s
    for n, (col, sign) in enumerate(zip(cols, signs)):
        if sign > 0:
            continue
        assert ggml_type == Q3_K
        b, j = divmod(col, 256)
        h, rest = divmod(j, 128)
        t, p = divmod(rest, 32)
        blocks[n, b, 32 + 32 * h + p] |= 3 << (2 * t)
        blocks[n, b, p] &= ~np.uint8(1 << (4 * h + t))
    return blocks.reshape(len(cols), -1)


@needs_clang
@pytest.mark.parametrize("route", sorted(GGUF_ROUTE_PROBLEMS))
@pytest.mark.parametrize("ggml_type", ONE_HOT_TYPES, ids=lambda t: t.name)
def test_gguf_one_hot_weights_at_every_position(ggml_type, route):
    """Row n of W has one nonzero weight, at position n of a super-block (every one of the 256,
    alternating between the two super-blocks of K = 512): y[:, n] = +-x[:, cols[n]] exactly. A
    wrong code bit, shift, byte, Q3_K high bit (the -1 rows clear exactly the one high bit the
    weight reads) or Q5_K fifth bit (every third row's weight is its fifth bit alone) moves or
    changes the weight."""
    from torch_qmm.metalsim import backend, last_launches

    M, K = GGUF_ROUTE_PROBLEMS[route][0], 512
    cols = [256 * (n % 2) + n for n in range(256)]
    signs = [-1 if ggml_type == Q3_K and n % 3 == 0 else 1 for n in range(256)]
    fifth = [ggml_type == Q5_K and n % 3 == 0 for n in range(256)]
    blocks = _one_hot_blocks(ggml_type, cols, signs, K, fifth)
    w = quants.dequantize(blocks, ggml_type)
    expect_w = np.zeros((256, K), np.float32)
    expect_w[np.arange(256), cols] = signs
    assert np.array_equal(w, expect_w), "the one-hot blocks do not decode as intended"
    for dtype in DTYPES:
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
        with backend():
            y = gguf_matmul(x, torch.from_numpy(blocks), int(ggml_type), 256, K)
        (launch,) = last_launches()
        assert launch.route == route
        expect = x[:, cols] * torch.tensor(signs, dtype=dtype)
        assert torch.equal(y, expect), f"{launch.kernel}: columns {sorted(set((y != expect).nonzero()[:, 1].tolist()))}"


@needs_clang
@pytest.mark.parametrize("route", sorted(GGUF_ROUTE_PROBLEMS))
def test_gguf_q3k_high_bits_all_set_and_all_clear(route):
    """Q3_K blocks with every hmask bit set (q = 4..7: w = d*sc*low) and every one clear (q = 0..3:
    w = d*sc*(low - 4)): a kernel that skips the high bit of any (half, shift) pair is off by
    4*d*sc*x there."""
    M, N, K = GGUF_ROUTE_PROBLEMS[route]
    from torch_qmm.metalsim import backend, last_launches

    base = random_k_blocks(Q3_K, N, K, np.random.default_rng(5))
    for fill in (0xFF, 0x00):
        blocks = base.reshape(N, -1, 110).copy()
        blocks[..., 0:32] = fill
        blocks = blocks.reshape(N, -1)
        w = torch.from_numpy(quants.dequantize(blocks, Q3_K)).double()
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(fill)).to(torch.float32)
        with backend():
            y = gguf_matmul(x, torch.from_numpy(blocks), int(Q3_K), N, K)
        (launch,) = last_launches()
        assert launch.route == route
        assert_matches_reference(y, x.double() @ w.T, k_quant_magnitude(x, blocks, Q3_K), torch.float32,
                                 f"{launch.kernel} hmask {fill:#04x}")


@needs_clang
@pytest.mark.parametrize("route", sorted(GGUF_ROUTE_PROBLEMS))
def test_gguf_q5k_fifth_bits_all_set_all_clear_and_one_at_a_time(route):
    """Q5_K blocks (exact_k_blocks: y exact in float32) with every qh bit clear (q = 0..15), every
    one set (q = 16..31) and, for each bit s of the qh bytes, only that one set (sub-block s's
    codes + 16): a kernel that skips or misplaces the fifth bit of any sub-block is off by
    16*d*sc*x there, and y must equal the rounded float64 product bit for bit."""
    from torch_qmm.metalsim import backend, last_launches

    M, N, K = GGUF_ROUTE_PROBLEMS[route]
    rng = np.random.default_rng(6)
    base = exact_k_blocks(Q5_K, N, K, rng)
    x32 = torch.from_numpy(exact_x(M, K, rng))
    for i, fill in enumerate((0x00, 0xFF) + tuple(1 << s for s in range(8))):
        blocks = base.reshape(N, -1, 176).copy()
        blocks[..., 16:48] = fill
        blocks = blocks.reshape(N, -1)
        w = torch.from_numpy(quants.dequantize(blocks, Q5_K)).double()
        x = x32.to(DTYPES[i % len(DTYPES)])
        with backend():
            y = gguf_matmul(x, torch.from_numpy(blocks), int(Q5_K), N, K)
        (launch,) = last_launches()
        assert launch.route == route
        expect = (x.double() @ w.T).to(x.dtype)
        assert torch.equal(y, expect), (f"{launch.kernel} qh {fill:#04x}: "
                                        f"{(y.double() - expect.double()).abs().max().item():.3e}")


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])  # kIQ4Values


def _iq4xs_blocks(d: np.ndarray, ls: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks uint8 [n, nb * 136] from d [n, nb] (as f16), the 6-bit sub-block scales
    ls [n, nb, 8] (0..63, the weight's factor ls - 32) and the 4-bit codes [n, nb, 256] (weight p of
    the super-block), as metal/gguf_format.h lays them out: d at bytes 0..1; bits 2j, 2j + 1 of
    scales_h (bytes 2..3) the top 2 bits of ls_j, nibble j % 2 of scales_l[j / 2] (bytes 4..7) its
    low 4; the code of weight 32j + 16*nib + l in nibble nib of qs[16j + l] (bytes 8..135)."""
    n, nb = d.shape
    raw = np.zeros((n, nb, 136), np.uint8)
    raw[..., 0:2] = d.astype("<f2")[..., None].view(np.uint8)
    high = sum(((ls[..., j] >> 4) & 3).astype(np.uint16) << (2 * j) for j in range(8))
    raw[..., 2:4] = high.astype("<u2")[..., None].view(np.uint8)
    raw[..., 4:8] = (ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)
    c = codes.reshape(n, nb, 8, 2, 16)  # [sub-block j, nibble, byte l]
    raw[..., 8:] = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(n, nb, 128)
    return raw.reshape(n, -1)


@needs_clang
@pytest.mark.parametrize("route", sorted(GGUF_ROUTE_PROBLEMS))
def test_gguf_iq4xs_every_scale_and_code(route):
    """IQ4_XS W [16, 1024] (64 super-blocks) whose sub-blocks take each of the 64 6-bit scales l
    (every scales_l nibble with every scales_h bit pair) at each of the 8 sub-block indices, and
    whose weights take each of the 16 codes at each of the 256 positions of a super-block (the two
    nibbles of a byte, neighbouring bytes and neighbouring sub-blocks differ), d = +-2^-6 by row;
    the blocks are checked against gguf's decode first. x integers in -4..4: every product is
    2^-6 times an integer of magnitude <= 32 * 127 * 4, and any sum of the 1024 of a row stays
    below 2^24 * 2^-6, so every partial sum is exact in float32 and y must equal the float64 product
    rounded once to the dtype, bit for bit: a misread nibble, byte, scale bit or value changes y."""
    from torch_qmm.metalsim import backend, last_launches

    M, N, K = GGUF_ROUTE_PROBLEMS[route][0], 16, 1024
    nb = K // 256
    pair = np.arange(N)[:, None] * nb + np.arange(nb)[None, :]  # (row, super-block) -> 0..63
    ls = (pair[..., None] + 9 * np.arange(8)) % 64
    p = np.arange(256)
    codes = (pair[..., None] + 5 * p + 3 * (p // 16)) % 16
    for j in range(8):
        assert sorted(ls[..., j].ravel().tolist()) == list(range(64))
    for q in range(256):
        assert set(codes[..., q].ravel().tolist()) == set(range(16))
    c = codes.reshape(N, nb, 8, 2, 16)
    assert (c[..., 0, :] != c[..., 1, :]).all() and (np.diff(codes, axis=-1) != 0).all()
    d = np.where(np.arange(N) % 2 == 0, 2.0**-6, -(2.0**-6))[:, None].repeat(nb, axis=1)
    blocks = _iq4xs_blocks(d, ls, codes)
    expect_w = d[..., None] * (np.repeat(ls, 32, axis=-1) - 32) * IQ4_VALUES[codes]
    w = quants.dequantize(blocks, IQ4_XS)
    assert np.array_equal(w, expect_w.reshape(N, K)), "the IQ4_XS blocks do not decode as intended"
    w = torch.from_numpy(w).double()
    x32 = torch.from_numpy(np.random.default_rng(8).integers(-4, 5, size=(M, K)).astype(np.float32))
    for dtype in DTYPES:
        x = x32.to(dtype)
        with backend():
            y = gguf_matmul(x, torch.from_numpy(blocks), int(IQ4_XS), N, K)
        (launch,) = last_launches()
        assert launch.route == route
        expect = (x.double() @ w.T).to(dtype)
        assert torch.equal(y, expect), f"{launch.kernel}: {(y.double() - expect.double()).abs().max().item():.3e}"


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
