"""Validation by the format table (csrc/validate.cpp, csrc/format_spec.h): each refusal names the
argument, what was expected and what came, identically for real and meta tensors (the Meta
kernels run the same checks)."""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm.formats import FORMATS

ops = torch.ops.torch_qmm


def _both(call, args, kind, pattern):
    """Raises `kind` matching `pattern` on real tensors and on their meta copies."""
    with pytest.raises(kind, match=pattern):
        call(*args)
    meta = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(kind, match=pattern):
        call(*meta)


def _fp(mode="mxfp4", rows=8, cols=64):
    return torch_qmm.quantize(torch.randn(rows, cols), mode=mode)


def test_unknown_mode_lists_the_known_ones():
    known = ", ".join(f"'{m}'" for m in FORMATS)
    x = torch.randn(2, 64)
    wq, s = _fp()
    for call, args in (
        (ops.quantize, (torch.randn(4, 64), "int4", 4, 32)),
        (ops.dequantize, (wq, s, None, "int4", 4, 32)),
        (ops.qmm, (x, wq, s, None, "int4", 4, 32)),
    ):
        _both(call, args, ValueError, rf"argument 'mode' must be one of {known}, got 'int4'")
    with pytest.raises(ValueError, match=r"argument 'mode' must be one of .*got 'MXFP4'"):
        torch_qmm.quantize(torch.randn(4, 64), mode="MXFP4")


@pytest.mark.parametrize("mode", [m for m, f in FORMATS.items() if not f.has_biases])
def test_biases_given_for_an_fp_mode(mode):
    f = FORMATS[mode]
    wq, s = _fp(mode)
    b = torch.zeros(s.shape)
    _both(ops.qmm, (torch.randn(2, 64), wq, s, b, mode, f.default_bits, f.default_group_size), ValueError,
          rf"qmm: argument 'biases' must be None for mode '{mode}' \(it has no biases\), got a tensor of shape \[8, ")
    _both(ops.dequantize, (wq, s, b, mode, f.default_bits, f.default_group_size), ValueError,
          rf"dequantize: argument 'biases' must be None for mode '{mode}'")


def test_biases_missing_for_affine():
    wq, s, _ = torch_qmm.quantize(torch.randn(8, 64), group_size=32)
    _both(ops.qmm, (torch.randn(2, 64), wq, s, None, "affine", 4, 32), ValueError,
          r"qmm: argument 'biases' is required for mode 'affine', got None")


def test_fp_scales_must_be_uint8():
    wq, s = _fp("mxfp4")
    _both(ops.qmm, (torch.randn(2, 64), wq, s.float(), None, "mxfp4", 4, 32), TypeError,
          r"qmm: argument 'scales' must be uint8 \(e8m0 scale codes\) for mode 'mxfp4', got Float")
    wq, s = _fp("nvfp4")
    _both(ops.dequantize, (wq, s.to(torch.int8), None, "nvfp4", 4, 16), TypeError,
          r"dequantize: argument 'scales' must be uint8 \(e4m3 scale codes\) for mode 'nvfp4', got Char")


@pytest.mark.parametrize("mode,bits,group_size,pattern", [
    ("mxfp4", 8, 32, r"argument 'bits' must be 4, got 8 \(mode 'mxfp4'\)"),
    ("mxfp4", 4, 64, r"argument 'group_size' must be 32, got 64 \(mode 'mxfp4'\)"),
    ("nvfp4", 4, 32, r"argument 'group_size' must be 16, got 32 \(mode 'nvfp4'\)"),
    ("affine", 7, 64, r"argument 'bits' must be one of 2, 3, 4, 5, 6, 8, got 7 \(mode 'affine'\)"),
    ("affine", 4, 16, r"argument 'group_size' must be one of 32, 64, 128, got 16 \(mode 'affine'\)"),
])
def test_bits_and_group_size_allowed_per_mode(mode, bits, group_size, pattern):
    _both(ops.quantize, (torch.randn(4, 128), mode, bits, group_size), ValueError, "quantize: " + pattern)
    with pytest.raises(ValueError, match=pattern):
        torch_qmm.quantize(torch.randn(4, 128), group_size=group_size, bits=bits, mode=mode)


def test_fp_x_may_be_any_float_dtype_but_not_double():
    wq, s = _fp()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert ops.qmm(torch.randn(2, 64).to(dtype), wq, s, None, "mxfp4", 4, 32).dtype == dtype
    _both(ops.qmm, (torch.randn(2, 64, dtype=torch.float64), wq, s, None, "mxfp4", 4, 32), TypeError,
          r"qmm: argument 'x' must be float32, float16 or bfloat16, got Double")


def test_dequantize_dtype():
    wq, s = _fp()
    assert ops.dequantize(wq, s, None, "mxfp4", 4, 32).dtype == torch.bfloat16
    assert ops.dequantize(wq, s, None, "mxfp4", 4, 32, torch.float16).dtype == torch.float16
    wq, sa, b = torch_qmm.quantize(torch.randn(8, 64), group_size=32)
    assert ops.dequantize(wq, sa, b, "affine", 4, 32).dtype == torch.float32
    _both(ops.dequantize, (wq, sa, b, "affine", 4, 32, torch.float64), TypeError,
          r"dequantize: argument 'dtype' must be float32, float16 or bfloat16, got Double")


def test_scales_shape_names_mode_geometry():
    wq, s = _fp("nvfp4")
    _both(ops.qmm, (torch.randn(2, 64), wq, s[:, :2], None, "nvfp4", 4, 16), ValueError,
          r"qmm: argument 'scales' must have shape \[8, 4\] for wq of shape \[8, 8\] with bits=4 and group_size=16")
