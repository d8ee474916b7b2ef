"""The CPU chunk kernels (csrc/cpu/qmm_chunked.cpp, chunk.h) on every multiplier and bit width.

affine_qmm on CPU takes them for transpose=True, K of at least one chunk (512/bits codes for
bits 2/4/8, 32 for the bit streams of 3/5/6) when the build has AVX-512, with x in range. Multipliers: "bf16xP"
(AVX512_BF16, x as P bfloat16 terms: 1 for bfloat16 x, 2 for float16, 3 for float32, or fewer
for float32 when torch.set_float32_matmul_precision allows; up to cpu::chunked_max_rows rows of
x) and "f32" (float32 FMAs, bits 4 and 8 up to 15 rows: before the bfloat16 ones for float32 x,
and for 16-bit x on Intel CPUs; forced here with TORCH_QMM_CPU_NO_BF16=1).
From 16 rows, x allowed in bfloat16 takes the bfloat16 GEMM route before them where the CPU has
bfloat16 matrix units (tests/cpu_features.py takes_bf16_gemm).
torch.ops.torch_qmm._cpu_route names the kernel a call takes, so each test first checks it
reached the one it means to test.
"""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm import reference

from cpu_features import BF16_GEMM_MIN_ROWS, HAS_AVX2, HAS_AVX512, HAS_BF16, HAS_VBMI  # noqa: F401 (shared with other tests)
from cpu_features import F32_MAX_ROWS, affine_chunk_route, bf16_precision, takes_bf16_gemm
from cpu_features import CHUNKED_MAX_ROWS as MAX_ROWS  # noqa: F401 (shared with other tests)
from cpu_features import AVX2_AFFINE_CHUNKS as AVX2_CHUNKS, AVX2_AFFINE_MAX_ROWS  # noqa: F401 (shared with other tests)
from tolerance import assert_matches_reference
from test_cpu_kernels import random_packed

# The AVX2 chunk kernels (csrc/cpu/avx2_chunked.cpp; HAS_AVX2): affine 4-bit (64-code chunks) and
# 8-bit (32-code chunks), up to cpu::avx2_affine_max_rows rows, where the AVX-512 ones do not serve the call.
AVX2_CHUNK = 64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TERMS = {torch.bfloat16: 1, torch.float16: 2}  # exact; float32: by precision
PRECISION_TERMS = {"highest": 3, "high": 2, "medium": 1}

CHUNK_BITS = [2, 3, 4, 5, 6, 8]
# Rows of x in blocks of 4/2/1, W rows in tiles of 4 (M<=2) or 2 and spans of 128.
MS = [1, 2, 3, 4, 5, 7, 9, 16]

pytestmark = pytest.mark.skipif(not HAS_AVX512, reason="the 4-bit chunk kernels are AVX-512 only; other CPUs use the fused kernel (tests/test_cpu_kernels.py)")


@pytest.fixture(params=["bf16", "f32"])
def tile(request, monkeypatch):
    """Which tile family the op may use: the bfloat16 one where the routes allow it
    (TORCH_QMM_CPU_FMA_FIRST=0: float32 x still takes the float32 kernels first), or float32
    only."""
    if request.param == "f32":
        monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")
    elif not HAS_BF16:
        pytest.skip("this CPU has no AVX512_BF16: the bfloat16 tile is not built")
    else:
        monkeypatch.delenv("TORCH_QMM_CPU_NO_BF16", raising=False)
        monkeypatch.setenv("TORCH_QMM_CPU_FMA_FIRST", "0")
    return request.param


@pytest.fixture
def precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def expected_route(tile: str, dtype: torch.dtype, precision: str = "highest", m: int = 1, bits: int = 4,
                   k: int = 512) -> str:
    if takes_bf16_gemm(m, dtype, precision=precision, no_bf16=tile == "f32", bits=bits, k=k):
        return "gemm-bf16"  # before the chunk kernels (tests/cpu_features.py)
    terms = TERMS.get(dtype, PRECISION_TERMS[precision])
    chunked = affine_chunk_route(bits, terms, m, k, no_bf16=tile == "f32")
    return chunked or ("fused" if m < 16 else "gemm")  # cpu::kGemmMinRows


def route(x, wq, scales, biases, group_size, transpose=True, bits=4) -> str:
    return torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, group_size, transpose)


def check(x, wq, scales, biases, group_size, dtype, what, precision="highest", bits=4):
    """y against the float64 reference, at the tolerance of `precision` (the float32 matmul
    precision set), or "medium" where the call takes gemm-bf16."""
    precision = bf16_precision(x.numel() // x.shape[-1], x.dtype, precision=precision, bits=bits, k=x.shape[-1])
    y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=group_size, bits=bits)
    y_ref = reference.qmm(x, wq, scales, biases, bits, group_size, True)
    mag = reference.qmm_magnitude(x, wq, scales, biases, bits, group_size, True)
    assert_matches_reference(y, y_ref, mag, dtype, what, precision=precision)
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", CHUNK_BITS)
def test_chunk_kernels_match_reference(tile, bits, group_size, dtype):
    """One and several whole chunks (512/bits codes), tails of 1..7 blocks of 32, W rows in tiles
    and spans of 128, x rows in blocks of 4/2/1 (M in MS)."""
    gen = torch.Generator().manual_seed(100 * bits + group_size)
    chunk = 32 if bits in (3, 5, 6) else 512 // bits
    ks = sorted({chunk, 3 * chunk, 384, 640} | {chunk + t * 32 for t in (1, 3, chunk // 32 - 1) if 0 < t < chunk // 32})
    for k in ks:
        if k % group_size:
            continue
        for n in [1, 3, 130, 261]:
            wq, scales, biases = random_packed(n, k, bits, group_size, dtype, gen)
            x_all = torch.randn(max(MS), k, generator=gen).to(dtype)
            for m in MS:
                x = x_all[:m]
                assert route(x, wq, scales, biases, group_size, bits=bits) == expected_route(tile, dtype, m=m, bits=bits, k=k)
                check(x, wq, scales, biases, group_size, dtype, f"{tile} bits={bits} M={m} N={n} K={k}", bits=bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", CHUNK_BITS)
def test_chunk_kernels_up_to_their_row_limit(tile, bits, dtype):
    """Each multiplier at its last M and the next (MAX_ROWS, F32_MAX_ROWS; no limit: 199/200 here; where the
    bfloat16 GEMM route takes the rows past 15 from the multiplier: 15/16): the route changes
    exactly there and both sides match the reference."""
    gen = torch.Generator().manual_seed(21 + bits)
    wq, scales, biases = random_packed(70, 512, bits, 64, dtype, gen)
    limit = MAX_ROWS[bits, TERMS.get(dtype, 3)] or 199
    if tile == "f32" and bits in F32_MAX_ROWS:
        limit = F32_MAX_ROWS[bits]
    if tile == "bf16" and takes_bf16_gemm(limit, dtype, no_bf16=False, bits=bits, k=512):
        limit = min(limit, BF16_GEMM_MIN_ROWS - 1)
    for m in [limit, limit + 1]:
        x = torch.randn(m, 512, generator=gen).to(dtype)
        assert route(x, wq, scales, biases, 64, bits=bits) == expected_route(tile, dtype, m=m, bits=bits, k=512)
        check(x, wq, scales, biases, 64, dtype, f"{tile} bits={bits} M={m}", bits=bits)


def test_chunk_kernels_two_threads_and_3d_x(tile, threads):
    """Spans claimed by two threads; x given as [2, 3, K] (M=6: blocks of 4 and 2)."""
    gen = torch.Generator().manual_seed(7)
    wq, scales, biases = random_packed(1000, 1024, 4, 64, torch.float32, gen)
    for shape in [(1, 1, 1024), (2, 3, 1024)]:
        x = torch.randn(*shape, generator=gen)
        m = shape[0] * shape[1]
        assert route(x, wq, scales, biases, 64) == expected_route(tile, torch.float32, m=m, k=1024)
        check(x, wq, scales, biases, 64, torch.float32, f"{tile} 2 threads x {shape}")


@pytest.mark.skipif(not HAS_BF16, reason="needs AVX512_BF16 (precision only changes the bfloat16 tile)")
def test_float32_precision_setting_rounds_x_within_its_bound(precision, monkeypatch):
    """"high"/"medium" keep float32 x as 2/1 bfloat16 terms: each x off by <= 2^-16 / 2^-8 of
    itself (torch_qmm/tolerance.py X_RTOL), and visibly less exact than "highest". (Where the
    float32 FMA kernels go first, they keep x exact at every setting: stepped aside here.)"""
    monkeypatch.setenv("TORCH_QMM_CPU_FMA_FIRST", "0")
    gen = torch.Generator().manual_seed(11)
    wq, scales, biases = random_packed(300, 4096, 4, 64, torch.float32, gen)
    x = torch.randn(3, 4096, generator=gen)  # full 24-bit significands
    y_ref = reference.qmm(x, wq, scales, biases, 4, 64, True)
    mag = reference.qmm_magnitude(x, wq, scales, biases, 4, 64, True)
    worst = {}
    for name in ["highest", "high", "medium"]:
        precision(name)
        assert route(x, wq, scales, biases, 64) == expected_route("bf16", torch.float32, name, m=3, k=4096)
        y = check(x, wq, scales, biases, 64, torch.float32, name, precision=name)
        worst[name] = ((y.double() - y_ref).abs() / mag).max().item()
    # Random rounding of x to 8 / 16 bits leaves ~1e-5 / ~1e-7 of the magnitude here; float32
    # sums of the exact products (3 terms) ~1e-8. This is what tells 3 terms from 2.
    assert worst["medium"] > 30 * worst["high"] > 90 * worst["highest"], worst


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs_ignore_the_float32_precision_setting(precision, dtype):
    """float16 / bfloat16 x are exact as 2 / 1 bfloat16 terms whatever the setting says."""
    gen = torch.Generator().manual_seed(12)
    wq, scales, biases = random_packed(64, 512, 4, 32, dtype, gen)
    x = torch.randn(2, 512, generator=gen).to(dtype)
    precision("medium")
    assert route(x, wq, scales, biases, 32) == expected_route("bf16" if HAS_BF16 else "f32", dtype, m=2, k=512)
    check(x, wq, scales, biases, 32, dtype, "medium")


@pytest.mark.parametrize("value, what", [(1e-35, "tiny"), (2.0**101, "huge")])
def test_x_out_of_range_takes_the_fused_kernel(tile, value, what):
    """One element of |x| below 2^-98 or above 2^100 (here in the last row of x) sends the call to
    the fused kernel, which still matches the reference (the bfloat16 terms would be flushed / the
    unscaled sums overflow)."""
    gen = torch.Generator().manual_seed(13)
    wq, scales, biases = random_packed(40, 256, 4, 64, torch.float32, gen)
    x = torch.randn(1, 256, generator=gen)
    if what == "huge":
        x *= 2.0**90  # the whole row large too
    x[0, 17] = value
    assert route(x, wq, scales, biases, 64) == "fused"
    x = torch.cat([torch.randn(2, 256, generator=gen), x])
    assert route(x, wq, scales, biases, 64) == "fused"
    check(x, wq, scales, biases, 64, torch.float32, what)
    # The range edges themselves stay on this kernel.
    x_edge = torch.randn(1, 256, generator=gen)
    x_edge[0, 0], x_edge[0, 1] = 2.0**-98, 2.0**100
    assert route(x_edge, wq, scales, biases, 64) == expected_route(tile, torch.float32, k=256)
    check(x_edge, wq, scales, biases, 64, torch.float32, f"{what} edge")


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_x_takes_the_fused_kernel(tile, value):
    gen = torch.Generator().manual_seed(14)
    wq, scales, biases = random_packed(8, 256, 4, 64, torch.float32, gen)
    x = torch.randn(1, 256, generator=gen)
    x[0, 5] = value
    assert route(x, wq, scales, biases, 64) == "fused"


def test_other_shapes_do_not_take_the_chunk_kernels(tile):
    gen = torch.Generator().manual_seed(15)
    wq, scales, biases = random_packed(8, 256, 4, 64, torch.float32, gen)
    assert route(torch.randn(1, 8), wq, scales, biases, 64, transpose=False) == "fused"  # W [K=8, N=256]
    wq, scales, biases = random_packed(8, 224, 2, 32, torch.float32, gen)
    assert route(torch.randn(1, 224), wq, scales, biases, 32, bits=2) == "fused"  # K < 256 (one 2-bit chunk)
    wq, scales, biases = random_packed(8, 96, 4, 32, torch.float32, gen)
    # K < 128 (one AVX-512 4-bit chunk); at least one AVX2 chunk (64 codes)
    assert route(torch.randn(1, 96), wq, scales, biases, 32) == ("chunked/avx2-u4" if HAS_AVX2 else "fused")
    assert route(torch.randn(0, 96), wq, scales, biases, 32) == "empty"
