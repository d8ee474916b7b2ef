"""The GGUF chunk kernels that keep x exact with float32 FMAs, one family per instruction set:
AVX-512 ("f32-q4k", "f32-q6k", csrc/cpu/gguf_f32.cpp) and AVX2 ("avx2-q2k" .. "avx2-q6k", "avx2-iq4xs",
csrc/cpu/gguf_avx2.cpp; Q2_K, Q3_K, Q5_K and IQ4_XS have AVX2 kernels only). Each test runs on both (the
`family` fixture steps the other
kernels aside through their environment switches, the AVX-512 panel kernels too: those are
tests/test_cpu_gguf_panel.py's) and first checks, with
torch.ops.torch_qmm._gguf_cpu_route, that the call reached the kernel it means to test.

Reference: gguf.quants.dequantize (the gguf package) in float64. Tolerance: tests/tolerance.py,
the half-ulp rule of x's dtype on the output and the float32 accumulation bound relative to the
size of the terms the kernels add (gguf_helpers.k_quant_magnitude: the offsets are hoisted out of
the dot products), since each product q * x is rounded once and the sums are float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from cpu_features import HAS_AVX2, HAS_AVX512
from gguf_helpers import GGUF_AVX2_MAX_ROWS, GGUF_F32_MAX_ROWS, GGUF_F32_NAMES, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from gguf_helpers import LATTICE_AVX2_NAMES, LATTICE_TYPES, exact_k_blocks, exact_x, gguf_avx2_name
from gguf_helpers import assert_matches_reference, expected_gguf_route, k_quant_magnitude, q4k_every_scale_byte
from gguf_helpers import q6k_signed_scales_and_full_high_fields, random_k_blocks

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TYPES = [Q4_K, Q6_K]

# name: (built here, environment that steps the other chunk kernels aside, the route name for
# (ggml type, rows of x), rows of x up to which the family serves). The AVX2 family twice: with the
# code fields converted, and taken as subnormal floats (gguf_avx2.cpp, Fields).
AVX2_ONLY = {"TORCH_QMM_CPU_NO_F32_CHUNKS": "1", "TORCH_QMM_CPU_NO_BF16": "1"}
FAMILIES = {
    "f32": (HAS_AVX512, {"TORCH_QMM_CPU_FMA_FIRST": "1", "TORCH_QMM_CPU_NO_PANEL": "1"},
            lambda t, m: GGUF_F32_NAMES[t], GGUF_F32_MAX_ROWS),
    "avx2": (HAS_AVX2, {**AVX2_ONLY, "TORCH_QMM_CPU_SUBNORMAL_FIELDS": "0"}, gguf_avx2_name, GGUF_AVX2_MAX_ROWS),
    "avx2-subnormal": (HAS_AVX2, {**AVX2_ONLY, "TORCH_QMM_CPU_SUBNORMAL_FIELDS": "1"}, gguf_avx2_name,
                       GGUF_AVX2_MAX_ROWS),
}


AVX2_FAMILIES = ["avx2", "avx2-subnormal"]
LOW_TYPES = [Q2_K, Q3_K, Q5_K, IQ4_XS]  # the AVX2 families' only


@pytest.fixture(params=list(FAMILIES))
def family(request, monkeypatch) -> dict:
    built, env, name, max_rows = FAMILIES[request.param]
    if not built:
        pytest.skip(f"this CPU lacks the instruction set of the {request.param} GGUF kernels")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {"name": name, "max_rows": max_rows, "avx2": request.param in AVX2_FAMILIES}


def _case(ggml_type, n: int, k: int, seed: int, raw_edit=None):
    blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(seed))
    if raw_edit is not None:
        blocks = raw_edit(blocks)
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    return torch.from_numpy(blocks), w


def route(x, blocks, n, k, ggml_type) -> str:
    return torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(ggml_type), n, k)


def check(x, blocks, w, n, k, ggml_type, dtype, what):
    y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)
    mag = k_quant_magnitude(x.reshape(-1, k), blocks, ggml_type).reshape(y.shape)
    assert_matches_reference(y, x.double() @ w.T, mag, dtype, what)


def _every_scale_byte(ggml_type, n: int):
    """An edit of Q2_K / Q3_K / Q5_K / IQ4_XS blocks of n rows (one super-block each) whose scale
    bytes sweep 0..255 over the rows (Q2_K: every 4-bit scale and min; Q3_K and IQ4_XS: every
    6-bit scale; Q5_K: every 6-bit scale and min, high bits included), and whose high-bit bytes
    (Q3_K's hmask, Q5_K's qh) are all 0 or all 1 in two of every three rows."""
    first, count = {Q2_K: (0, 16), Q3_K: (96, 12), Q5_K: (4, 12), IQ4_XS: (2, 6)}[ggml_type]
    high = {Q3_K: slice(0, 32), Q5_K: slice(16, 48)}.get(ggml_type)

    def edit(blocks):
        raw = blocks.reshape(n, -1).copy()
        raw[:, first:first + count] = (np.arange(n)[:, None] * 7 + np.arange(count)[None, :] * 31) % 256
        if high is not None:
            raw[::3, high], raw[1::3, high] = 0x00, 0xFF
        return raw

    return edit


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", TYPES + LOW_TYPES, ids=lambda t: t.name)
def test_float32_kernels_match_gguf_dequantize(family, ggml_type, dtype):
    """Super-blocks 1, 2 and 3, W rows in tiles of 4 / 2 / 1 and spans of 128 (N = 261), x rows in
    blocks of 4 / 2 / 1, and the first M past the row limit (the GEMM, for comparison). Q2_K, Q3_K
    and Q5_K: the AVX2 families only (under "f32" their route is the AVX2 kernel, checked by
    expected_gguf_route)."""
    for n, k in [(1, 256), (5, 768), (130, 512), (261, 256)]:
        blocks, w = _case(ggml_type, n, k, seed=n + k)
        limit = family["max_rows"]
        x_all = torch.randn(limit + 1, k, generator=torch.Generator().manual_seed(n)).to(dtype)
        for m in sorted({1, 2, 3, 4, 5, 6, 7, 15, 16, limit, limit + 1}):
            x = x_all[:m]
            r = route(x, blocks, n, k, ggml_type)
            assert r == expected_gguf_route(dtype, m, ggml_type), f"M={m}: {r}"
            if ggml_type in TYPES or family["avx2"]:
                assert (r == family["name"](ggml_type, m)) == (m <= limit), f"M={m}: {r}"
            check(x, blocks, w, n, k, ggml_type, dtype, f"{ggml_type.name} {r} M={m} N={n} K={k}")


def test_q4k_scales_and_mins_use_all_six_bits(family):
    """Every 6-bit scale and min (high bits from the packed bytes): scale bytes sweeping 0..255."""
    n, k = 256, 256
    blocks, w = _case(Q4_K, n, k, seed=4, raw_edit=lambda b: q4k_every_scale_byte(b, n))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    assert route(x, blocks, n, k, Q4_K) == family["name"](Q4_K, 3)
    check(x, blocks, w, n, k, Q4_K, torch.float32, "all scale bytes")


def test_q6k_negative_scales_and_every_high_field(family):
    """int8 sub-block scales of both signs (-128 included) and all four qh fields at their maximum
    in every third super-block."""
    n, k = 64, 512
    blocks, w = _case(Q6_K, n, k, seed=6, raw_edit=lambda b: q6k_signed_scales_and_full_high_fields(b, n))
    for m in (1, 4):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
        assert route(x, blocks, n, k, Q6_K) == family["name"](Q6_K, m)
        check(x, blocks, w, n, k, Q6_K, torch.float32, f"scales and high fields M={m}")


@pytest.mark.parametrize("family", AVX2_FAMILIES, indirect=True)
@pytest.mark.parametrize("ggml_type", LOW_TYPES, ids=lambda t: t.name)
def test_avx2_only_types_every_scale_byte_and_high_bit(family, ggml_type):
    n, k = 256, 256
    blocks, w = _case(ggml_type, n, k, seed=9, raw_edit=_every_scale_byte(ggml_type, n))
    for m in (1, 2, 4):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(10 + m))
        assert route(x, blocks, n, k, ggml_type) == family["name"](ggml_type, m)
        check(x, blocks, w, n, k, ggml_type, torch.float32, f"{ggml_type.name} every scale byte M={m}")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_two_threads_batched_x_and_fallbacks(family, ggml_type, threads, monkeypatch):
    blocks, w = _case(ggml_type, 600, 1024, seed=8)
    x = torch.randn(2, 3, 1024, generator=torch.Generator().manual_seed(8))
    assert route(x, blocks, 600, 1024, ggml_type) == family["name"](ggml_type, 6)
    # Two threads take the spans: 7 of 72 W rows, then 6 of 16.
    assert torch.ops.torch_qmm._cpu_threads(x, 600, 1024) == 2
    check(x, blocks, w, 600, 1024, ggml_type, torch.float32, "2 threads")
    tiny = torch.randn(1, 1024)
    tiny[0, 5] = 1e-35  # below 2^-98: x * 2^-28 would leave the normal range
    assert route(tiny, blocks, 600, 1024, ggml_type) == "fused"
    check(tiny, blocks, w, 600, 1024, ggml_type, torch.float32, "tiny x")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_F32_CHUNKS", "1")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")
    assert route(x[0], blocks, 600, 1024, ggml_type) == "fused"


# ---- the lattice i-quants' AVX2 kernel (gguf_avx2.cpp, LatticeGroups) -----------------------------

@pytest.mark.skipif(not HAS_AVX2, reason="the lattice AVX2 kernel needs AVX2 and FMA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", LATTICE_TYPES, ids=lambda t: t.name)
def test_lattice_avx2_kernel_matches_gguf_dequantize(ggml_type, dtype, monkeypatch):
    """Super-blocks 1, 2 and 3, W rows in tiles of 2 / 1 (odd N), x rows in blocks of 4 / 3 / 2 / 1
    (M = 3: one block of 3; 7: 4 + 3; 5: 4 + 1; 14: 4 + 4 + 4 + 2), the row limit and the first M past
    it (the GEMM); the same calls on the scalar fused decode, forced."""
    for key, value in AVX2_ONLY.items():
        monkeypatch.setenv(key, value)
    for n, k in [(1, 256), (5, 768), (131, 512)]:
        blocks, w = _case(ggml_type, n, k, seed=n + k)
        x_all = torch.randn(GGUF_AVX2_MAX_ROWS + 1, k, generator=torch.Generator().manual_seed(n)).to(dtype)
        for m in (1, 2, 3, 5, 7, 14, GGUF_AVX2_MAX_ROWS, GGUF_AVX2_MAX_ROWS + 1):
            x = x_all[:m]
            r = route(x, blocks, n, k, ggml_type)
            assert r == expected_gguf_route(dtype, m, ggml_type)
            assert (r == LATTICE_AVX2_NAMES[ggml_type]) == (m <= GGUF_AVX2_MAX_ROWS), f"M={m}: {r}"
            check(x, blocks, w, n, k, ggml_type, dtype, f"{ggml_type.name} {r} M={m} N={n} K={k}")
    # x of any range takes it (x is used as it is): a row of subnormals alone (not flushed), one with
    # values up to 1e30 next to ordinary ones, then rows with an Inf / a NaN (F.linear's non-finite
    # pattern: Inf times weights of both signs is NaN)
    if dtype == torch.float32:
        wide = x_all[:4].clone()
        wide[0] = x_all[0] * 1e-39
        wide[1, :3] = torch.tensor([1e30, -2e29, 0.0])
        wide[2, 7], wide[3, 9] = float("inf"), float("nan")
        assert route(wide, blocks, n, k, ggml_type) == LATTICE_AVX2_NAMES[ggml_type]
        y = torch.ops.torch_qmm.gguf_qmm(wide, blocks, int(ggml_type), n, k)
        ref = wide.double() @ w.T
        # row 0: its products underflow to float32 subnormals, each rounded to a multiple of 2^-149
        # (absolute error up to 2^-150 per term, beyond the relative rule); flushed x would give 0
        sub_err = (y[0].double() - ref[0]).abs()
        assert (y[0] != 0).all() and (sub_err <= k * 2.0**-150 + 2e-5 * (wide[0].double().abs() @ w.abs().T)).all()
        check(wide[1:2], blocks, w, n, k, ggml_type, dtype, f"{ggml_type.name} x up to 1e30")
        for row in (2, 3):
            assert torch.equal(torch.isnan(y[row]), torch.isnan(ref[row])), f"{ggml_type.name} NaN pattern"
            assert torch.equal(y[row].isinf(), ref[row].isinf()) and torch.equal(y[row][y[row].isinf()], ref[row][ref[row].isinf()].float())
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    assert route(x_all[:3], blocks, n, k, ggml_type) == "fused"
    check(x_all[:3], blocks, w, n, k, ggml_type, dtype, f"{ggml_type.name} fused")


@pytest.mark.skipif(not HAS_AVX2, reason="the lattice AVX2 kernel needs AVX2 and FMA")
@pytest.mark.parametrize("ggml_type", LATTICE_TYPES, ids=lambda t: t.name)
def test_lattice_avx2_kernel_exact_sums_and_two_threads(ggml_type, threads):
    """exact_k_blocks / exact_x: every product and partial sum exact in float32, so y is the float64
    product rounded once, bit for bit, on the AVX2 kernel (one and two threads) and the fused decode."""
    rng = np.random.default_rng(60 + int(ggml_type))
    n, k = 37, 768
    blocks = torch.from_numpy(exact_k_blocks(ggml_type, n, k, rng))
    w = torch.from_numpy(quants.dequantize(blocks.numpy(), ggml_type)).double()
    for m in (1, 2, 3, 5, 7, 15, 16, 24):
        x = torch.from_numpy(exact_x(m, k, rng))
        expect = (x.double() @ w.T).float()
        y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)
        r = route(x, blocks, n, k, ggml_type)
        assert r == expected_gguf_route(torch.float32, m, ggml_type)
        assert torch.equal(y, expect), f"{ggml_type.name} {r} M={m}: {(y.double() - expect.double()).abs().max().item():.3e}"
