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
