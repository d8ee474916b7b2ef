"""The Metal kernels (metal/) on metalsim, through the planner and the metalsim executor,
against the float64 reference (qmm) and the CPU ops (quantize / dequantize: bit-exact)."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_qmm
from tolerance import assert_matches_reference
from metal_helpers import (
    BITS,
    DTYPES,
    GROUPS,
    ROUTE_PROBLEMS,
    assert_matches_reference,
    qmm_case,
    reference_and_magnitude,
    require_clang,
    weights,
)

pytestmark = pytest.mark.usefixtures("_clang")


@pytest.fixture(scope="module")
def _clang():
    require_clang()


def _backend(**kw):
    from torch_qmm.metalsim import backend

    return backend(**kw)


def _last():
    from torch_qmm.metalsim import last_launches

    return last_launches()


def _mlx_quantize(w, group_size, bits):
    import mlx.core as mx
    import numpy as np

    a = mx.array(w.float().numpy())
    if w.dtype != torch.float32:
        a = a.astype(mx.bfloat16 if w.dtype == torch.bfloat16 else mx.float16)
    out = mx.quantize(a, group_size=group_size, bits=bits)

    def to_torch(t):
        if t.dtype == mx.bfloat16:
            return torch.from_numpy(np.array(t.view(mx.uint16))).view(torch.bfloat16)
        return torch.from_numpy(np.array(t))

    return [to_torch(t) for t in out]


def _mlx_dequantize(parts, group_size, bits):
    import mlx.core as mx
    import numpy as np

    def to_mx(t):
        if t.dtype == torch.bfloat16:
            return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
        return mx.array(t.view(torch.int32).numpy()).view(mx.uint32) if t.dtype == torch.uint32 else mx.array(t.numpy())

    out = mx.dequantize(*(to_mx(t) for t in parts), group_size=group_size, bits=bits)
    if out.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(out.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(out))


def _rounding_edges(rows, cols, dtype, seed):
    """Weights whose groups meet each branch of affine quantization: ties at half a step, a
    constant and a zero group, a negative extreme, one non-zero value, a range near the scale's
    floor, large and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[0, :32] = torch.cat([torch.tensor([0.0, 15.0]), torch.arange(30) % 15 + 0.5])  # 4 bits: scale -1, bias 15, ties
    w[1, :32] = 0.75
    w[2, :32] = 0.0
    w[3, :32] = torch.linspace(-5.0, 1.0, 32)
    w[4, :32] = 0.0
    w[4, 7] = -2.5
    w[5, :32] = 1.0 + torch.arange(32) * 2.0**-20  # range ~3e-5: near the floor of the scale
    w[6, :32] = torch.randn(32, generator=g) * 1e4
    w[7, :32] = torch.randn(32, generator=g) * 1e-6
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_affine_quantize_on_metalsim_equals_mlx_bit_for_bit(dtype):
    # First in the file and small: every bit width and group size in one metalsim library build,
    # against mlx.core.quantize (not against our CPU op).
    for bits, group_size in itertools.product(BITS, GROUPS):
        if dtype != torch.float32 and group_size != 64:
            continue
        w = _rounding_edges(9, 256, dtype, seed=bits)
        with _backend():
            got = torch_qmm.quantize(w, group_size=group_size, bits=bits)
        want = _mlx_quantize(w, group_size, bits)
        for name, g, m in zip(("wq", "scales", "biases"), got, want):
            assert g.dtype == m.dtype and torch.equal(g.view(torch.uint8), m.view(torch.uint8)), \
                f"{name} differs from mlx (bits={bits}, group_size={group_size}, {dtype})"
        with _backend():
            deq = torch_qmm.dequantize(*want, group_size=group_size, bits=bits)
            assert _last()[0].route == "dequantize"
        assert deq.dtype == dtype and torch.equal(deq.view(torch.uint8), _mlx_dequantize(want, group_size, bits).view(
            torch.uint8)), f"dequantize differs from mlx (bits={bits}, group_size={group_size}, {dtype})"


def run_qmm(M, N, K, bits, gs, dtype, transpose, seed, check=None):
    x, wq, s, b = qmm_case(M, N, K, bits, gs, dtype, transpose, seed)
    with _backend(check=check):
        y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=gs, bits=bits)
    (launch,) = _last()
    y_ref, mag = reference_and_magnitude(x, wq, s, b, bits, gs, transpose)
    assert_matches_reference(y, y_ref, mag, dtype, f"{launch.kernel} M={M} N={N} K={K}")
    return launch


# The M values of the sweep; every (bits, group size, dtype, transpose) cell runs M = 1 and
# three of the others, rotating so that each M meets many cells (all M x all cells would take
# ~10 minutes of emulation for little extra coverage).
MS = (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 129)
CELLS = list(itertools.product(BITS, GROUPS, DTYPES, (True, False)))


@pytest.mark.parametrize("cell", range(len(CELLS)), ids=lambda i: "b{}-gs{}-{}-{}".format(
    CELLS[i][0], CELLS[i][1], str(CELLS[i][2]).split(".")[1], "T" if CELLS[i][3] else "N"))
def test_qmm_on_metalsim_matches_reference(cell):
    bits, gs, dtype, transpose = CELLS[cell]
    ms = [1] + [MS[(3 * cell + j) % len(MS)] for j in range(3)]
    # Odd N (transpose=True: any N) or odd K (transpose=False: any K); the other dimension a
    # multiple of the group size that is not a multiple of the K-block or tile.
    N, K = (37, 3 * gs) if transpose else (3 * gs, 45)
    for i, M in enumerate(ms):
        run_qmm(M, N, K, bits, gs, dtype, transpose, seed=cell * 16 + i)
    if transpose:  # the aligned M = 1 fast path, two K-blocks
        launch = run_qmm(1, 64, 2 * (512 if bits <= 5 else 256), bits, gs, dtype, True, seed=cell)
        assert launch.route == "qmv_fast"


@pytest.mark.parametrize("route", sorted(r for r, p in ROUTE_PROBLEMS.items() if p[0] == "qmm"))
def test_every_qmm_route_runs_and_matches_reference(route):
    op, M, N, K, transpose = ROUTE_PROBLEMS[route]
    for bits, dtype in ((4, torch.float16), (3, torch.bfloat16), (6, torch.float32)):
        if route == "qmv_fast":
            K = 512 if bits <= 5 else 256
        launch = run_qmm(M, N, K, bits, 64, dtype, transpose, seed=bits)
        assert launch.route == route


def test_batched_and_strided_x():
    x, wq, s, b = qmm_case(6, 40, 128, 4, 64, torch.float16, True, seed=3)
    x3 = torch.randn(2, 3, 256, dtype=torch.float16)[..., ::2]  # non-contiguous [2, 3, 128]
    with _backend():
        y = torch_qmm.quantized_matmul(x3, wq, s, b, group_size=64, bits=4)
    assert y.shape == (2, 3, 40)
    y_ref, mag = reference_and_magnitude(x3.reshape(6, 128), wq, s, b, 4, 64, True)
    assert_matches_reference(y.reshape(6, 40), y_ref, mag, torch.float16, "batched")


def test_x_with_storage_offset_is_bound_with_its_offset():
    _, wq, s, b = qmm_case(1, 24, 64, 4, 32, torch.float32, True, seed=5)
    big = torch.randn(3, 64)
    x = big[1:3]  # contiguous view starting 256 bytes into its storage
    with _backend():
        y = torch_qmm.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    y_ref, mag = reference_and_magnitude(x, wq, s, b, 4, 32, True)
    assert_matches_reference(y, y_ref, mag, torch.float32, "offset")


def test_bad_arguments_raise_the_cpu_errors():
    x, wq, s, b = qmm_case(2, 16, 64, 4, 32, torch.float32, True, seed=1)
    for bad in (dict(x=x[:, :32]), dict(x=x.half()), dict(bits=7)):
        args = dict(x=x, wq=wq, s=s, b=b, bits=4)
        args.update(bad)
        call = lambda: torch.ops.torch_qmm.affine_qmm(args["x"], args["wq"], args["s"], args["b"], args["bits"], 32)  # noqa: E731
        with pytest.raises((ValueError, TypeError)) as cpu:
            call()
        with _backend(), pytest.raises(cpu.type) as sim:
            call()
        assert str(sim.value).splitlines()[0] == str(cpu.value).splitlines()[0]
    with _backend(), pytest.raises(ValueError, match="NaN or Inf"):
        torch_qmm.quantize(torch.full((2, 32), float("nan")), group_size=32, bits=4)


def _edge_weights(rows, cols, dtype, seed):
    w = weights(rows, cols, dtype, seed).float()
    w[0, :32] = 0.75  # constant group
    w[1, :32] = 0.0  # zero group
    w[2, :32] = torch.linspace(-5.0, 1.0, 32)  # negative extreme dominates
    w[3, :32] = 0.0
    w[3, 7] = -2.5  # single non-zero value
    return w.to(dtype)


@pytest.mark.parametrize("bits,group_size,dtype", itertools.product(BITS, GROUPS, DTYPES))
def test_quantize_and_dequantize_on_metalsim_equal_the_cpu_ops(bits, group_size, dtype):
    w = _edge_weights(11, group_size * 3, dtype, seed=bits + group_size)
    wq, s, b = torch_qmm.quantize(w, group_size=group_size, bits=bits)
    deq = torch_qmm.dequantize(wq, s, b, group_size=group_size, bits=bits)
    with _backend():
        mwq, ms, mb = torch_qmm.quantize(w, group_size=group_size, bits=bits)
        assert _last()[0].route == "quantize"
        mdeq = torch_qmm.dequantize(wq, s, b, group_size=group_size, bits=bits)
        assert _last()[0].route == "dequantize"
    assert torch.equal(mwq.view(torch.int32), wq.view(torch.int32)), "packed words differ from the CPU op"
    assert torch.equal(ms, s) and torch.equal(mb, b), "scales/biases differ from the CPU op"
    assert torch.equal(mdeq, deq), "dequantized weights differ from the CPU op"
    # and from mlx.core.dequantize (s*q rounded to the dtype, then s*q + b), bit for bit
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    def to_mx(t):
        return mx.array(t.float().numpy()).astype(mx.bfloat16) if t.dtype == torch.bfloat16 else mx.array(t.numpy())

    theirs = mx.dequantize(to_mx(wq), to_mx(s), to_mx(b), group_size=group_size, bits=bits).astype(mx.float32)
    int_of = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    theirs = torch.from_numpy(np.array(theirs)).to(dtype)  # exact: the values are of `dtype`
    assert torch.equal(mdeq.view(int_of), theirs.view(int_of)), "dequantized weights differ from mlx"


def test_quantize_keeps_leading_dimensions():
    w = weights(6, 64, torch.float32, seed=2).reshape(2, 3, 64)
    with _backend():
        wq, s, b = torch_qmm.quantize(w, group_size=32, bits=4)
    assert wq.shape == (2, 3, 8) and s.shape == (2, 3, 2)


# Checked mode (out-of-bounds, races, unwritten threadgroup reads, barrier divergence): every
# route, for a bit width per packing scheme (word-aligned 4, stream 3/5) and each dtype once.
@pytest.mark.parametrize(
    "route,bits,dtype",
    [(r, b, d) for r in sorted(ROUTE_PROBLEMS) for b, d in ((4, torch.float16), (5, torch.bfloat16), (3, torch.float32))],
)
def test_kernels_run_clean_in_checked_mode(route, bits, dtype):
    op, M, N, K, transpose = ROUTE_PROBLEMS[route]
    if route == "qmv_fast":
        K = 512
    if op == "qmm":
        assert run_qmm(M, N, K, bits, 64, dtype, transpose, seed=11, check=True).route == route
        return
    w = _edge_weights(N, K, dtype, seed=4)
    with _backend(check=True):
        if op == "quantize":
            wq, s, b = torch_qmm.quantize(w, group_size=64, bits=bits)
            assert torch.equal(wq.view(torch.int32), torch_qmm.quantize(w, group_size=64, bits=bits)[0].view(torch.int32))
        else:
            wq, s, b = torch_qmm.quantize(w, group_size=64, bits=bits)  # (runs on metalsim too)
            out = torch_qmm.dequantize(wq, s, b, group_size=64, bits=bits)
            assert torch.equal(out, torch_qmm.dequantize(wq, s, b, group_size=64, bits=bits))
    assert _last()[0].route == route


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0]


def test_bad_arguments_of_every_mode_raise_the_cpu_errors():
    # Each bad call of tests/test_fakes.py (qmm, dequantize, quantize in every mode) refused by the
    # planner's checks exactly as by the CPU kernels: same type, same message.
    from test_fakes import _mode_bad_cases
    from torch_qmm.formats import FORMATS

    ops = torch.ops.torch_qmm
    for mode in FORMATS:
        for name, (op, args) in sorted(_mode_bad_cases(mode).items()):
            if op not in (ops.qmm, ops.dequantize, ops.quantize):
                continue
            with pytest.raises((ValueError, TypeError)) as cpu:
                op(*args)
            with _backend(), pytest.raises(cpu.type) as sim:
                op(*args)
            assert _first_line(sim.value) == _first_line(cpu.value), f"{mode} {name}"


def test_affine_dequantize_to_another_dtype_is_refused_on_metal():
    # The affine kernels compute in the scales' dtype; another result dtype is refused, not converted.
    wq, s, b = torch_qmm.quantize(torch.randn(8, 64).half(), group_size=32, bits=4)
    with _backend(), pytest.raises(ValueError, match=r"dequantize: argument 'dtype' must be the scales' dtype "
                                                     r"\(Half\) for mode 'affine' on Metal, got Float"):
        torch_qmm.dequantize(wq, s, b, group_size=32, bits=4, dtype=torch.float32)
    with _backend():
        same = torch_qmm.dequantize(wq, s, b, group_size=32, bits=4, dtype=torch.float16)
    assert torch.equal(same, torch_qmm.dequantize(wq, s, b, group_size=32, bits=4))


def test_quantize_of_a_group_range_past_float32_is_refused_as_on_cpu():
    # Finite weights whose max - min overflows float32: affine's scale would be Inf (refused on
    # every backend with one message); the fp modes have no range and quantize them as the CPU op.
    w = torch.zeros(2, 32)
    w[1, 0], w[1, 1] = 3e38, -3e38
    with pytest.raises(ValueError) as cpu:
        torch_qmm.quantize(w, group_size=32, bits=4)
    with _backend(), pytest.raises(ValueError) as sim:
        torch_qmm.quantize(w, group_size=32, bits=4)
    assert "exceeds the float32 maximum" in _first_line(cpu.value)
    assert _first_line(sim.value) == _first_line(cpu.value)
    want = torch_qmm.quantize(w, mode="mxfp4")
    with _backend():
        got = torch_qmm.quantize(w, mode="mxfp4")
    assert all(torch.equal(g, e) for g, e in zip(got, want))
