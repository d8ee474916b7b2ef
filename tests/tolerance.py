"""The tolerance rule every kernel test uses (import: `from tolerance import assert_matches_reference`)."""

from __future__ import annotations

import math

import torch

# The tolerance rule (after flash-attention: at most ~2x what PyTorch itself makes in the dtype).
# An output element y = sum_k x_k w_k is compared with the float64 reference of x @ dequant(W):
#   |y - y_ref| <= OUT_RTOL[dtype] * |y_ref| + ACC_RTOL * sum_k |x_k w_k| + OUT_ATOL[dtype]
# OUT_RTOL: rounding the float32 result to the output dtype costs half an ulp (2^-24, 2^-11, 2^-8
#   relative); we allow two ulps (x2 for PyTorch's own rounding, x2 margin).
# ACC_RTOL: float32 accumulation in any order; the error of a K-term sum grows like sqrt(K) * 2^-24
#   in practice (K <= 16384 here: ~8e-6); 2e-5 leaves room for the different summation orders of
#   the fused and tiled kernels.
OUT_RTOL = {torch.float32: 2**-22, torch.float16: 2**-9, torch.bfloat16: 2**-6}
# OUT_ATOL: below the normal range the spacing of the output dtype is absolute (float16 subnormals
#   are 2^-24 apart); one spacing.
OUT_ATOL = {torch.float32: 2**-149, torch.float16: 2**-24, torch.bfloat16: 2**-133}
ACC_RTOL = 2e-5
# X_RTOL: where torch.set_float32_matmul_precision lets a kernel round float32 x (the CPU 4-bit
#   M=1 kernel keeps x as bfloat16 terms), each x_k may be off by its unit roundoff: 2^-16 for
#   two terms ("high"), 2^-8 for one ("medium"). Added as X_RTOL * sum_k |x_k w_k|.
X_RTOL = {"highest": 0.0, "high": 2**-16, "medium": 2**-8}


def assert_matches_reference(y: torch.Tensor, y_ref: torch.Tensor, magnitude: torch.Tensor, dtype, what: str = "",
                             precision: str = "highest"):
    """y: result in `dtype`; y_ref: float64 reference; magnitude: float64 |x| @ |W| (same shape);
    precision: the float32 matmul precision the result was computed under (X_RTOL)."""
    assert y.dtype == dtype, f"{what}: dtype {y.dtype} != {dtype}"
    assert y.shape == y_ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(y_ref.shape)}"
    err = (y.detach().cpu().to(torch.float64) - y_ref).abs()
    bound = OUT_RTOL[dtype] * y_ref.abs() + (ACC_RTOL + X_RTOL[precision]) * magnitude + OUT_ATOL[dtype]
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert math.isfinite(worst) and worst <= 1.0, (
        f"{what}: error {err.max().item():.3e} exceeds the {dtype} tolerance (worst ratio {worst:.2f})"
    )
