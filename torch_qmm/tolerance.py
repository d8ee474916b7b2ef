"""The tolerance rule for affine_qmm results against the float64 reference (tests, benchmarks).

An output element y = sum_k x_k w_k is the float32 sum y32, rounded once to the output dtype. The
two errors are bounded separately against the float64 reference y_ref of x @ dequant(W):

    |y32 - y_ref| <= (ACC_RTOL + X_RTOL[precision]) * sum_k |x_k w_k|          (accumulation)
    |y - y32|     <= OUT_RTOL[dtype] * |y32| + OUT_ATOL[dtype]                    (final rounding)

so |y - y_ref| <= OUT_RTOL * |y_ref| + (1 + OUT_RTOL) * (ACC_RTOL + X_RTOL) * sum_k |x_k w_k|
+ OUT_ATOL (sum_k |x_k w_k|, of the terms a kernel adds: reference.qmm_magnitude, which takes
w = s*q + b as its two terms since kernels hoist the bias; for the GGUF K-quants the same with
w = d*sc*q - offset, Q2_K / Q4_K / Q5_K's dmin*m and Q3_K / Q6_K's 4 or 32 times d*sc:
tests/gguf_helpers.k_quant_magnitude). The rounding term is exactly what
round-to-nearest costs, so truncating the output (up to a whole ulp) fails wherever the
accumulation term is small; tests/exact_cases.py removes the accumulation error altogether and
checks outputs bit for bit.
"""

from __future__ import annotations

import torch

# OUT_RTOL: round to nearest costs at most half an ulp: the unit roundoff 2^-24, 2^-11, 2^-8.
OUT_RTOL = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}
# OUT_ATOL: below the normal range the spacing is absolute (float16 subnormals are 2^-24 apart,
#   bfloat16's and float32's 2^-133 and 2^-149); half a spacing.
OUT_ATOL = {torch.float32: 2**-150, torch.float16: 2**-25, torch.bfloat16: 2**-134}
# ACC_RTOL: float32 accumulation in any order; the error of a K-term sum grows like sqrt(K) * 2^-24
#   in practice (K <= 16384 here: ~8e-6); 2e-5 leaves room for the different summation orders of
#   the fused and tiled kernels. What it cannot tell apart (e.g. float32 x rounded to 16 bits)
#   the exact problems of tests/exact_cases.py check bit for bit.
ACC_RTOL = 2e-5
# X_RTOL: where torch.set_float32_matmul_precision lets a kernel round float32 x (the CPU 4-bit
#   M=1 kernel keeps x as bfloat16 terms), each x_k may be off by its unit roundoff: 2^-16 for
#   two terms ("high"), 2^-8 for one ("medium").
X_RTOL = {"highest": 0.0, "high": 2**-16, "medium": 2**-8}

# CPU routes whose products round w to bfloat16 (csrc/cpu/bf16_gemm.h) as precision "medium"
#   rounds x: their results are held to X_RTOL["medium"] whatever the float32 matmul precision.
CPU_BF16_ROUTES = ("gemm-bf16",)


def route_precision(route: str, precision: str = "highest") -> str:
    """The precision a result of the kernel `route` is held to: a CPU route name (possibly after a
    prefix and a space, "cpu gather_qmm gemm-bf16"), or a Metal kernel's."""
    return "medium" if route.split(" ")[-1] in CPU_BF16_ROUTES else precision


def error_bound(y_ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                precision: str = "highest") -> torch.Tensor:
    """The largest |y - y_ref| allowed per element (float64, like y_ref and magnitude)."""
    u = OUT_RTOL[dtype]
    return u * y_ref.abs() + (1 + u) * (ACC_RTOL + X_RTOL[precision]) * magnitude + OUT_ATOL[dtype]


def worst_ratio(y: torch.Tensor, y_ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                precision: str = "highest") -> float:
    """max |y - y_ref| / bound (<= 1 passes; NaN if y has NaN where the reference does not)."""
    err = (y.detach().cpu().to(torch.float64) - y_ref.cpu()).abs()
    return (err / error_bound(y_ref.cpu(), magnitude.cpu(), dtype, precision)).max().item() if err.numel() else 0.0


def sharded_error_bound(y_ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, roundings: int,
                        precision: str = "highest") -> torch.Tensor:
    """error_bound plus `roundings` further roundings to `dtype` of values no larger than
    `magnitude`. A product split along K over S ranks (tensor-parallel rowwise) rounds each of its
    S partial sums once (their magnitudes add up to `magnitude`) and the all-reduce adds them in
    `dtype` (S - 1 additions, each rounding a running sum <= magnitude): roundings = 2S - 1 covers
    both; a bias added after the product is one rounding more."""
    return error_bound(y_ref, magnitude, dtype, precision) + roundings * OUT_RTOL[dtype] * magnitude
