"""Route-by-route regression tests of the CPU affine_qmm kernels (csrc/cpu/qmm*.cpp).

The CPU op switches kernels by M (fused below cpu::kGemmMinRows = 16, decoded tiles + GEMM from
there, csrc/cpu/qmm_kernels.h); inside each kernel, rows of x go in blocks of 4, transpose=False
columns in spans of 64 (+ a tail of 32), and the GEMM route tiles N by 128 and K by 512
(csrc/cpu/qmm_gemm.cpp). These sweeps put shapes on both sides of every such boundary, with
random packed words so every code value (including 2^bits - 1) appears, against the float64
reference (the tolerance rule of tests/tolerance.py). Calls that take the bfloat16 GEMM route
(transpose=True, bfloat16 x, from 16 rows, on CPUs with bfloat16 matrix units:
tests/cpu_features.py) are checked to take it and held to its bound (precision "medium").
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_qmm
from torch_qmm import reference

from cpu_features import bf16_precision, takes_bf16_gemm
from tolerance import assert_matches_reference

BITS = [2, 3, 4, 5, 6, 8]
GROUP_SIZES = [32, 64, 128]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides of the fused/GEMM threshold (16) and of the 4-row blocks; 129 crosses a GEMM tile.
MS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 129]
ODD = [1, 3, 33, 100]  # N (transpose=True) or K (transpose=False): not multiples of 8


def random_packed(rows: int, cols: int, bits: int, group_size: int, dtype: torch.dtype, gen: torch.Generator):
    """Uniformly random packed words (all codes appear) with scales/biases of both signs."""
    words = torch.randint(0, 2**32, (rows, cols * bits // 32), generator=gen, dtype=torch.int64)
    wq = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)
    groups = (rows, cols // group_size)
    scales = (torch.randn(groups, generator=gen) * 0.05).to(dtype)
    biases = (torch.randn(groups, generator=gen) * 0.2).to(dtype)
    return wq, scales, biases


def check_all_m(x_all, wq, scales, biases, bits, group_size, transpose, dtype, what):
    """Runs the op for every M in MS (rows of x_all) against one float64 reference."""
    y_ref_all = reference.qmm(x_all, wq, scales, biases, bits, group_size, transpose)
    mag_all = reference.qmm_magnitude(x_all, wq, scales, biases, bits, group_size, transpose)
    for m in MS:
        route = torch.ops.torch_qmm._cpu_route(x_all[:m], wq, scales, biases, bits, group_size, transpose)
        k = x_all.shape[-1]
        assert (route == "gemm-bf16") == takes_bf16_gemm(m, dtype, transpose, bits=bits, k=k), f"{what} M={m}: {route}"
        y = torch_qmm.quantized_matmul(x_all[:m], wq, scales, biases, group_size=group_size, bits=bits,
                                       transpose=transpose)
        assert_matches_reference(y, y_ref_all[:m], mag_all[:m], dtype, f"{what} M={m} ({route})",
                                 precision=bf16_precision(m, dtype, transpose, bits=bits, k=k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_cpu_qmm_t_routes_match_reference(bits, group_size, dtype):
    """transpose=True: every M route x N in {1, 3, 33, 100} x K in {1, 3} groups."""
    gen = torch.Generator().manual_seed(1000 * bits + group_size)
    for n, k in itertools.product(ODD, [group_size, 3 * group_size]):
        wq, scales, biases = random_packed(n, k, bits, group_size, dtype, gen)
        x_all = torch.randn(max(MS), k, generator=gen).to(dtype)
        check_all_m(x_all, wq, scales, biases, bits, group_size, True, dtype, f"N={n} K={k}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_cpu_qmm_n_routes_match_reference(bits, group_size, dtype):
    """transpose=False: every M route x K in {1, 3, 33, 100} x N in {1, 3} groups (spans of 64 + 32)."""
    gen = torch.Generator().manual_seed(2000 * bits + group_size)
    for k, n in itertools.product(ODD, [group_size, 3 * group_size]):
        wq, scales, biases = random_packed(k, n, bits, group_size, dtype, gen)
        x_all = torch.randn(max(MS), k, generator=gen).to(dtype)
        check_all_m(x_all, wq, scales, biases, bits, group_size, False, dtype, f"N={n} K={k}")


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_cpu_qmm_gemm_tiles_cross_boundaries(bits, transpose):
    """GEMM route with N over 2.5 tiles of 128 and K over one tile of 512 (remainders both ways)."""
    gen = torch.Generator().manual_seed(3000 + bits)
    group_size = 64
    n, k = (257, 640) if transpose else (320, 1037)
    rows, cols = (n, k) if transpose else (k, n)
    wq, scales, biases = random_packed(rows, cols, bits, group_size, torch.float32, gen)
    packed = (wq, scales, biases, bits, group_size, transpose)
    for m in [16, 33]:
        x = torch.randn(m, k, generator=gen)
        y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=group_size, bits=bits, transpose=transpose)
        assert_matches_reference(y, reference.qmm(x, *packed), reference.qmm_magnitude(x, *packed), torch.float32,
                                 f"M={m}")


@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_cpu_qmm_batched_and_strided_x(m):
    """3-D and non-contiguous x reach the kernels as [M, K] rows in the right order."""
    gen = torch.Generator().manual_seed(4000 + m)
    wq, scales, biases = random_packed(96, 256, 4, 64, torch.float32, gen)
    x = torch.randn(2, m, 512, generator=gen)[..., ::2]  # [2, m, 256], stride 2 along K
    y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4)
    packed = (wq, scales, biases, 4, 64)
    assert_matches_reference(y, reference.qmm(x, *packed), reference.qmm_magnitude(x, *packed), torch.float32,
                             f"M={m}")
