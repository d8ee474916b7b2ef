"""The CPU GGUF chunk kernels (csrc/cpu/gguf_chunked.cpp) against gguf.quants.dequantize.

gguf_qmm on CPU takes them for Q4_K and Q6_K when the build has AVX512_BF16 (not avoided with
TORCH_QMM_CPU_NO_BF16=1), x in range, and M up to a limit per type and bfloat16 terms of x (3 /
2 / 1 for float32 / float16 / bfloat16; MAX_ROWS); past that the AVX2 GGUF chunk kernels up to
15 rows, then the fused decode / GEMM (gguf_helpers.expected_gguf_route). The AVX-512 float32
kernels, which go first where they serve, are stepped aside here.
torch.ops.torch_qmm._gguf_cpu_route names the kernel a call takes; each test checks it reached
the one it means to test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from cpu_features import HAS_AVX2, HAS_BF16
from gguf_helpers import GGUF_BF16_MAX_ROWS, Q4_K, Q6_K, assert_matches_reference, gguf_avx2_name
from gguf_helpers import expected_gguf_route, k_quant_magnitude, random_k_blocks
from test_cpu_chunked import TERMS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TYPES = [Q4_K, Q6_K]
MAX_ROWS = GGUF_BF16_MAX_ROWS

pytestmark = pytest.mark.skipif(not HAS_BF16, reason="the Q4_K chunk kernel needs AVX512_BF16; other CPUs use the fused decode (tests/test_gguf_qmm.py)")


@pytest.fixture(autouse=True)
def _avx512_float32_kernels_aside(monkeypatch):
    """The AVX-512 float32 GGUF kernels (tests/test_cpu_gguf_float32.py) go before these for
    float32 x and Q6_K, and on Intel for every x."""
    monkeypatch.setenv("TORCH_QMM_CPU_NO_F32_CHUNKS", "1")


def _case(n: int, k: int, seed: int, ggml_type=Q4_K):
    blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(seed))
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    return torch.from_numpy(blocks), w


def route(x, blocks, n, k, ggml_type=Q4_K) -> str:
    return torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(ggml_type), n, k)


def check(x, blocks, w, n, k, dtype, what, ggml_type=Q4_K):
    y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)
    xd = x.double()
    assert_matches_reference(y, xd @ w.T, k_quant_magnitude(x.reshape(-1, k), blocks, ggml_type).reshape(y.shape),
                             dtype, what)


def expected(dtype, m: int, ggml_type=Q4_K) -> str:
    return expected_gguf_route(dtype, m, ggml_type)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_chunk_kernels_match_gguf_dequantize(ggml_type, dtype):
    """Super-blocks 1 and 3, W rows in tiles and spans of 128, x rows in blocks of 4/2/1 (each M
    below the type's limit, and past it: another route, for comparison)."""
    for n, k in [(1, 256), (5, 768), (130, 512), (261, 256)]:
        blocks, w = _case(n, k, seed=n + k, ggml_type=ggml_type)
        x_all = torch.randn(16, k, generator=torch.Generator().manual_seed(n)).to(dtype)
        for m in [1, 2, 3, 4, 5, 7, 16]:
            x = x_all[:m]
            assert route(x, blocks, n, k, ggml_type) == expected(dtype, m, ggml_type)
            check(x, blocks, w, n, k, dtype, f"{ggml_type.name} M={m} N={n} K={k}", ggml_type)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_chunk_kernels_up_to_their_row_limit(ggml_type, dtype):
    blocks, w = _case(20, 512, seed=3, ggml_type=ggml_type)
    limit = MAX_ROWS[ggml_type, TERMS.get(dtype, 3)]
    for m in [limit, limit + 1]:
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
        assert route(x, blocks, 20, 512, ggml_type) == expected(dtype, m, ggml_type)
        check(x, blocks, w, 20, 512, dtype, f"{ggml_type.name} M={m}", ggml_type)


def test_q4k_scales_and_mins_use_all_six_bits(monkeypatch):
    """Every 6-bit scale and min value (high bits from the packed bytes) on the chunk kernel:
    blocks with scale bytes sweeping 0..255 against the gguf package. (Float32 x takes the AVX2
    kernel first where it is built; with it stepped aside the bfloat16 one serves.)"""
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    n, k = 256, 256
    blocks, _ = _case(n, k, seed=4)
    raw = blocks.numpy().reshape(n, 144).copy()
    raw[:, 4:16] = (np.arange(n)[:, None] * 7 + np.arange(12)[None, :] * 31) % 256
    w = torch.from_numpy(quants.dequantize(raw, Q4_K)).double()
    blocks = torch.from_numpy(raw.reshape(n, -1))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    assert route(x, blocks, n, k) == "chunked/bf16x3"
    check(x, blocks, w, n, k, torch.float32, "all scale bytes")


def test_q4k_chunk_kernel_two_threads_and_batched_x(threads, monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")  # the bfloat16 kernel (float32 x takes AVX2 first)
    blocks, w = _case(600, 1024, seed=6)
    x = torch.randn(2, 3, 1024, generator=torch.Generator().manual_seed(6))
    assert route(x, blocks, 600, 1024) == "chunked/bf16x3"
    assert torch.ops.torch_qmm._cpu_threads(x, 600, 1024) == 2  # long spans, then short ones
    y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(Q4_K), 600, 1024)
    xd = x.double()
    mag = k_quant_magnitude(x.reshape(-1, 1024), blocks, Q4_K).reshape(y.shape)
    assert_matches_reference(y, xd @ w.T, mag, torch.float32, "2 threads")


def test_other_inputs_take_the_fused_decode(monkeypatch):
    """x out of range, or both chunk families turned off: the fused decode. With only the
    bfloat16 kernels off (TORCH_QMM_CPU_NO_BF16=1) the AVX2 kernels serve where built, and refuse
    the tiny x too."""
    blocks, w = _case(8, 256, seed=7)
    x = torch.randn(1, 256)
    x[0, 9] = 1e-35  # below 2^-98: the bfloat16 terms would be flushed
    assert route(x, blocks, 8, 256) == "fused"
    check(x, blocks, w, 8, 256, torch.float32, "tiny x")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")
    assert route(x, blocks, 8, 256) == "fused"
    b6, _ = _case(8, 256, seed=8, ggml_type=Q6_K)
    for b, t in ((blocks, Q4_K), (b6, Q6_K)):
        assert route(torch.randn(1, 256), b, 8, 256, t) == (gguf_avx2_name(t, 1) if HAS_AVX2 else "fused")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    for b, t in ((blocks, Q4_K), (b6, Q6_K)):
        assert route(torch.randn(1, 256), b, 8, 256, t) == "fused"
