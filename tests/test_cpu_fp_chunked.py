"""The CPU fp chunk kernels (csrc/cpu/avx2_chunked.cpp, chunk_avx2.h) for mxfp4 and nvfp4.

qmm on CPU takes them for transpose=True, K of at least one chunk (64 codes), M up to
FP_MAX_ROWS (cpu::fp_chunked_max_rows) when the build has AVX2 and FMA; route name
"chunked/avx2-e2m1". Other calls take the generic fp path ("gemm"), except that bfloat16 x from
16 rows takes the bfloat16 GEMM route before both where the CPU has bfloat16 matrix units
(tests/cpu_features.py takes_bf16_gemm; held to its bound, precision "medium", against the
reference; the exact problems turn it off with TORCH_QMM_CPU_NO_BF16=1, which the AVX2 kernels
ignore, to check the chunk kernels at every M). Each test first asserts the
route torch.ops.torch_qmm._cpu_route names, then checks the result:

* against the float64 reference (torch_qmm/reference_fp.py) with the tolerance rule of
  torch_qmm/tolerance.py (float32 accumulation in any order, one rounding to x's dtype);
* on exact problems, bit for bit: x = integers * 2^-4, scales powers of two (e8m0) or short
  e4m3 values, so every product and partial sum the kernel forms (lanes of element * 2^17 times
  x, times scale * 2^-17) is a multiple of 2^-12 below 2^24 granules: float32 accumulation is
  exact, and y must be the exact product rounded once (to nearest even) to x's dtype.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_qmm
from torch_qmm import reference, reference_fp

from cpu_features import HAS_AVX2, bf16_precision, takes_bf16_gemm
from tolerance import assert_matches_reference

FP_MAX_ROWS = 16  # cpu::fp_chunked_max_rows
CHUNK = 64  # codes per chunk
MODES = {"mxfp4": 32, "nvfp4": 16}  # mode -> group size (MLX's only one)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MULTIPLIER = "chunked/avx2-e2m1"

pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the fp chunk kernels need AVX2 and FMA")


def expected_route(M: int, K: int, dtype=torch.float32, mode: str = "mxfp4") -> str:
    if takes_bf16_gemm(M, dtype, bits=4, k=K, mode=mode):
        return "gemm-bf16"
    return MULTIPLIER if K >= CHUNK and 1 <= M <= FP_MAX_ROWS else "gemm"


def route(x, wq, scales, mode, transpose=True) -> str:
    return torch.ops.torch_qmm._cpu_route(x, wq, scales, None, 4, MODES[mode], transpose, mode)


def qmm(x, wq, scales, mode, transpose=True):
    return torch_qmm.quantized_matmul(x, wq, scales, None, transpose=transpose, group_size=MODES[mode], bits=4,
                                      mode=mode)


def random_weights(mode, n, k, gen, scale_codes=None):
    """Random e2m1 codes (all 16) and scale bytes: e8m0 2^-8 .. 2^2; e4m3 from 2^-6 to 0.9375
    (exponent fields 1..6) unless given."""
    gs = MODES[mode]
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)
    if scale_codes is None:
        if mode == "mxfp4":
            scale_codes = torch.randint(127 - 8, 127 + 3, (n, k // gs), generator=gen)
        else:
            scale_codes = torch.randint(1 * 8, 7 * 8, (n, k // gs), generator=gen)
    return reference.pack(codes, 4), scale_codes.to(torch.uint8)


def check(x, wq, scales, mode, dtype, what):
    y = qmm(x, wq, scales, mode)
    gs = MODES[mode]
    y_ref = reference_fp.qmm_fp(x, wq, scales, mode, gs, 4)
    mag = reference_fp.qmm_fp_magnitude(x, wq, scales, mode, gs, 4)
    assert_matches_reference(y, y_ref, mag, dtype, what, precision=bf16_precision(x.shape[0], x.dtype, bits=4, k=x.shape[-1], mode=mode))


def _shapes():
    """(M, N, K): M at and around the x blocks (4/2/1) and the row limit; K below, at and above one
    chunk (tails of whole groups: mxfp4 32, nvfp4 16/32/48) and several chunks; N across the W
    tile (2 rows), the span of 128 rows and not a multiple of either."""
    out = []
    for M in sorted({1, 2, 3, 4, 5, 7, 8, FP_MAX_ROWS, FP_MAX_ROWS + 1}):
        out.append((M, 37, 320))
    for K in (32, 48, 64, 80, 96, 112, 128, 192, 5120 + 32):
        out.append((1, 37, K))
        out.append((3, 5, K))
    for N in (1, 2, 3, 129, 257):
        out.append((1, N, 128))
        out.append((4, N, 96))
    return out


SHAPES = _shapes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_fp_chunks_match_reference(mode, dtype):
    gen = torch.Generator().manual_seed(1 + list(MODES).index(mode))
    for M, N, K in SHAPES:
        if K % MODES[mode]:
            continue
        wq, scales = random_weights(mode, N, K, gen)
        x = torch.randn(M, K, generator=gen).to(dtype)
        assert route(x, wq, scales, mode) == expected_route(M, K, dtype, mode), (M, N, K)
        check(x, wq, scales, mode, dtype, f"{mode} M={M} N={N} K={K}")


def exact_case(mode, M, N, K, dtype, gen):
    """(x, wq, scales, expected) whose float32 accumulation is exact (module docstring)."""
    gs = MODES[mode]
    if mode == "mxfp4":
        scale_codes = torch.randint(127 - 4, 127 + 1, (N, K // gs), generator=gen)  # 2^-4 .. 1
    else:
        scale_codes = torch.randint(3 * 8, 7 * 8, (N, K // gs), generator=gen)  # e4m3 2^-4 .. 0.9375
    wq, scales = random_weights(mode, N, K, gen, scale_codes)
    x = (torch.randint(-16, 17, (M, K), generator=gen).to(torch.float64) / 16).to(dtype)
    y = reference_fp.qmm_fp(x, wq, scales, mode, gs, 4)
    assert torch.equal(y.to(torch.float32).to(torch.float64), y), "the product must be exact in float32"
    return x, wq, scales, y.to(torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_fp_chunks_exact_problems_bit_for_bit(mode, dtype, monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")  # the chunk kernels up to their last row
    gen = torch.Generator().manual_seed(11 + list(MODES).index(mode))
    for M, N, K in SHAPES:
        if K % MODES[mode] or K > 1024:
            continue
        x, wq, scales, expected = exact_case(mode, M, N, K, dtype, gen)
        assert route(x, wq, scales, mode) == expected_route(M, K, mode=mode)
        y = qmm(x, wq, scales, mode)
        mism = (y != expected).sum().item()
        assert mism == 0, f"{mode} {dtype} M={M} N={N} K={K}: {mism} outputs differ from the exact product rounded once"


def _every_code_and_scale(mode, scale_codes, x_scale):
    """W whose rows hold every element code at every position of a chunk (rotated patterns) and,
    over the rows, every scale byte of `scale_codes`; x ~ N(0, 1) * x_scale."""
    gs = MODES[mode]
    K = 256
    groups = K // gs
    rows = 16 * -(-len(scale_codes) // groups)
    codes = (torch.arange(K).reshape(1, K) + torch.arange(rows).reshape(rows, 1)) % 16
    flat = torch.tensor(scale_codes * (rows * groups // len(scale_codes) + 1))[: rows * groups]
    scales = flat.reshape(rows, groups).to(torch.uint8)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(3)) * x_scale
    return x, reference.pack(codes, 4), scales


@pytest.mark.parametrize("part", ["low", "high"])
@pytest.mark.parametrize("mode", list(MODES))
def test_fp_chunks_every_code_and_scale(mode, part):
    """Every element code in every lane of a chunk, every finite scale byte (e8m0 0..254 in two
    parts: x sized so that no product leaves the normal float32 range; e4m3: all but the NaN
    codes), against the reference."""
    if mode == "mxfp4":
        scale_codes = list(range(0, 127)) if part == "low" else list(range(127, 255))
        x_scale = 2.0**10 if part == "low" else 2.0**-20
    else:
        scale_codes = [c for c in range(128) if c != 0x7F] if part == "low" else [c for c in range(128, 256) if c != 0xFF]
        x_scale = 1.0
    x, wq, scales = _every_code_and_scale(mode, scale_codes, x_scale)
    assert route(x, wq, scales, mode) == MULTIPLIER
    check(x, wq, scales, mode, torch.float32, f"{mode} every code, scales {part}")


@pytest.mark.parametrize("mode", list(MODES))
def test_fp_chunks_non_finite_scales_match_ieee(mode):
    """Scales that decode to inf in float32 (e8m0 255 = 2^128) or NaN (e4m3 0x7F / 0xFF): y as IEEE
    arithmetic on the float32 dequantized weights gives it (MLX's float32 semantics: a zero code
    times an inf scale is NaN, which the sum carries)."""
    gs = MODES[mode]
    special = 255 if mode == "mxfp4" else 0x7F
    x, wq, scales = _every_code_and_scale(mode, [127, special, 120], 1.0)
    y = qmm(x, wq, scales, mode)
    w32 = reference_fp.dequantize_fp(wq, scales, mode, gs, 4, dtype=torch.float32).to(torch.float64)
    y_ref = (x.to(torch.float64) @ w32.T).to(torch.float32)
    assert torch.isnan(y_ref).any()
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    assert torch.equal(y[torch.isinf(y_ref)], y_ref[torch.isinf(y_ref)])


@pytest.mark.parametrize("mode", list(MODES))
def test_fp_chunks_huge_x_is_redone_when_not_finite(mode):
    """|x| near 2^110 overflows the kernel's unscaled lanes (element * 2^17 * x) while the true
    product, with tiny scales, is finite: the non-finite result is redone by the generic path."""
    gen = torch.Generator().manual_seed(5)
    gs = MODES[mode]
    small = 127 - 40 if mode == "mxfp4" else 8  # 2^-40 / 2^-6
    wq, scales = random_weights(mode, 9, 256, gen, torch.full((9, 256 // gs), small))
    x = torch.randn(2, 256, generator=gen) * 2.0**110
    assert route(x, wq, scales, mode) == MULTIPLIER
    y = qmm(x, wq, scales, mode)
    assert torch.isfinite(y).all()
    check(x, wq, scales, mode, torch.float32, f"{mode} huge x")


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_fp_chunks_non_finite_x_matches_ieee(value):
    gen = torch.Generator().manual_seed(6)
    wq, scales = random_weights("mxfp4", 7, 128, gen)
    x = torch.randn(1, 128, generator=gen)
    x[0, 9] = value
    y = qmm(x, wq, scales, "mxfp4")
    y_ref = reference_fp.qmm_fp(x, wq, scales, "mxfp4", 32, 4)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref.to(torch.float32)))
    assert torch.equal(y[~torch.isnan(y)], y_ref.to(torch.float32)[~torch.isnan(y)])


def test_fp_chunks_two_threads_and_3d_x(threads):
    gen = torch.Generator().manual_seed(8)
    for mode in MODES:
        wq, scales = random_weights(mode, 1000, 1024, gen)
        for shape in [(1, 1, 1024), (2, 3, 1024)]:
            x = torch.randn(*shape, generator=gen)
            assert route(x, wq, scales, mode) == MULTIPLIER
            y = qmm(x, wq, scales, mode)
            gs = MODES[mode]
            x2 = x.reshape(-1, 1024)
            y_ref = reference_fp.qmm_fp(x2, wq, scales, mode, gs, 4)
            mag = reference_fp.qmm_fp_magnitude(x2, wq, scales, mode, gs, 4)
            assert_matches_reference(y.reshape(-1, 1000), y_ref, mag, torch.float32, f"{mode} {shape}")


def test_fp_other_shapes_take_the_generic_path():
    gen = torch.Generator().manual_seed(9)
    wq, scales = random_weights("mxfp4", 64, 32, gen)  # W [K=64, N=32] for transpose=False
    x = torch.randn(1, 64, generator=gen)
    assert route(x, wq, scales, "mxfp4", transpose=False) == "gemm"
    check_n = torch_qmm.quantized_matmul(x, wq, scales, None, transpose=False, group_size=32, bits=4, mode="mxfp4")
    y_ref = reference_fp.qmm_fp(x, wq, scales, "mxfp4", 32, 4, transpose=False)
    mag = reference_fp.qmm_fp_magnitude(x, wq, scales, "mxfp4", 32, 4, transpose=False)
    assert_matches_reference(check_n, y_ref, mag, torch.float32, "transpose=False")
    wq, scales = random_weights("mxfp4", 8, 32, gen)
    assert route(torch.randn(1, 32), wq, scales, "mxfp4") == "gemm"  # K < one chunk
    assert route(torch.randn(0, 32), wq, scales, "mxfp4") == "empty"
