"""The AVX2 GGUF kernels with code fields taken as the bits of subnormal floats
("chunked/avx2-q4k-subnormal" and the same for q2k, q3k, q6k; csrc/cpu/gguf_avx2.cpp, Fields<true>)
give the same bits as the converting kernels ("chunked/avx2-q4k", ...) for every x they take,
are taken only for x in [2^-57, 2^48), and do not depend on the caller's flush-denormal mode. Their
agreement with the float64 reference is tested by test_cpu_gguf_float32.py (family
"avx2-subnormal")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from cpu_features import HAS_AVX2
from gguf_helpers import GGUF_AVX2_NAMES, GGUF_AVX2_SUBNORMAL_NAMES, NATIVE_K_TYPES, Q4_K, SUBNORMAL_X_RANGE
from gguf_helpers import assert_matches_reference, k_quant_magnitude, random_k_blocks

pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the AVX2 GGUF kernels need AVX2")
TYPES = [t for t in NATIVE_K_TYPES if t in GGUF_AVX2_NAMES]  # the types with AVX2 chunk kernels


@pytest.fixture(autouse=True)
def avx2_only(monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_NO_F32_CHUNKS", "1")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")


def _blocks(ggml_type, n, k, seed):
    blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(seed))
    return torch.from_numpy(blocks), torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()


def _run(monkeypatch, subnormal: str, x, blocks, n, k, ggml_type):
    monkeypatch.setenv("TORCH_QMM_CPU_SUBNORMAL_FIELDS", subnormal)
    route = torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(ggml_type), n, k)
    return route, torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)


def _subnormal_taken(ggml_type, m: int) -> bool:
    return ggml_type != Q4_K or m % 4 < 2


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_same_bits_as_the_converting_kernels(ggml_type, monkeypatch):
    """Every block of x rows (1 to 9 rows: blocks of 4, 2, 1), W tiles of 8 / 2 / 1 rows (N = 37),
    and x over the whole range, its ends included, with zeros."""
    n, k = 37, 768
    blocks, w = _blocks(ggml_type, n, k, seed=1)
    lo, hi = SUBNORMAL_X_RANGE
    gen = torch.Generator().manual_seed(2)
    for m in range(1, 10):
        for scale in (1.0, 1e-13, 1e13):
            z = torch.randn(m, k, generator=gen)
            x = torch.where(z.abs() < 1e-3, 1e-3, z) * scale  # |x| in [1e-3, 6] * scale: inside the range
            x[:, ::5] = 0.0
            x[0, 1], x[-1, 2] = lo, -float(np.nextafter(np.float32(hi), np.float32(0)))  # the float32 below 2^48
            sub_route, y_sub = _run(monkeypatch, "1", x, blocks, n, k, ggml_type)
            cvt_route, y_cvt = _run(monkeypatch, "0", x, blocks, n, k, ggml_type)
            expected = GGUF_AVX2_SUBNORMAL_NAMES if _subnormal_taken(ggml_type, m) else GGUF_AVX2_NAMES
            assert sub_route == expected[ggml_type], f"M={m} scale={scale}: {sub_route}"
            assert cvt_route == GGUF_AVX2_NAMES[ggml_type]
            assert torch.equal(y_sub, y_cvt), f"M={m} scale={scale}: {(y_sub - y_cvt).abs().max()}"
            mag = k_quant_magnitude(x, blocks, ggml_type)
            assert_matches_reference(y_sub, x.double() @ w.T, mag, torch.float32, f"M={m} scale={scale}")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("outside", [2.0**-57 * (1 - 2.0**-24), 2.0**48, 1e-25, 1e20], ids=str)
def test_x_outside_the_range_takes_the_converting_kernel(ggml_type, outside, monkeypatch):
    """One value just below 2^-57 or at 2^48 (or far outside, still inside the chunk kernels' own
    range [2^-98, 2^100]) sends the call to the converting kernel, with correct results."""
    n, k = 16, 512
    blocks, w = _blocks(ggml_type, n, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4))
    x[0, 7] = outside
    route, y = _run(monkeypatch, "1", x, blocks, n, k, ggml_type)
    assert route == GGUF_AVX2_NAMES[ggml_type]
    assert_matches_reference(y, x.double() @ w.T, k_quant_magnitude(x, blocks, ggml_type), torch.float32, str(outside))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_flush_denormal_mode_does_not_zero_the_fields(ggml_type, threads, monkeypatch):
    """torch.set_flush_denormal(True) sets DAZ, under which the fields would read as zero: the
    kernels keep subnormal operands for their own work, and the caller's mode is as it was after."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    torch.set_flush_denormal(False)
    n, k = 24, 512
    blocks, _ = _blocks(ggml_type, n, k, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    _, expected = _run(monkeypatch, "0", x, blocks, n, k, ggml_type)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.set_flush_denormal(True)
        route, y = _run(monkeypatch, "1", x, blocks, n, k, ggml_type)
        still_flushing = torch.tensor([1e-40]).mul(1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)
    assert route == GGUF_AVX2_SUBNORMAL_NAMES[ggml_type]
    assert torch.equal(y, expected), (y - expected).abs().max()
    assert still_flushing


@pytest.mark.parametrize("value", ["2", "yes", "-1", "1.0"])
def test_bad_switch_value_is_a_clear_error(value, monkeypatch):
    blocks, _ = _blocks(Q4_K, 8, 256, seed=7)
    monkeypatch.setenv("TORCH_QMM_CPU_SUBNORMAL_FIELDS", value)
    with pytest.raises(ValueError, match="TORCH_QMM_CPU_SUBNORMAL_FIELDS must be 0 or 1"):
        torch.ops.torch_qmm.gguf_qmm(torch.randn(1, 256), blocks, int(Q4_K), 8, 256)
