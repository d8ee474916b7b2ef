"""Problems whose float32 accumulation is exact, so a kernel's output is known to the bit.

The tolerance rule (tests/tolerance.py) bounds the accumulation error separately from the final
rounding, and an accumulation bound loose enough for every summation order cannot tell small
precision losses apart. These problems remove the accumulation error instead, so that what is
left is checked exactly:

* `rounding_case`: W = s * (q - c) with s a power of two and c an integer per group, x small
  integers times 2^-7. Every product and every partial sum, in any order and in either of the
  forms kernels use (sum x*w, or s*sum(x*q) + b*sum(x)), is a multiple of one granule and below
  2^24 granules, so float32 accumulation is exact; the outputs still need more bits than
  float16/bfloat16 hold. The only error left is rounding the float32 result to the output
  dtype: y must equal the exact product rounded to nearest even (truncation, or rounding twice,
  differs in about half the outputs).
* `selection_case`: every column of W holds one weight 2^e (code 1, bias 0) and zeros, x any
  values of its dtype (float32: all 24 bits). y[m, n] = x[m, k(n)] * 2^e exactly, so a kernel
  that rounds x (e.g. float32 x as two bfloat16 terms instead of three, float16 x as one)
  fails.

The expected output is the float64 product of x and W built from the codes (not from the
packed words), rounded once to the dtype; the words are packed by torch_qmm.reference.pack.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torch_qmm import reference

X_SHIFT = 7  # x = integer * 2^-X_SHIFT
SCALE_EXPONENTS = (-1, 0)  # s = 2^e


def _packed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return reference.pack(codes, bits)


def _dense(codes, scales, biases, group_size) -> torch.Tensor:
    """float64 W = s * q + b from the codes themselves (not from the packed words)."""
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=1)
    b = biases.to(torch.float64).repeat_interleave(group_size, dim=1)
    return s * codes.to(torch.float64) + b


class ExactCase(NamedTuple):
    x: torch.Tensor
    wq: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    w: torch.Tensor  # float64 stored matrix: [N, K] (transpose) or [K, N]
    transpose: bool

    @property
    def operands(self):
        return self.x, self.wq, self.scales, self.biases

    def exact(self) -> torch.Tensor:
        """The exact product, float64 (exact here)."""
        return self.x.to(torch.float64) @ (self.w.T if self.transpose else self.w)

    def expected(self) -> torch.Tensor:
        """The exact product rounded once (to nearest even) to x's dtype."""
        y = self.exact()
        y32 = y.to(torch.float32)
        assert torch.equal(y32.to(torch.float64), y), "the problem's product must be exact in float32"
        return y32.to(self.x.dtype)

    def rounded_fraction(self) -> float:
        """The share of outputs the dtype cannot hold exactly (where truncation would differ)."""
        y = self.exact()
        return (self.expected().to(torch.float64) != y).to(torch.float64).mean().item()


def rounding_case(M: int, N: int, K: int, bits: int, group_size: int, dtype, transpose: bool, seed: int):
    """(x, wq, scales, biases) with exact float32 accumulation (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = (N, K) if transpose else (K, N)
    levels = 2**bits - 1
    codes = torch.randint(0, levels + 1, (rows, cols), generator=g)
    groups = (rows, cols // group_size)
    c = torch.randint(0, levels + 1, groups, generator=g)
    e = torch.tensor(SCALE_EXPONENTS)[torch.randint(0, len(SCALE_EXPONENTS), groups, generator=g)]
    scales = torch.ldexp(torch.ones(groups), e)
    biases = -c * scales
    # |x| <= R: the largest partial sum, K * R * levels * 2^max(e), in granules of 2^(min(e) - 7),
    # stays below 2^24 (the factor 2 covers the spread of the scale exponents).
    spread = 2 ** (max(SCALE_EXPONENTS) - min(SCALE_EXPONENTS))
    # R <= 255 keeps x exact in bfloat16 (8 significant bits).
    R = max(1, min(255, (2**24 - 1) // (max(K, 1) * levels * spread * 2)))
    x = torch.randint(-R, R + 1, (M, K), generator=g).to(torch.float64) * 2.0**-X_SHIFT
    case = ExactCase(x.to(dtype), _packed(codes, bits), scales.to(dtype), biases.to(dtype),
                     _dense(codes, scales, biases, group_size), transpose)
    assert torch.equal(case.x.to(torch.float64), x), "x must be exact in its dtype"
    return case


def selection_case(M: int, N: int, K: int, bits: int, group_size: int, dtype, transpose: bool, seed: int):
    """(x, wq, scales, biases) with one weight 2^e per column of W (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = (N, K) if transpose else (K, N)
    codes = torch.zeros(rows, cols, dtype=torch.int64)
    pick = torch.randint(0, K, (N,), generator=g)  # y[:, n] = x[:, pick[n]] * s
    if transpose:
        codes[torch.arange(N), pick] = 1
    else:
        codes[pick, torch.arange(N)] = 1
    groups = (rows, cols // group_size)
    e = torch.randint(-1, 2, groups, generator=g)
    scales = torch.ldexp(torch.ones(groups), e).to(dtype)
    biases = torch.zeros(groups, dtype=dtype)
    x = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
    return ExactCase(x, _packed(codes, bits), scales, biases, _dense(codes, scales, biases, group_size), transpose)


def assert_bitwise(y: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """y equals want bit for bit; the message counts the differing outputs and their largest gap."""
    assert y.dtype == want.dtype and y.shape == want.shape, f"{what}: {y.dtype} {tuple(y.shape)} != {want.dtype} {tuple(want.shape)}"
    y = y.detach().cpu()
    same = (y == want) | (torch.isnan(y) & torch.isnan(want))
    if not bool(same.all()):
        bad = (~same).nonzero()[0].tolist()
        diff = (y.to(torch.float64) - want.to(torch.float64)).abs()
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {y.numel()} outputs differ from the exactly rounded "
            f"product (first at {bad}: {y[tuple(bad)].item()!r} != {want[tuple(bad)].item()!r}; "
            f"largest gap {diff.max().item():.3e})"
        )
