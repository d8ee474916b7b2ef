"""torch_qmm/tolerance.py at full float32 precision: the bound is the accumulation allowance
ACC_RTOL * sum|x_k w_k| plus the output rounding, with no term for x rounded to fewer bits; the
"high" and "medium" precisions add the unit roundoff of x kept as two or one bfloat16 terms."""

from __future__ import annotations

import torch

from torch_qmm.tolerance import ACC_RTOL, error_bound, worst_ratio


def test_highest_precision_allows_only_the_accumulation_error():
    zero, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    # y_ref = 0 and sum|x_k w_k| = 1: the bound is (1 + 2^-24) * ACC_RTOL + 2^-150 (float32's half spacing)
    assert error_bound(zero, one, torch.float32).item() == (1 + 2**-24) * ACC_RTOL + 2**-150
    y = torch.full((1,), 1.5 * ACC_RTOL, dtype=torch.float32)  # 1.5 times the accumulation allowance
    assert worst_ratio(y, zero, one, torch.float32) > 1.0
    # x as two bfloat16 terms (unit roundoff 2^-16 each) may cost ACC_RTOL + 2^-16 at "high"
    assert worst_ratio(y, zero, one, torch.float32, precision="high") <= 1.0
