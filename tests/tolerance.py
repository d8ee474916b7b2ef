"""The tolerance rule every kernel test uses (import: `from tolerance import assert_matches_reference`).

The rule itself is torch_qmm/tolerance.py (shared with the benchmarks' output check).
"""

from __future__ import annotations

import math

import torch

from torch_qmm.tolerance import ACC_RTOL, OUT_ATOL, OUT_RTOL, X_RTOL, worst_ratio  # noqa: F401


def assert_matches_reference(y: torch.Tensor, y_ref: torch.Tensor, magnitude: torch.Tensor, dtype, what: str = "",
                             precision: str = "highest"):
    """y: result in `dtype`; y_ref: float64 reference; magnitude: float64 |x| @ |W| (same shape);
    precision: the float32 matmul precision the result was computed under (X_RTOL)."""
    assert y.dtype == dtype, f"{what}: dtype {y.dtype} != {dtype}"
    assert y.shape == y_ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(y_ref.shape)}"
    worst = worst_ratio(y, y_ref, magnitude, dtype, precision)
    err = (y.detach().cpu().to(torch.float64) - y_ref).abs()
    assert math.isfinite(worst) and worst <= 1.0, (
        f"{what}: error {err.max().item():.3e} exceeds the {dtype} tolerance (worst ratio {worst:.2f})"
    )


def sparse_x(M: int, K: int, nonzeros: int, window: int, dtype, seed: int) -> torch.Tensor:
    """x [M, K] with `nonzeros` values per row, each in its own window of `window` columns (so at
    most one per quantization group or GGUF sub-block when window is a multiple of it), drawn
    with every bit of `dtype` (float32: 24 significant bits). Every other entry is 0."""
    g = torch.Generator().manual_seed(seed)
    windows = K // window
    x = torch.zeros(M, K, dtype=torch.float64)
    for m in range(M):
        for w in torch.randperm(windows, generator=g)[: min(nonzeros, windows)].tolist():
            x[m, w * window + int(torch.randint(0, window, (1,), generator=g))] = torch.randn(1, generator=g,
                                                                                        dtype=torch.float64).item() * 3
    return x.to(dtype)


# Roundings a kernel may spend on one nonzero x value on its way into the float32 sum: x split into
# up to three bfloat16 terms, their products with the code, the scale and offset (bias, min)
# products and the sums that join them; then one addition per further value.
ROUNDINGS_PER_VALUE = 8


def assert_within_few_roundings(y: torch.Tensor, y_ref: torch.Tensor, magnitude: torch.Tensor, dtype,
                                values: int, what: str = "") -> None:
    """y against the float64 reference when each output sums only `values` nonzero products (x
    of sparse_x): the float32 accumulation error is at most n * 2^-24 * magnitude with n the
    roundings of all its terms (ROUNDINGS_PER_VALUE each), in any summation order, and the output
    rounding half an ulp. A kernel that rounds x (16-bit float32 x, float16 x as one bfloat16
    term), or a bias, scale or sum in a narrower type, is off by far more."""
    assert y.dtype == dtype and y.shape == y_ref.shape, f"{what}: {y.dtype} {tuple(y.shape)}"
    n = ROUNDINGS_PER_VALUE * values
    gamma = n * 2**-24 / (1 - n * 2**-24)
    u = OUT_RTOL[dtype]
    bound = u * y_ref.abs() + (1 + u) * gamma * magnitude + OUT_ATOL[dtype]
    err = (y.detach().cpu().to(torch.float64) - y_ref).abs()
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert math.isfinite(worst) and worst <= 1.0, (
        f"{what}: error {err.max().item():.3e} exceeds {n} roundings of the terms' magnitude "
        f"(worst ratio {worst:.2f})"
    )
