"""Metal kernels on metalsim at the edges of their number ranges (metal/quant_format.h,
quant_common.h, quant_qvm.h, quant_quantize.h):
- an e8m0 scale byte of 0 means 2^-127 (a float32 subnormal), as mlx.core.dequantize decodes it;
- affine products whose hoisted form s * sum(q x) + b * sum(x) overflows while every weight times
  x, and their sum, is finite: the kernels must fall back to the per-weight sum (exact here:
  every term is 2^118, their sum 2^126, so float32 has no rounding and the float64 reference is
  the expected value bit for bit);
- dequantize on a grid with idle threads past the last unit (checked mode: no write outside w).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm import reference
from torch_qmm.metalsim_backend import backend, last_launches

mx = pytest.importorskip("mlx.core")


def test_mxfp4_scale_code_zero_is_2_to_minus_127():
    codes = torch.arange(64, dtype=torch.int64).remainder(16).reshape(1, 64)
    wq = reference.pack(codes, 4)
    scales = torch.tensor([[0, 1]], dtype=torch.uint8)  # 2^-127 and 2^-126
    want = mx.dequantize(mx.array(wq.numpy()), mx.array(scales.numpy()), mode="mxfp4", group_size=32, bits=4,
                         dtype=mx.float32)
    want = torch.from_numpy(np.array(want))
    assert want[0, 1].item() == 0.5 * 2.0**-127  # mlx: code 1 of e2m1 is 0.5
    with backend(check=True):
        got = torch_qmm.dequantize(wq, scales, mode="mxfp4", dtype=torch.float32)
    assert torch.equal(got, want)


def _overflowing_affine(rows: int, cols: int):
    """8-bit codes 255 with scale 2^100 and bias -254 * 2^100: every weight is 2^100 while s*q is
    255 * 2^100, so with x = 2^18 the hoisted sums of 8 or more terms overflow float32."""
    q = torch.full((rows, cols), 255, dtype=torch.int64)
    wq = reference.pack(q, 8)
    scales = torch.full((rows, cols // 64), 2.0**100, dtype=torch.float32)
    biases = torch.full((rows, cols // 64), -254 * 2.0**100, dtype=torch.float32)
    return wq, scales, biases


@pytest.mark.parametrize("M, transpose, route", [(1, True, "qmv_fast"), (2, True, "qmm_t_bm2"),
                                                 (1, False, "qvm_bounded")])
def test_hoisted_overflow_falls_back_to_per_weight_sum(M, transpose, route):
    K, N = 256, 64  # 256 terms of 2^118: y = 2^126 exactly
    wq, s, b = _overflowing_affine(N, K) if transpose else _overflowing_affine(K, N)
    x = torch.full((M, K), 2.0**18, dtype=torch.float32)
    want = reference.qmm(x, wq, s, b, 8, 64, transpose)
    assert torch.equal(want, torch.full((M, N), 2.0**126, dtype=torch.float64))
    with backend(check=True):
        y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=64, bits=8)
    assert [l.route for l in last_launches()] == [route]
    assert torch.equal(y.double(), want)


def test_dequantize_idle_threads_write_nothing():
    w = torch.randn(3, 64)
    wq, s, b = torch_qmm.quantize(w, group_size=64, bits=4)
    # mlx.core.dequantize's rounding: s*q, then + b, each rounded to float32
    want = torch.from_numpy(np.array(mx.dequantize(mx.array(wq.numpy()), mx.array(s.numpy()), mx.array(b.numpy()),
                                                   group_size=64, bits=4)))
    with backend(check=True):
        got = torch_qmm.dequantize(wq, s, b, group_size=64, bits=4)
    (launch,) = last_launches()
    assert launch.threadgroups[0] * launch.threads_per_threadgroup[0] > 3 * 64 // 8  # idle threads exist
    assert torch.equal(got, want)
