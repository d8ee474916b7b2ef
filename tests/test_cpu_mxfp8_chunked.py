"""The CPU mxfp8 chunk kernel (csrc/cpu/chunk_avx2.h E4m3Multiplier, avx2_chunked.cpp).

qmm on CPU takes it for mode "mxfp8" (e4m3 codes, e8m0 scale per 32), transpose=True, K of at
least one chunk (32 codes), M up to cpu::fp_chunked_max_rows (16), when the build has AVX2, FMA
and F16C; route name "chunked/avx2-e4m3" (bfloat16 x from 16 rows takes the bfloat16 GEMM route
before it where the CPU has bfloat16 matrix units: tests/cpu_features.py takes_bf16_gemm, held to
its bound, precision "medium"). Checked against the float64 reference
(torch_qmm/reference_fp.py) with the tolerance rule of torch_qmm/tolerance.py, bit for bit on
problems whose float32 accumulation is exact, and for the NaN codes (0x7F, 0xFF) against IEEE
arithmetic on the float32 dequantized weights.
"""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm import reference, reference_fp
from torch_qmm.formats import FORMATS

from cpu_features import NATIVE, bf16_precision, cpu_flags, takes_bf16_gemm
from tolerance import assert_matches_reference

HAS_AVX2 = NATIVE and {"avx2", "fma", "f16c"} <= cpu_flags()
MAX_ROWS = 16  # cpu::fp_chunked_max_rows
CHUNK = 32
GS, BITS = 32, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

pytestmark = [pytest.mark.skipif("mxfp8" not in FORMATS, reason="mode mxfp8 is not in this build's format table"),
              pytest.mark.skipif(not HAS_AVX2, reason="the mxfp8 chunk kernel needs AVX2, FMA and F16C")]


def route(x, wq, scales) -> str:
    return torch.ops.torch_qmm._cpu_route(x, wq, scales, None, BITS, GS, True, "mxfp8")


def expected_route(M: int, K: int, dtype=torch.float32) -> str:
    if takes_bf16_gemm(M, dtype, bits=BITS, k=K, mode="mxfp8"):
        return "gemm-bf16"
    return "chunked/avx2-e4m3" if K >= CHUNK and 1 <= M <= MAX_ROWS else "gemm"


def qmm(x, wq, scales):
    return torch_qmm.quantized_matmul(x, wq, scales, None, group_size=GS, bits=BITS, mode="mxfp8")


def weights(n, k, gen, codes=None, scale_codes=None):
    """e4m3 codes (all but the NaN codes 0x7F / 0xFF unless given), e8m0 scales 2^-8 .. 2^2."""
    if codes is None:
        codes = torch.randint(0, 255, (n, k), generator=gen)
        codes = torch.where(codes == 0x7F, torch.zeros_like(codes), codes)
    if scale_codes is None:
        scale_codes = torch.randint(127 - 8, 127 + 3, (n, k // GS), generator=gen)
    return reference.pack(codes.to(torch.int64), BITS), scale_codes.to(torch.uint8)


SHAPES = [(M, 37, 160) for M in (1, 2, 3, 4, 5, 8, MAX_ROWS, MAX_ROWS + 1)]
SHAPES += [(M, N, K) for M in (1, 3) for N in (1, 3, 129) for K in (32, 64, 96, 5120 + 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp8_chunks_match_reference(dtype):
    gen = torch.Generator().manual_seed(31)
    for M, N, K in SHAPES:
        wq, scales = weights(N, K, gen)
        x = torch.randn(M, K, generator=gen).to(dtype)
        assert route(x, wq, scales) == expected_route(M, K, dtype), (M, N, K)
        y = qmm(x, wq, scales)
        y_ref = reference_fp.qmm_fp(x, wq, scales, "mxfp8", GS, BITS)
        mag = reference_fp.qmm_fp_magnitude(x, wq, scales, "mxfp8", GS, BITS)
        assert_matches_reference(y, y_ref, mag, dtype, f"mxfp8 M={M} N={N} K={K}", precision=bf16_precision(M, dtype, bits=BITS, k=K, mode="mxfp8"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp8_chunks_exact_problems_bit_for_bit(dtype, monkeypatch):
    """x = integers * 2^-4 (|x| <= 1), elements of magnitude 2^-3 .. 3.75 (exponent fields 4 .. 8:
    3 mantissa bits on a 2^-6 grid), scales 2^-4 .. 1, K <= 128: every product and partial sum the
    kernel forms is a multiple of 2^-14 below 2^23 granules, so y is the exact product rounded once.
    TORCH_QMM_CPU_NO_BF16=1 (which the AVX2 kernels ignore) keeps bfloat16 x at M = 16 on the chunk
    kernel."""
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")
    gen = torch.Generator().manual_seed(32)
    for M, N, K in [(1, 37, 32), (3, 37, 64), (5, 129, 96), (MAX_ROWS, 9, 128)]:
        exponent = torch.randint(4, 9, (N, K), generator=gen)
        codes = torch.randint(0, 2, (N, K), generator=gen) * 128 + exponent * 8 + torch.randint(0, 8, (N, K), generator=gen)
        wq, scales = weights(N, K, gen, codes, torch.randint(127 - 4, 128, (N, K // GS), generator=gen))
        x = (torch.randint(-16, 17, (M, K), generator=gen).to(torch.float64) / 16).to(dtype)
        y_exact = reference_fp.qmm_fp(x, wq, scales, "mxfp8", GS, BITS)
        assert torch.equal(y_exact.to(torch.float32).to(torch.float64), y_exact)
        assert route(x, wq, scales) == "chunked/avx2-e4m3"
        y = qmm(x, wq, scales)
        assert torch.equal(y, y_exact.to(torch.float32).to(dtype)), f"M={M} N={N} K={K} {dtype}"


def test_mxfp8_nan_codes_give_nan_rows():
    """A NaN code (0x7F or 0xFF) anywhere in a row of W makes that output column NaN, as IEEE
    arithmetic on the dequantized weights does; other columns are unaffected."""
    gen = torch.Generator().manual_seed(33)
    wq, scales = weights(9, 128, gen)
    codes = reference.unpack(wq, BITS)
    codes[2, 100] = 0x7F
    codes[6, 3] = 0xFF
    wq = reference.pack(codes.to(torch.int64), BITS)
    x = torch.randn(2, 128, generator=gen)
    assert route(x, wq, scales) == "chunked/avx2-e4m3"
    y = qmm(x, wq, scales)
    w32 = reference_fp.dequantize_fp(wq, scales, "mxfp8", GS, BITS, dtype=torch.float32).to(torch.float64)
    y_ref = (x.to(torch.float64) @ w32.T).to(torch.float32)
    assert torch.isnan(y[:, [2, 6]]).all()
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    fin = ~torch.isnan(y_ref)
    mag = (x.to(torch.float64).abs() @ w32.abs().nan_to_num().T)
    assert_matches_reference(y[fin], y_ref.to(torch.float64)[fin], mag[fin], torch.float32, "mxfp8 finite columns")
