"""The AVX2 chunk multipliers that keep float32 x exact: affine 8-bit ("avx2-u8",
csrc/cpu/chunk_avx2.h) and GGUF Q4_K / Q6_K ("avx2-q4k", "avx2-q6k", csrc/cpu/gguf_avx2.cpp).

Each test first checks, with torch.ops.torch_qmm._cpu_route / _gguf_cpu_route, that the call
reached the multiplier it means to test (on a CPU with AVX512_BF16 the bfloat16 kernels come
first where their row limits allow: those affine calls are skipped here, the GGUF ones checked to
take that kernel), then compares against float64
references nobody here wrote the arithmetic of: torch_qmm.reference for affine, and
gguf.quants.dequantize (the gguf package) for the K-quants. Tolerance: tests/tolerance.py, the
half-ulp rule of x's dtype (float32: the float32 accumulation bound, relative to |x| @ |W|),
since each product q * x is rounded once and the sums are float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

import torch_qmm
from torch_qmm import reference

from gguf_helpers import GGUF_AVX2_MAX_ROWS, Q4_K, Q6_K, expected_gguf_route, random_k_blocks
from gguf_helpers import GGUF_AVX2_NAMES as GGUF_NAMES
from test_cpu_chunked import AVX2_AFFINE_MAX_ROWS, HAS_AVX2, HAS_BF16
from test_cpu_kernels import random_packed
from tolerance import assert_matches_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the AVX2 chunk kernels need AVX2 and FMA")


@pytest.fixture(autouse=True)
def _avx512_float32_kernels_aside(monkeypatch):
    """The AVX-512 float32 chunk kernels go before these where the CPU has AVX-512."""
    monkeypatch.setenv("TORCH_QMM_CPU_NO_F32_CHUNKS", "1")


def affine_route(x, wq, scales, biases, bits, gs) -> str:
    return torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, gs, True)


def _bf16_first(route: str) -> bool:
    return HAS_BF16 and route.startswith("chunked/bf16")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_u8_multiplier_matches_reference(group_size, dtype):
    """One and several 32-code chunks, K tails past the last chunk impossible (K = whole groups),
    W rows in tiles of 2 / 1 and spans of 128, x rows in blocks of 4 / 2 / 1."""
    gen = torch.Generator().manual_seed(group_size)
    for n, k in [(3, 128), (37, 384), (130, 256)]:
        if k % group_size:
            continue
        wq, scales, biases = random_packed(n, k, 8, group_size, dtype, gen)
        x_all = torch.randn(AVX2_AFFINE_MAX_ROWS + 1, k, generator=gen).to(dtype)
        for m in [1, 2, 3, 4, 5, 7, AVX2_AFFINE_MAX_ROWS]:
            x = x_all[:m]
            r = affine_route(x, wq, scales, biases, 8, group_size)
            if _bf16_first(r):
                continue
            assert r == "chunked/avx2-u8", f"M={m} N={n} K={k}: {r}"
            y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=group_size, bits=8)
            assert_matches_reference(y, reference.qmm(x, wq, scales, biases, 8, group_size, True),
                                     reference.qmm_magnitude(x, wq, scales, biases, 8, group_size, True), dtype,
                                     f"avx2-u8 M={m} N={n} K={k} gs={group_size}")
        x = x_all[:AVX2_AFFINE_MAX_ROWS + 1]
        assert affine_route(x, wq, scales, biases, 8, group_size) != "chunked/avx2-u8"  # past the row limit


def test_u8_multiplier_every_code_and_two_threads(threads):
    """All 256 codes in every byte position of a dword (the fields masked in place up to 255 << 24)."""
    n, k = 256, 256
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :] * 37) % 256
    wq = codes.to(torch.uint8).view(-1).view(torch.int32).view(n, k // 4).view(torch.uint32)
    gen = torch.Generator().manual_seed(9)
    scales = (torch.randn(n, k // 32, generator=gen) * 0.05)
    biases = (torch.randn(n, k // 32, generator=gen) * 0.2)
    x = torch.randn(3, k, generator=gen)
    assert affine_route(x, wq, scales, biases, 8, 32) in ("chunked/avx2-u8",) + (("chunked/bf16x3",) if HAS_BF16 else ())
    y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=32, bits=8)
    assert_matches_reference(y, reference.qmm(x, wq, scales, biases, 8, 32, True),
                             reference.qmm_magnitude(x, wq, scales, biases, 8, 32, True), torch.float32, "all codes")


def _gguf_case(ggml_type, n: int, k: int, seed: int):
    blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(seed))
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    return torch.from_numpy(blocks), w


def gguf_route(x, blocks, n, k, ggml_type) -> str:
    return torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(ggml_type), n, k)


def gguf_check(x, blocks, w, n, k, ggml_type, dtype, what):
    y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)
    xd = x.double()
    assert_matches_reference(y, xd @ w.T, xd.abs() @ w.abs().T, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_gguf_avx2_multipliers_match_gguf_dequantize(ggml_type, dtype):
    """Super-blocks 1 and 3, W rows in tiles and spans of 128 (N = 261), x rows in blocks of 4/2/1,
    and the first M past the row limit (another route, for comparison: the GEMM, or an AVX512_BF16
    chunk kernel whose row limit is higher; gguf_helpers.expected_gguf_route)."""
    for n, k in [(1, 256), (5, 768), (261, 256)]:
        blocks, w = _gguf_case(ggml_type, n, k, seed=n + k)
        x_all = torch.randn(GGUF_AVX2_MAX_ROWS + 1, k, generator=torch.Generator().manual_seed(n)).to(dtype)
        for m in [1, 2, 3, 4, 5, 7, GGUF_AVX2_MAX_ROWS, GGUF_AVX2_MAX_ROWS + 1]:
            x = x_all[:m]
            r = gguf_route(x, blocks, n, k, ggml_type)
            assert r == expected_gguf_route(dtype, m, ggml_type), f"M={m}: {r}"
            if m > GGUF_AVX2_MAX_ROWS:
                assert r != GGUF_NAMES[ggml_type], r
            gguf_check(x, blocks, w, n, k, ggml_type, dtype, f"{ggml_type.name} {r} M={m} N={n} K={k}")


def test_q4k_avx2_scales_and_mins_use_all_six_bits():
    """Every 6-bit scale and min (high bits from the packed bytes): scale bytes sweeping 0..255."""
    n, k = 256, 256
    blocks, _ = _gguf_case(Q4_K, n, k, seed=4)
    raw = blocks.numpy().reshape(n, 144).copy()
    raw[:, 4:16] = (np.arange(n)[:, None] * 7 + np.arange(12)[None, :] * 31) % 256
    w = torch.from_numpy(quants.dequantize(raw, Q4_K)).double()
    blocks = torch.from_numpy(raw.reshape(n, -1))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    r = gguf_route(x, blocks, n, k, Q4_K)
    assert r == "chunked/avx2-q4k" or _bf16_first(r), r
    gguf_check(x, blocks, w, n, k, Q4_K, torch.float32, "all scale bytes")


def test_q6k_avx2_negative_scales_and_every_high_field():
    """int8 sub-block scales of both signs (-128 included) and all four qh fields at their maximum."""
    n, k = 64, 512
    blocks, _ = _gguf_case(Q6_K, n, k, seed=6)
    raw = blocks.numpy().reshape(n * 2, 210).copy()
    raw[:, 192:208] = (np.arange(n * 2)[:, None] * 11 + np.arange(16)[None, :] * 17) % 256
    raw[::3, 128:192] = 0xFF
    w = torch.from_numpy(quants.dequantize(raw.reshape(n, -1), Q6_K)).double()
    blocks = torch.from_numpy(raw.reshape(n, -1))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(7))
    r = gguf_route(x, blocks, n, k, Q6_K)
    assert r == "chunked/avx2-q6k", r
    gguf_check(x, blocks, w, n, k, Q6_K, torch.float32, "scales and high fields")


def test_gguf_avx2_two_threads_batched_x_and_fallbacks(threads, monkeypatch):
    blocks, w = _gguf_case(Q6_K, 300, 1024, seed=8)
    x = torch.randn(2, 3, 1024, generator=torch.Generator().manual_seed(8))
    assert gguf_route(x, blocks, 300, 1024, Q6_K) == "chunked/avx2-q6k"
    gguf_check(x, blocks, w, 300, 1024, Q6_K, torch.float32, "2 threads")
    tiny = torch.randn(1, 1024)
    tiny[0, 5] = 1e-35  # below 2^-98: x * 2^-24 would leave the normal range
    assert gguf_route(tiny, blocks, 300, 1024, Q6_K) == "fused"
    gguf_check(tiny, blocks, w, 300, 1024, Q6_K, torch.float32, "tiny x")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    assert gguf_route(x[0], blocks, 300, 1024, Q6_K) == "fused"
