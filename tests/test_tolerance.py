"""The rounding terms of the tolerance rule (torch_qmm/tolerance.py) against torch.finfo: round to
nearest costs at most half an ulp (the unit roundoff eps / 2) and, below the normal range, half the
subnormal spacing (tiny * eps / 2); an output one subnormal step off fails the bound."""

from __future__ import annotations

import pytest
import torch

from torch_qmm.tolerance import OUT_ATOL, OUT_RTOL, error_bound

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_terms_are_half_a_spacing(dtype):
    fi = torch.finfo(dtype)
    assert OUT_RTOL[dtype] == fi.eps / 2
    assert OUT_ATOL[dtype] == fi.tiny * fi.eps / 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_zero_one_subnormal_step_off_fails_and_round_to_nearest_passes(dtype):
    fi = torch.finfo(dtype)
    step = fi.tiny * fi.eps  # the spacing of the subnormals
    y_ref = torch.tensor([0.3 * step], dtype=torch.float64)  # an exact sum that rounds to 0
    bound = error_bound(y_ref, torch.zeros(1, dtype=torch.float64), dtype)  # no accumulation error
    nearest = torch.zeros(1, dtype=torch.float64)
    assert bool(((nearest - y_ref).abs() <= bound).all())
    assert bool(((nearest + step - y_ref).abs() > bound).all())
