"""affine_qmm against the float64 reference of x @ dequant(W), on every backend present.

One sweep per op (bits x group_size x dtype x transpose, looping over M and odd N/K inside so the
reference is dequantized once), plus batched, strided and empty inputs and a cross-check with MLX.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm import reference

from cpu_features import bf16_precision, takes_bf16_gemm
from tolerance import assert_matches_reference

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 129)
ODD = (1, 3, 33, 100)  # output (or, for transpose=False, reduction) sizes that are not multiples of 8


def _packed(rows: int, cols: int, bits: int, group_size: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.5).to(dtype)
    return torch_qmm.quantize(w, group_size=group_size, bits=bits)


def _check(x, packed, bits, group_size, transpose, device, what, backend_name=None):
    """On the C++ CPU kernels (backend_name "cpu"), a call that takes the bfloat16 GEMM route (tests/cpu_features.py)
    is checked to take it and held to its bound (precision "medium")."""
    wq, scales, biases = packed
    precision = "highest"
    if backend_name == "cpu":
        m = x.numel() // x.shape[-1]
        route = torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, group_size, transpose)
        k = x.shape[-1]
        assert (route == "gemm-bf16") == takes_bf16_gemm(m, x.dtype, transpose, bits=bits, k=k), f"{what}: {route}"
        precision = bf16_precision(m, x.dtype, transpose, bits=bits, k=k)
    y = torch_qmm.quantized_matmul(
        x.to(device), wq.to(device), scales.to(device), biases.to(device), transpose=transpose,
        group_size=group_size, bits=bits,
    )
    y_ref = reference.qmm(x, wq, scales, biases, bits, group_size, transpose)
    magnitude = reference.qmm_magnitude(x, wq, scales, biases, bits, group_size, transpose)
    assert_matches_reference(y, y_ref, magnitude, x.dtype, what, precision=precision)


@pytest.mark.parametrize("bits,group_size,dtype", itertools.product(BITS, GROUPS, DTYPES))
def test_qmm_transposed_matches_reference(device, backend_name, bits, group_size, dtype):
    g = torch.Generator().manual_seed(bits * 7 + group_size)
    for n, k in itertools.product(ODD, (group_size, 3 * group_size)):
        packed = _packed(n, k, bits, group_size, dtype, seed=n * 31 + k)
        for m in MS:
            x = torch.randn(m, k, generator=g).to(dtype)
            _check(x, packed, bits, group_size, True, device, f"M={m} N={n} K={k}", backend_name)


@pytest.mark.parametrize("bits,group_size,dtype", itertools.product(BITS, GROUPS, DTYPES))
def test_qmm_not_transposed_matches_reference(device, bits, group_size, dtype):
    # transpose=False: W [K, N] quantized along N, so N is a multiple of the group size.
    g = torch.Generator().manual_seed(bits * 5 + group_size)
    for k, n in itertools.product(ODD, (group_size, 3 * group_size)):
        packed = _packed(k, n, bits, group_size, dtype, seed=n * 17 + k)
        for m in MS:
            x = torch.randn(m, k, generator=g).to(dtype)
            _check(x, packed, bits, group_size, False, device, f"M={m} N={n} K={k}")


@pytest.mark.parametrize("transpose", [True, False])
def test_qmm_accepts_batched_input(device, transpose):
    packed = _packed(96, 128, 4, 32, torch.float32, seed=1)  # transpose: N=96,K=128; else K=96,N=128
    k = 128 if transpose else 96
    x = torch.randn(2, 3, 5, k)
    wq, s, b = (t.to(device) for t in packed)
    y = torch_qmm.quantized_matmul(x.to(device), wq, s, b, transpose=transpose, group_size=32, bits=4)
    flat = torch_qmm.quantized_matmul(x.reshape(-1, k).to(device), wq, s, b, transpose=transpose, group_size=32, bits=4)
    assert y.shape == (2, 3, 5, flat.shape[-1])
    assert torch.equal(y.reshape(flat.shape).cpu(), flat.cpu())
    _check(x.reshape(-1, k), packed, 4, 32, transpose, device, "batched")


def test_qmm_accepts_one_dimensional_input(device):
    packed = _packed(40, 64, 4, 64, torch.float32, seed=2)
    x = torch.randn(64)
    y = torch_qmm.quantized_matmul(x.to(device), *(t.to(device) for t in packed), group_size=64, bits=4)
    assert y.shape == (40,)
    _check(x.unsqueeze(0), packed, 4, 64, True, device, "1-D x")


def test_qmm_accepts_strided_input(device):
    packed = _packed(50, 128, 3, 64, torch.float16, seed=3)
    base = torch.randn(128, 20).to(torch.float16)
    x = base.t()  # [20, 128], not contiguous
    assert not x.is_contiguous()
    _check(x, packed, 3, 64, True, device, "strided x")
    x2 = torch.randn(9, 256).to(torch.float16)[:, ::2]  # stride 2 along K
    _check(x2, packed, 3, 64, True, device, "stepped x")


def test_qmm_accepts_strided_packed_weights(device):
    wq, s, b = _packed(64, 128, 4, 32, torch.float32, seed=4)
    # Every other row of the packed matrix: a view with a row stride twice its width.
    sub = (wq[::2], s[::2], b[::2])
    x = torch.randn(5, 128)
    _check(x, sub, 4, 32, True, device, "strided weights")


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("m", [1, 4, 40])
def test_qmm_is_correct_with_two_threads(threads, transpose, m):
    # Work split across threads must not change the result beyond the tolerance (nor race).
    packed = _packed(200, 512, 4, 64, torch.float32, seed=6)
    x = torch.randn(m, 512 if transpose else 200)
    _check(x, packed, 4, 64, transpose, "cpu", f"two threads, M={m}", "cpu")


def test_qmm_with_zero_rows_returns_empty(device):
    wq, s, b = (t.to(device) for t in _packed(24, 64, 4, 32, torch.float32, seed=5))
    y = torch_qmm.quantized_matmul(torch.empty(0, 64, device=device), wq, s, b, group_size=32, bits=4)
    assert y.shape == (0, 24)
    y3 = torch_qmm.quantized_matmul(torch.empty(2, 0, 64, device=device), wq, s, b, group_size=32, bits=4)
    assert y3.shape == (2, 0, 24)


mx = None
try:
    import mlx.core as mx  # noqa: F811
except ImportError:  # pragma: no cover - mlx is a test dependency
    pass


@pytest.mark.skipif(mx is None, reason="mlx is a test dependency: pip install -e '.[test]'")
@pytest.mark.parametrize("bits,transpose", itertools.product(BITS, [True, False]))
def test_qmm_agrees_with_mlx(bits, transpose):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(7, 256 if transpose else 96, generator=g)
    wq, s, b = torch_qmm.quantize(w, group_size=64, bits=bits)
    y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=64, bits=bits)
    mwq = mx.array(wq.view(torch.int32).numpy().view(np.uint32))
    y_mlx = mx.quantized_matmul(
        mx.array(x.numpy()), mwq, mx.array(s.numpy()), mx.array(b.numpy()), transpose=transpose, group_size=64, bits=bits
    )
    magnitude = reference.qmm_magnitude(x, wq, s, b, bits, 64, transpose)
    # Both are float32 computations of the same product: twice the float32 accumulation bound.
    err = (y.double() - torch.from_numpy(np.array(y_mlx)).double()).abs()
    assert (err <= 4e-5 * magnitude + 1e-6).all()
