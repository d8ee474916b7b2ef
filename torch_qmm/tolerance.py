"""The tolerance rule for affine_qmm results against the float64 reference (tests, benchmarks).

After flash-attention: at most ~2x what PyTorch itself makes in the dtype. An output element
y = sum_k x_k w_k is compared with the float64 reference of x @ dequant(W):

    |y - y_ref| <= OUT_RTOL[dtype] * |y_ref| + (ACC_RTOL + X_RTOL[precision]) * sum_k |x_k w_k| + OUT_ATOL[dtype]

(sum_k |x_k w_k|: reference.qmm_magnitude).
"""

from __future__ import annotations

import torch

# OUT_RTOL: rounding the float32 result to the output dtype costs half an ulp (2^-24, 2^-11, 2^-8
#   relative); we allow two ulps (x2 for PyTorch's own rounding, x2 margin).
OUT_RTOL = {torch.float32: 2**-22, torch.float16: 2**-9, torch.bfloat16: 2**-6}
# OUT_ATOL: below the normal range the spacing of the output dtype is absolute (float16 subnormals
#   are 2^-24 apart); one spacing.
OUT_ATOL = {torch.float32: 2**-149, torch.float16: 2**-24, torch.bfloat16: 2**-133}
# ACC_RTOL: float32 accumulation in any order; the error of a K-term sum grows like sqrt(K) * 2^-24
#   in practice (K <= 16384 here: ~8e-6); 2e-5 leaves room for the different summation orders of
#   the fused and tiled kernels.
ACC_RTOL = 2e-5
# X_RTOL: where torch.set_float32_matmul_precision lets a kernel round float32 x (the CPU 4-bit
#   M=1 kernel keeps x as bfloat16 terms), each x_k may be off by its unit roundoff: 2^-16 for
#   two terms ("high"), 2^-8 for one ("medium").
X_RTOL = {"highest": 0.0, "high": 2**-16, "medium": 2**-8}


def error_bound(y_ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                precision: str = "highest") -> torch.Tensor:
    """The largest |y - y_ref| allowed per element (float64, like y_ref and magnitude)."""
    return OUT_RTOL[dtype] * y_ref.abs() + (ACC_RTOL + X_RTOL[precision]) * magnitude + OUT_ATOL[dtype]


def worst_ratio(y: torch.Tensor, y_ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                precision: str = "highest") -> float:
    """max |y - y_ref| / bound (<= 1 passes; NaN if y has NaN where the reference does not)."""
    err = (y.detach().cpu().to(torch.float64) - y_ref.cpu()).abs()
    return (err / error_bound(y_ref.cpu(), magnitude.cpu(), dtype, precision)).max().item() if err.numel() else 0.0
