"""affine_quantize / affine_dequantize: bit-exact with MLX and with the reference quantizer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm import reference

mx = pytest.importorskip("mlx.core", reason="mlx is a test dependency: pip install -e '.[test]'")

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)


def _mlx(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    return mx.array(t.numpy())


def _torch(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32)).view(torch.uint32)
    return torch.from_numpy(np.array(a))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so that -0.0 and 0.0 differ)."""
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


def _weights(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    # Edge cases MLX handles specially: a constant group, an all-zero group, a group whose
    # negative extreme dominates, a group of a single non-zero value, codes exactly half a step
    # apart (ties: rint rounds them to even), a range so small that the scale's floor 1e-7 applies.
    w[0, :32] = 0.75
    w[1, :32] = 0.0
    w[2, :32] = torch.linspace(-5.0, 1.0, 32)
    w[3, :32] = 0.0
    w[3, 7] = -2.5
    if rows >= 6:
        w[4, :32] = torch.cat([torch.tensor([0.0, 15.0]), torch.arange(30) % 15 + 0.5])  # 4 bits: scale -1, bias 15
        w[5, :32] = 1.0 + torch.arange(32) % 4 * 2.0**-23
    return w.to(dtype)


@pytest.mark.parametrize("bits,group_size,dtype", itertools.product(BITS, GROUPS, [torch.float32, torch.float16, torch.bfloat16]))
def test_quantize_is_bit_exact_with_mlx(bits, group_size, dtype):
    w = _weights(7, group_size * 3, dtype, seed=bits * 1000 + group_size)
    wq, scales, biases = torch_qmm.quantize(w, group_size=group_size, bits=bits)
    mwq, ms, mb = mx.quantize(_mlx(w), group_size=group_size, bits=bits)
    assert wq.dtype == torch.uint32 and scales.dtype == dtype and biases.dtype == dtype
    assert torch.equal(wq.view(torch.int32), _torch(mwq).view(torch.int32)), "packed words differ from MLX"
    assert torch.equal(scales, _torch(ms)), "scales differ from MLX"
    assert torch.equal(biases, _torch(mb)), "biases differ from MLX"


@pytest.mark.parametrize("bits,group_size", itertools.product(BITS, GROUPS))
def test_quantize_matches_reference_quantizer(bits, group_size):
    w = _weights(6, group_size * 5, torch.float32, seed=7 + bits)
    got = torch_qmm.quantize(w, group_size=group_size, bits=bits)
    want = reference.quantize(w, bits, group_size)
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MX_DTYPES = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


@pytest.mark.parametrize("bits,group_size,dtype", itertools.product(BITS, GROUPS, DTYPES))
def test_dequantize_matches_reference_and_mlx(bits, group_size, dtype):
    w = _weights(6, group_size * 3, dtype, seed=bits + group_size)
    wq, scales, biases = torch_qmm.quantize(w, group_size=group_size, bits=bits)
    got = torch_qmm.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    want = reference.dequantize(wq, scales, biases, bits, group_size)
    assert got.dtype == dtype
    # Two roundings to the scales' dtype (the product s*q, then the sum), each within the unit
    # roundoff u of its result: |error| <= u |s*q| + u (1 + u) (|s*q| + |b|) <= 2u (1 + u) times
    # |s*q| + |b| (the terms may cancel to an exact zero, so errors are relative to that sum).
    u = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    rtol = 2 * u * (1 + u)
    q = reference.unpack(wq, bits).double()
    s, b = (t.double().repeat_interleave(group_size, dim=-1) for t in (scales, biases))
    magnitude = (s * q).abs() + b.abs()
    assert ((got.double() - want).abs() <= rtol * magnitude).all()
    # Bit for bit with MLX, which rounds s*q to the dtype, then s*q + b, then converts to the
    # output dtype; every output dtype.
    for out in DTYPES:
        got = torch_qmm.dequantize(wq, scales, biases, group_size=group_size, bits=bits, dtype=out)
        from_mlx = _torch(mx.dequantize(_mlx(wq), _mlx(scales), _mlx(biases), group_size=group_size, bits=bits,
                                        dtype=MX_DTYPES[out]))
        assert got.dtype == out and torch.equal(_bits(got), _bits(from_mlx)), f"dequantize {dtype} -> {out} differs from MLX"


@pytest.mark.parametrize("bits", BITS)
def test_quantization_error_is_within_one_step(bits):
    # Rounding alone costs half a step; MLX's exact representation of the larger extreme
    # (scale = edge / rint(edge / scale)) may shrink the step so that the other extreme is clamped,
    # which costs up to one step.
    w = _weights(16, 256, torch.float32, seed=bits)
    wq, scales, biases = torch_qmm.quantize(w, group_size=64, bits=bits)
    w_hat = reference.dequantize(wq, scales, biases, bits, 64)
    step = scales.double().abs().repeat_interleave(64, dim=-1)
    assert ((w_hat - w.double()).abs() <= step * (1 + 1e-5) + 1e-6).all()


def test_quantize_accepts_leading_dimensions():
    w = torch.randn(2, 3, 128)
    wq, scales, biases = torch_qmm.quantize(w, group_size=64, bits=4)
    assert wq.shape == (2, 3, 16) and scales.shape == (2, 3, 2)
    flat = torch_qmm.quantize(w.reshape(6, 128), group_size=64, bits=4)
    assert torch.equal(wq.reshape(6, 16).view(torch.int32), flat[0].view(torch.int32))


@pytest.mark.parametrize("bits,dtype", itertools.product((3, 4), DTYPES))
def test_dequantize_accepts_leading_dimensions_as_mlx(bits, dtype):
    w = torch.randn(2, 3, 8, 128, generator=torch.Generator().manual_seed(bits)).to(dtype)
    wq, scales, biases = torch_qmm.quantize(w, group_size=32, bits=bits)
    for out in DTYPES:
        got = torch_qmm.dequantize(wq, scales, biases, group_size=32, bits=bits, dtype=out)
        from_mlx = _torch(mx.dequantize(_mlx(wq), _mlx(scales), _mlx(biases), group_size=32, bits=bits,
                                        dtype=MX_DTYPES[out]))
        assert got.shape == from_mlx.shape == (2, 3, 8, 128)
        assert got.dtype == out and torch.equal(_bits(got), _bits(from_mlx)), f"dequantize {dtype} -> {out} differs from MLX"


def test_quantize_accepts_non_contiguous_weights():
    w = torch.randn(128, 64).t()  # [64, 128], strided
    got = torch_qmm.quantize(w, group_size=32, bits=4)
    want = torch_qmm.quantize(w.contiguous(), group_size=32, bits=4)
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))


@pytest.mark.parametrize("bits,dtype", itertools.product(BITS, DTYPES))
def test_reference_dequantize_rounded_is_mlx_dequantize(bits, dtype):
    # The selftest's affine dequantize oracle, anchored on MLX itself.
    w = _weights(5, 128, dtype, seed=40 + bits)
    wq, scales, biases = torch_qmm.quantize(w, group_size=32, bits=bits)
    want = _torch(mx.dequantize(_mlx(wq), _mlx(scales), _mlx(biases), group_size=32, bits=bits))
    got = reference.dequantize_rounded(wq, scales, biases, bits, 32)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(want))
