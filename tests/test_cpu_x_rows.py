"""The one pass over x that every CPU op makes before routing (csrc/cpu/x_rows.cpp): x converted
to float32 and checked for what the routes need (finite; in the chunk kernels' range, nonzero |x|
in [2^-98, 2^100]), split over the threads in items of 8192 values. A value that keeps a call off
the fast kernels must be found wherever it lies: in the first item, one in the middle, or the last
value of x; and x of 16-bit dtypes must be checked after their conversion.

Each case asks the op's route function, then checks the result against the float64 reference
(the route a call takes changes how it rounds, never what it computes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

import torch_qmm
from cpu_features import affine_chunk_route
from gguf_helpers import Q4_K, expected_gguf_route, k_quant_magnitude, random_k_blocks
from tolerance import assert_matches_reference
from torch_qmm import reference

M, K = 3, 16384  # 49152 values of x: six items of the pass
N = 20
# Where the value goes: the first item, an item in the middle, the last value of x.
PLACES = {"first": (0, 5), "middle": (1, 9000), "last": (M - 1, K - 1)}
# 2^-99 (below 2^-98, a float32 and bfloat16 value), 2^101 and Inf: out of the chunk kernels' range.
BAD = {torch.float32: [2.0**-99, 2.0**101, float("inf")], torch.bfloat16: [2.0**-99, 2.0**101, float("inf")],
       torch.float16: [float("inf")]}  # float16 holds nothing outside [2^-98, 2^100] but Inf and NaN
CASES = [(dtype, bad, place) for dtype, bads in BAD.items() for bad in bads for place in PLACES]


def _x(dtype, bad=None, place=None) -> torch.Tensor:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    if bad is not None:
        x[PLACES[place]] = bad
    return x


def _id(case) -> str:
    dtype, bad, place = case
    return f"{str(dtype).removeprefix('torch.')}-{bad:g}-{place}"


@pytest.fixture(scope="module")
def affine_w():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4))
    return torch_qmm.quantize(w, group_size=64, bits=4)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_affine_route_finds_x_out_of_range_anywhere(case, affine_w):
    dtype, bad, place = case
    wq, s, b = (t.to(dtype) if t.is_floating_point() else t for t in affine_w)
    clean = torch.ops.torch_qmm._cpu_route(_x(dtype), wq, s, b, 4, 64, True)
    expected_clean = affine_chunk_route(4, {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3), M, K)
    if expected_clean is None:
        pytest.skip("no chunk kernel serves these operands on this CPU: nothing to route away from")
    assert clean == expected_clean
    x = _x(dtype, bad, place)
    assert torch.ops.torch_qmm._cpu_route(x, wq, s, b, 4, 64, True) == "fused"
    if bad != float("inf"):  # finite x: the result against the reference
        y = torch.ops.torch_qmm.affine_qmm(x, wq, s, b, 4, 64, True)
        y_ref = reference.qmm(x, wq, s, b, 4, 64, True)
        assert_matches_reference(y, y_ref, reference.qmm_magnitude(x, wq, s, b, 4, 64, True), dtype, place)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gguf_route_finds_x_out_of_range_anywhere(case):
    dtype, bad, place = case
    raw = random_k_blocks(Q4_K, N, K, np.random.default_rng(5))
    blocks = torch.from_numpy(raw)
    assert torch.ops.torch_qmm._gguf_cpu_route(_x(dtype), blocks, int(Q4_K), N, K) == expected_gguf_route(dtype, M, Q4_K)
    x = _x(dtype, bad, place)
    route = torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(Q4_K), N, K)
    assert route == expected_gguf_route(dtype, M, Q4_K, x_in_range=False) == "fused"
    if bad != float("inf"):
        y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(Q4_K), N, K)
        w = torch.from_numpy(quants.dequantize(raw, Q4_K)).double()
        assert_matches_reference(y, x.double() @ w.T, k_quant_magnitude(x, raw, Q4_K), dtype, f"{route} {place}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("place", list(PLACES))
def test_int8_routes_find_nan_anywhere(dtype, place, affine_w):
    """The int8 paths take finite x only; NaN anywhere sends the call to the exact kernels."""
    wq, s, b = (t.to(dtype) if t.is_floating_point() else t for t in affine_w)
    blocks = torch.from_numpy(random_k_blocks(Q4_K, N, K, np.random.default_rng(6)))
    ops = torch.ops.torch_qmm
    assert ops._cpu_route_int8_activations(_x(dtype), wq, s, b, "affine", 4, 64).startswith("int8x/")
    assert ops._gguf_cpu_route_int8_activations(_x(dtype), blocks, int(Q4_K), N, K).startswith("int8x/")
    x = _x(dtype, float("nan"), place)
    assert ops._cpu_route_int8_activations(x, wq, s, b, "affine", 4, 64) == "exact"
    assert ops._gguf_cpu_route_int8_activations(x, blocks, int(Q4_K), N, K) == "exact"


def test_x_of_16_bits_enters_the_kernels_exactly():
    """bfloat16 / float16 x converted in the pass: every value, including subnormals of float16,
    meets the weights as itself. Weights 1 and -2 on 128 columns, x multiples of 2^-3 (row 0 of
    float16 x: the subnormal 2^-20): every product and partial sum is exact in float32, so the
    result is the float64 product rounded once to x's dtype, bit for bit."""
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randint(-8, 9, (M, K), generator=torch.Generator().manual_seed(7)) * 2.0**-3).to(dtype)
        if dtype == torch.float16:
            x[0, :128] = torch.tensor(2.0**-20, dtype=dtype)  # subnormal float16
        w = torch.zeros(N, K)
        w[:, :64] = 1.0
        w[:, 64:128] = -2.0
        wq, s, b = torch_qmm.quantize(w.to(dtype), group_size=64, bits=4)
        w64 = reference.dequantize(wq, s, b, 4, 64).double()
        assert torch.equal(w64, w.double()), "the premise: these weights quantize exactly"
        y = torch.ops.torch_qmm.affine_qmm(x, wq, s, b, 4, 64, True)
        expected = (x.double() @ w64.T).to(dtype)
        assert torch.equal(y, expected), f"{dtype}: {(y.double() - expected.double()).abs().max()}"



# Rows of x far below 2^-98 that the chunk kernels lose (scaled down by their multipliers, float32;
# flushed as subnormals by vdpbf16ps, bfloat16) while the fused / GEMM kernels keep them: values in
# [LOW, 2 LOW), nonzero products of float32 normal range with the weights here.
LOW = {torch.float32: 2.0**-125, torch.bfloat16: 2.0**-129}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("row", [1, 3])
def test_gather_finds_x_out_of_range_in_any_row_of_a_pair(dtype, row):
    """gather_qmm checks x's range per group of pairs (one flag per matrix taken) over every row of
    every pair in the group: here each pair has its own matrix and M = 4 rows, and one row of pair 1
    (not its first) is all far below 2^-98. The result against the float64 reference, each row held
    to its own magnitude (tests/tolerance.py: float32's absolute term is 2^-150)."""
    E, Mg, Ng, Kg = 3, 4, 20, 512
    g = torch.Generator().manual_seed(11)
    wq, s, b = torch_qmm.quantize(torch.randn(E, Ng, Kg, generator=g), group_size=64, bits=4)
    s, b = s.to(dtype), b.to(dtype)
    x = torch.randn(E, Mg, Kg, generator=g)
    x[1, row] = (1 + torch.rand(Kg, generator=g)) * LOW[dtype]
    x = x.to(dtype)
    y = torch_qmm.gather_qmm(x, wq, s, b, rhs_indices=torch.arange(E), group_size=64, bits=4)
    for p in range(E):
        args = (wq[p], s[p], b[p], 4, 64, True)
        assert_matches_reference(y[p], reference.qmm(x[p], *args), reference.qmm_magnitude(x[p], *args), dtype,
                                 f"pair {p}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_strided_x_of_16_bits_is_converted_row_by_row(dtype, affine_w):
    """16-bit x is converted in the pass from its elements in [M, K] order whatever its strides: a
    transposed x (stride 1 along M) and one stepped along K, for qmm and gguf_qmm, against the
    float64 reference."""
    wq, s, b = (t.to(dtype) if t.is_floating_point() else t for t in affine_w)
    raw = random_k_blocks(Q4_K, N, K, np.random.default_rng(8))
    w_gguf = torch.from_numpy(quants.dequantize(raw, Q4_K)).double()
    g = torch.Generator().manual_seed(9)
    for what, x in (("transposed", torch.randn(K, M, generator=g).to(dtype).t()),
                    ("stepped", torch.randn(M, 2 * K, generator=g).to(dtype)[:, ::2])):
        assert not x.is_contiguous()
        y = torch.ops.torch_qmm.affine_qmm(x, wq, s, b, 4, 64, True)
        assert_matches_reference(y, reference.qmm(x, wq, s, b, 4, 64, True),
                                 reference.qmm_magnitude(x, wq, s, b, 4, 64, True), dtype, f"qmm {what}")
        y = torch.ops.torch_qmm.gguf_qmm(x, torch.from_numpy(raw), int(Q4_K), N, K)
        assert_matches_reference(y, x.double() @ w_gguf.T, k_quant_magnitude(x, raw, Q4_K), dtype, f"gguf {what}")
