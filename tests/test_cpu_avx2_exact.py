"""The AVX2 chunk multipliers that keep float32 x exact for affine 8-bit ("avx2-u8") and for the
bit streams of 3, 5 and 6 bits ("avx2-u3", "avx2-u5", "avx2-u6"), csrc/cpu/chunk_avx2.h; the
GGUF ones are tested in test_cpu_gguf_float32.py.

Each test first checks, with torch.ops.torch_qmm._cpu_route, that the call reached the
multiplier it means to test (on a CPU with AVX512_BF16 the bfloat16 kernels come first where
their row limits allow: those calls are skipped here), then compares against the float64
reference torch_qmm.reference. Tolerance: tests/tolerance.py, the
half-ulp rule of x's dtype (float32: the float32 accumulation bound, relative to |x| @ |W|),
since each product q * x is rounded once and the sums are float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm import reference

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


def _pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 words holding each row of codes as one little-endian bit stream (code k at bits
    [k * bits, (k + 1) * bits)), as MLX packs them; written here from that definition."""
    rows, k = codes.shape
    stream = ((codes[:, :, None] >> torch.arange(bits)) & 1).to(torch.uint8).numpy().reshape(rows, k * bits)
    packed = np.packbits(stream, axis=1, bitorder="little")
    return torch.from_numpy(packed.copy()).view(torch.int32).view(torch.uint32).reshape(rows, k * bits // 32)


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_stream_multipliers_every_code_in_every_position(bits, threads):
    """Codes that straddle bytes and dwords: row r holds code (r + 7p) mod 2^bits at position p, so
    every code stands at every position of a chunk (32 codes; 64 for 3 bits) in some row."""
    n, k = 2**bits, 256
    codes = (torch.arange(n)[:, None] + 7 * torch.arange(k)[None, :]) % n
    wq = _pack_stream(codes, bits)
    assert torch.equal(reference.unpack(wq, bits), codes)
    gen = torch.Generator().manual_seed(bits)
    scales = torch.randn(n, k // 32, generator=gen) * 0.05
    biases = torch.randn(n, k // 32, generator=gen) * 0.2
    for m in (1, 2, 3, 5):
        x = torch.randn(m, k, generator=gen)
        r = affine_route(x, wq, scales, biases, bits, 32)
        if _bf16_first(r):
            continue
        assert r == f"chunked/avx2-u{bits}", f"M={m}: {r}"
        y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=32, bits=bits)
        assert_matches_reference(y, reference.qmm(x, wq, scales, biases, bits, 32, True),
                                 reference.qmm_magnitude(x, wq, scales, biases, bits, 32, True), torch.float32,
                                 f"avx2-u{bits} every code M={m}")
