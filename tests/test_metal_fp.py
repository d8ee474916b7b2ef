"""The Metal kernels of MLX's fp modes (metal_helpers.FP_MODES) on metalsim, through the planner, against
things nobody here wrote: mlx.core.quantize / dequantize (bit for bit) and the float64 reference
torch_qmm/reference_fp.py (qmm, with the tolerance of tests/tolerance.py).

W for the qmm cases is quantized by reference_fp.quantize_fp (bit-exact with mlx, checked in
tests/test_reference_fp.py), so a kernel's result is compared with the exact product of the same
codes: |y - y_ref| <= half an ulp of the output dtype + the float32 accumulation bound. Shapes sit
at the routing table's M thresholds, N not a multiple of the tiles (transpose=True) and, for
transpose=False, N a multiple of the group size that is not a multiple of the 32-column tile.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from metal_helpers import DTYPES, FP_MODES, fp_mode_params, metal_run, plan, require_clang
from tolerance import assert_matches_reference
from torch_qmm import reference_fp

pytestmark = pytest.mark.usefixtures("_clang")


@pytest.fixture(scope="module")
def _clang():
    require_clang()


def _weights(rows, cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes (scales across many exponents), a zero group, a group whose
    # values sit on e2m1 midpoints after scaling.
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, rows).reshape(rows, 1)
    w[0, :16] = 0.0
    if rows > 1:
        w[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    return w.to(dtype)


def metal_qmm(x, wq, scales, mode, transpose, check=None, count=False):
    """y = x @ W.T (or x @ W) by the planned Metal kernel on metalsim; returns (y, launch)."""
    bits, gs = fp_mode_params(mode)
    M, K = x.shape
    N = wq.shape[0] if transpose else wq.shape[1] * 32 // bits
    y = torch.zeros(M, N, dtype=x.dtype)
    launches = plan("qmm", M, N, K, bits, gs, x.dtype, transpose, mode)
    (launch,) = metal_run(launches, {"x": x, "wq": wq, "scales": scales, "y": y}, check=check, count=count)
    return y, launch


# (M, N, K, transpose) per route; the K / N multiples of the group size are set per mode.
def _shapes(gs):
    return [
        ("qmv_fast", 1, 64, 512, True),
        ("qmv_bounded", 1, 37, 3 * gs, True),
        ("qmm_t_bm2", 2, 37, 3 * gs, True),
        ("qmm_t_bm4", 3, 37, 3 * gs, True),
        ("qmm_t_bm4", 4, 9, 5 * gs, True),
        ("qmm_t_bm8", 5, 37, 3 * gs, True),
        ("qmm_t_bm8", 8, 37, 3 * gs, True),
        ("qmm_t_mma16", 9, 37, 3 * gs, True),
        ("qmm_t_mma16", 16, 33, 3 * gs, True),
        ("qmm_t_mma32", 17, 37, 3 * gs, True),
        ("qmm_t_mma32", 33, 65, 5 * gs, True),
        ("qvm_bounded", 1, 3 * gs, 45, False),
        ("qvm_bounded", 3, 17 * gs, 33, False),
        ("qmm_n_mma32", 4, 3 * gs, 45, False),
        ("qmm_n_mma32", 33, 5 * gs, 31, False),
    ]


QMM_CASES = [(mode, i, dtype) for mode in FP_MODES for i in range(len(_shapes(16))) for dtype in DTYPES]


def _qmm_id(case):
    mode, i, dtype = case
    route, M, N, K, t = _shapes(fp_mode_params(mode)[1])[i]
    return f"{mode}-{route}-M{M}-N{N}-K{K}-{'T' if t else 'N'}-{str(dtype).split('.')[1]}"


def _case_weights(case, seed):
    """The route a case expects, its shape, and its weights quantized in its mode."""
    mode, i, dtype = case
    route, M, N, K, transpose = _shapes(fp_mode_params(mode)[1])[i]
    rows, cols = (N, K) if transpose else (K, N)
    wq, scales = reference_fp.quantize_fp(_weights(rows, cols, dtype, seed), mode)
    return route, M, N, K, transpose, wq, scales


def _run_qmm_case(case, check=None):
    mode, i, dtype = case
    seed = 7 * i + len(mode)
    route, M, N, K, transpose, wq, scales = _case_weights(case, seed)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    y, launch = metal_qmm(x, wq, scales, mode, transpose, check=check)
    y_ref = reference_fp.qmm_fp(x, wq, scales, mode, transpose=transpose)
    magnitude = reference_fp.qmm_fp_magnitude(x, wq, scales, mode, transpose=transpose)
    assert_matches_reference(y, y_ref, magnitude, dtype, f"{launch.kernel} M={M} N={N} K={K}")
    assert launch.route == route, f"{_qmm_id(case)}: the plan chose {launch.route}"
    assert set(launch.buffers.values()) == {"x", "wq", "scales", "y"}, "fp modes bind no biases"


@pytest.mark.parametrize("mode", FP_MODES)
def test_fp_quantize_and_dequantize_equal_mlx_without_checked_mode(mode):
    # First in the file and small (the full bit-for-bit cases, in checked mode, are below): the
    # edge groups in float32 and bfloat16, quantized and dequantized by the kernels, against mlx.
    import mlx.core as mx

    bits, gs = fp_mode_params(mode)
    for dtype in (torch.float32, torch.bfloat16):
        w = _edge_weights(mode, dtype, seed=len(mode))
        wq, scales = metal_quantize(w, mode)
        mwq, mscales = mx.quantize(_mx(w), group_size=gs, bits=bits, mode=mode)
        assert torch.equal(wq.view(torch.int32), torch.from_numpy(np.array(mwq)).view(torch.int32)), dtype
        assert torch.equal(scales, torch.from_numpy(np.array(mscales))), dtype
        for out in (torch.float32, torch.bfloat16):
            got = metal_dequantize(wq, scales, mode, out)
            want = _from_mx(mx.dequantize(mwq, mscales, group_size=gs, bits=bits, mode=mode, dtype=_mx_dtype(out)), out)
            assert torch.equal(_bits(got), _bits(want)), (dtype, out)


@pytest.mark.parametrize("case", QMM_CASES, ids=_qmm_id)
def test_fp_qmm_route_matches_reference(case):
    _run_qmm_case(case)


# Checked mode (out-of-bounds, races, unwritten threadgroup reads, barrier divergence): every
# route of each mode once, dtypes rotating.
@pytest.mark.parametrize("case", [c for c in QMM_CASES if DTYPES.index(c[2]) == c[1] % len(DTYPES)], ids=_qmm_id)
def test_fp_qmm_route_runs_clean_in_checked_mode(case):
    _run_qmm_case(case, check=True)


def test_every_route_is_reached_for_every_fp_mode():
    from metal_helpers import routes

    want = {r["route"] for r in routes() if r["op"] == "qmm"}
    assert want == {s[0] for s in _shapes(16)}
    for r in routes():
        if r["op"] in ("qmm", "quantize", "dequantize"):
            assert set(FP_MODES) <= set(r["formats"]), r


def test_non_finite_scales_propagate_as_through_the_dequantized_weights():
    """An e8m0 byte of 255 is 2^128, +inf in float32 (as mx.dequantize decodes it): its group's
    weights are +-inf, and NaN for code 0. y is NaN / inf exactly where F.linear on those float32
    weights puts NaN / inf (the kernels fall back to weight-by-weight sums there)."""
    mode = "mxfp4"
    for M, transpose in ((1, True), (3, True), (40, True), (2, False), (33, False)):
        rows, cols = (8, 64) if transpose else (64, 64)
        wq, scales = reference_fp.quantize_fp(_weights(rows, cols, torch.float32, 3), mode)
        scales[2, 1] = 255
        x = torch.randn(M, 64)
        y, launch = metal_qmm(x, wq, scales, mode, transpose)
        w = reference_fp.dequantize_fp(wq, scales, mode, dtype=torch.float32).double()
        y_ref = x.double() @ (w.T if transpose else w)
        assert y_ref.isnan().any() and torch.equal(y.isnan(), y_ref.isnan()), launch.kernel
        assert torch.equal(y.isinf(), y_ref.isinf()), launch.kernel


# ---- quantize / dequantize: bit for bit with mlx ---------------------------------------------------

def _edge_weights(mode, dtype, seed):
    bits, gs = fp_mode_params(mode)
    rows, cols = 9, 4 * gs
    w = _weights(rows, cols, dtype, seed).float()
    w[2, :gs] = 6.0 * 2.0 ** torch.arange(-4, gs - 4).clamp(max=8).float()  # values near each format's max
    w[3, :gs] = torch.where(torch.arange(gs) % 2 == 0, 1e-3, 5e2).float()   # mixed magnitudes in one group
    tiny = {torch.float32: 1e-40, torch.float16: 3e-6, torch.bfloat16: 1e-39}[dtype]
    w[4, :gs] = tiny * torch.linspace(-1, 1, gs)  # subnormals of the dtype
    w[5, :gs] = -0.0
    w[6, :gs] = 448.0 * torch.linspace(-1.1, 1.1, gs)
    return w.to(dtype)


def metal_quantize(w, mode, check=None):
    bits, gs = fp_mode_params(mode)
    N, K = w.shape
    wq = torch.zeros(N, K * bits // 32, dtype=torch.uint32)
    scales = torch.zeros(N, K // gs, dtype=torch.uint8)
    (launch,) = metal_run(plan("quantize", 0, N, K, bits, gs, w.dtype, True, mode),
                          {"w": w.contiguous(), "wq": wq, "scales": scales}, check=check)
    assert launch.route == "quantize" and set(launch.buffers.values()) == {"w", "wq", "scales"}
    return wq, scales


def metal_dequantize(wq, scales, mode, dtype, check=None):
    bits, gs = fp_mode_params(mode)
    N, K = wq.shape[0], wq.shape[1] * 32 // bits
    w = torch.zeros(N, K, dtype=dtype)
    (launch,) = metal_run(plan("dequantize", 0, N, K, bits, gs, dtype, True, mode),
                          {"wq": wq, "scales": scales, "w": w}, check=check)
    assert launch.route == "dequantize"
    return w


def _mx(t):
    import mlx.core as mx

    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def _from_mx(a, dtype):
    import mlx.core as mx

    if dtype == torch.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _bits(t):
    """The bit patterns of t, with every NaN as one pattern: a NaN's sign and payload (inf * 0 here, a
    scale of 2^128 times code 0) is the hardware's default NaN, not part of the format."""
    bits = t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])
    return torch.where(t.isnan(), torch.full_like(bits, -1), bits)


@pytest.mark.parametrize("mode,dtype", itertools.product(FP_MODES, DTYPES))
def test_fp_quantize_equals_mlx_bit_for_bit(mode, dtype):
    mx = pytest.importorskip("mlx.core")
    bits, gs = fp_mode_params(mode)
    w = _edge_weights(mode, dtype, seed=len(mode))
    wq, scales = metal_quantize(w, mode, check=dtype == torch.float16)
    mwq, mscales = mx.quantize(_mx(w), group_size=gs, bits=bits, mode=mode)
    assert torch.equal(wq.view(torch.int32), torch.from_numpy(np.array(mwq)).view(torch.int32)), "codes differ from mlx"
    assert torch.equal(scales, torch.from_numpy(np.array(mscales))), "scale bytes differ from mlx"
    for out in DTYPES:
        got = metal_dequantize(wq, scales, mode, out, check=out == torch.bfloat16)
        want = _from_mx(mx.dequantize(mwq, mscales, group_size=gs, bits=bits, mode=mode, dtype=_mx_dtype(out)), out)
        assert torch.equal(_bits(got), _bits(want)), f"dequantize to {out} differs from mlx"


def _mx_dtype(dtype):
    import mlx.core as mx

    return {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[dtype]


@pytest.mark.parametrize("mode", FP_MODES)
def test_fp_quantize_equals_the_reference_on_random_weights(mode):
    """Many groups of random magnitudes (every scale code path), float32 and bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) *
             torch.logspace(-6, 6, 64).reshape(64, 1)).to(dtype)
        wq, scales = metal_quantize(w, mode)
        rwq, rscales = reference_fp.quantize_fp(w, mode)
        assert torch.equal(wq.view(torch.int32), rwq.view(torch.int32)) and torch.equal(scales, rscales)


@pytest.mark.parametrize("mode", FP_MODES)
def test_fp_ops_run_on_metalsim_through_the_public_api(mode):
    """torch_qmm.quantize / dequantize / quantized_matmul with mode= under backend(): the Metal
    kernels run (the launches say which), with the CPU ops' results (bit for bit: quantize,
    dequantize; qmm within the tolerance rule against the float64 reference)."""
    import torch_qmm
    from torch_qmm.formats import FORMATS
    from torch_qmm.metalsim import backend, last_launches

    if mode not in FORMATS:
        pytest.skip(f"mode {mode!r} is not in the format table yet")
    w = _weights(40, 128, torch.float16, 9)
    wq, scales = torch_qmm.quantize(w, mode=mode)  # CPU op
    x = torch.randn(2, 3, 128).half()
    with backend(check=True):
        mwq, mscales = torch_qmm.quantize(w, mode=mode)
        assert [l.route for l in last_launches()] == ["quantize"]
        deq = torch_qmm.dequantize(wq, scales, mode=mode)
        assert [l.route for l in last_launches()] == ["dequantize"] and deq.dtype == torch.bfloat16
        y = torch_qmm.quantized_matmul(x, wq, scales, mode=mode)
        assert [l.route for l in last_launches()] == ["qmm_t_bm8"]
        with pytest.raises(ValueError, match="biases"):
            torch_qmm.quantized_matmul(x, wq, scales, torch.zeros(40, 128 // fp_mode_params(mode)[1]).half(), mode=mode)
    assert torch.equal(mwq.view(torch.int32), wq.view(torch.int32)) and torch.equal(mscales, scales)
    assert torch.equal(_bits(deq), _bits(torch_qmm.dequantize(wq, scales, mode=mode)))
    y_ref = reference_fp.qmm_fp(x.reshape(6, 128), wq, scales, mode)
    magnitude = reference_fp.qmm_fp_magnitude(x.reshape(6, 128), wq, scales, mode)
    assert y.shape == (2, 3, 40)
    assert_matches_reference(y.reshape(6, 40), y_ref, magnitude, torch.float16, f"{mode} through the API")


# Sparse x with every bit of float32 (tests/tolerance.py sparse_x): each output sums a few
# products, so every route must be within a few roundings of the terms, far below ACC_RTOL: x read
# as half or a decoded weight or scale kept narrow fails. Each route shape once, modes rotating.
SPARSE_CASES = [(FP_MODES[i % len(FP_MODES)], i, torch.float32) for i in range(len(_shapes(16)))]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=_qmm_id)
def test_fp_qmm_route_sums_sparse_x_within_a_few_roundings(case):
    from tolerance import assert_within_few_roundings, sparse_x

    mode, i, dtype = case
    seed = 5 * i + len(mode)
    route, M, N, K, transpose, wq, scales = _case_weights(case, seed)
    values = min(4, max(1, K // 32))
    x = sparse_x(M, K, values, 32 if K >= 32 else K, dtype, seed)
    y, launch = metal_qmm(x, wq, scales, mode, transpose)
    assert launch.route == route
    assert_within_few_roundings(y, reference_fp.qmm_fp(x, wq, scales, mode, transpose=transpose),
                                reference_fp.qmm_fp_magnitude(x, wq, scales, mode, transpose=transpose), dtype,
                                values, f"{launch.kernel} M={M} N={N} K={K}")
