"""Every mode's defaults (torch_qmm/ops.py: group_size / bits None) are MLX's: quantize,
dequantize and quantized_matmul called without them give mlx.core's results for the same call
without them (bit for bit for quantize and dequantize, within tolerance.py's rule for
qmm)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm import reference_fp
from torch_qmm.tolerance import worst_ratio

mx = pytest.importorskip("mlx.core")


@pytest.mark.parametrize("mode", ["affine", "mxfp4", "nvfp4", "mxfp8"])
def test_defaults_are_mlx_defaults(mode):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    got = torch_qmm.quantize(w, mode=mode)
    want = mx.quantize(mx.array(w.numpy()), mode=mode)
    assert len(got) == len(want)
    for g, m in zip(got, want):
        m = np.array(m)
        assert np.array_equal(g.numpy().view(m.dtype) if m.dtype == np.uint32 else g.numpy(), m)
    # dequantize's default dtype: the scales' (affine), bfloat16 (the fp modes), as mlx.core's
    deq = torch_qmm.dequantize(*got, mode=mode)
    want_deq = mx.dequantize(*(mx.array(t.numpy()) for t in got), mode=mode)
    assert deq.dtype == (torch.float32 if mode == "affine" else torch.bfloat16)
    assert want_deq.dtype == (mx.float32 if mode == "affine" else mx.bfloat16)
    assert torch.equal(deq.float(), torch.from_numpy(np.array(want_deq.astype(mx.float32))))
    if mode != "affine":
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
        y = torch_qmm.quantized_matmul(x, got[0], got[1], mode=mode)
        y_ref = reference_fp.qmm_fp(x, got[0], got[1], mode)
        magnitude = reference_fp.qmm_fp_magnitude(x, got[0], got[1], mode)
        assert worst_ratio(y, y_ref, magnitude, torch.float32) <= 1.0
