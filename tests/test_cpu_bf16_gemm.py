"""The large-M bfloat16 GEMM route of CPU qmm (csrc/cpu/bf16_gemm.{h,cpp}).

Taken only where bfloat16 products are allowed (bfloat16 x, or float32 x under
torch.set_float32_matmul_precision("medium")), from kBf16GemmMinRows (16) rows, on CPUs whose
torch reports bfloat16 matrix units: with AMX-BF16 before the chunk kernels, with AVX512_BF16
alone (e.g. Zen 4) only where no chunk kernel serves the call (tests/cpu_features.py
takes_bf16_gemm); TORCH_QMM_CPU_FORCE_BF16_GEMM=1 forces it on any CPU for these tests,
TORCH_QMM_CPU_NO_BF16_GEMM=1 steps it aside. Oracle: float64 x @ W.T with W from torch_qmm.reference /
reference_fp (float64 dequantization). Bound: x and w rounded to bfloat16 (each off by <= 2^-9
relative; bfloat16 x: exact), float32 accumulation (K * 2^-24), y rounded to bfloat16 (2^-9 |y|):
|y - x W| <= (2^-8 + 2^-18 + K 2^-24) sum |x| |w| + 2^-9 |x W|.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import torch_qmm
from cpu_features import HAS_BF16_MATRIX_UNITS, HAS_BF16_TILES, takes_bf16_gemm
from torch_qmm import reference, reference_fp

ops = torch.ops.torch_qmm
CAPS = torch._C._cpu._get_cpu_capability()
HAS_UNITS = bool(CAPS.get("amx_bf16") or CAPS.get("avx512_bf16"))


@contextlib.contextmanager
def float32_precision(p):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(p)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def affine(N, K, dtype):
    w = torch.randn(N, K).to(dtype)
    wq, s, b = torch_qmm.quantize(w, group_size=64, bits=4)
    return (wq, s, b, 4, 64, "affine"), reference.dequantize(wq, s, b, 4, 64)


def mxfp4(N, K):
    wq, s = torch_qmm.quantize(torch.randn(N, K), mode="mxfp4")
    return (wq, s, None, 4, 32, "mxfp4"), reference_fp.dequantize_fp(wq, s, "mxfp4", dtype=torch.float64)


def route(x, packed):
    wq, s, b, bits, gs, mode = packed
    return ops._cpu_route(x, wq, s, b, bits, gs, True, mode)


def test_not_taken_by_default():
    packed, _ = affine(64, 256, torch.bfloat16)
    x = torch.randn(32, 256).to(torch.bfloat16)
    assert (route(x, packed) == "gemm-bf16") == takes_bf16_gemm(32, torch.bfloat16, bits=4, k=256)
    packed32, _ = affine(64, 256, torch.float32)
    assert route(torch.randn(32, 256), packed32) != "gemm-bf16"  # float32, precision "highest"


def bits8(N, K):
    w = torch.randn(N, K).to(torch.bfloat16)
    return (*torch_qmm.quantize(w, group_size=32, bits=8), 8, 32, "affine")


@pytest.mark.skipif(not HAS_BF16_MATRIX_UNITS, reason="no bfloat16 units: the route is only taken when forced")
def test_with_vector_units_only_the_chunk_kernels_go_first():
    """With AMX-BF16 tiles the route takes bfloat16 x from 16 rows; with AVX512_BF16 alone only
    the calls no chunk kernel serves: affine 4-bit at any M (the bfloat16 chunk kernel has no row
    limit), 8-bit past 32 rows, mxfp4 past 16 (the AVX2 fp kernels)."""
    four, _ = affine(64, 256, torch.bfloat16)
    fp4, _ = mxfp4(64, 256)
    eight = bits8(64, 256)
    x = lambda m: torch.randn(m, 256).to(torch.bfloat16)  # noqa: E731
    cases = [(four, 16), (four, 33), (four, 200), (eight, 16), (eight, 32), (eight, 33), (fp4, 16), (fp4, 17)]
    for packed, m in cases:
        r = route(x(m), packed)
        if HAS_BF16_TILES:
            assert r == "gemm-bf16", (packed[3:], m, r)
        else:  # AVX512_BF16 alone: the chunk kernels' rows stay theirs
            taken = (packed is eight and m > 32) or (packed is fp4 and m > 16)
            assert (r == "gemm-bf16") == taken, (packed[3:], m, r)
            assert r.startswith("chunked/") != taken, (packed[3:], m, r)


def test_no_bf16_gemm_steps_the_route_aside(monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_FORCE_BF16_GEMM", "1")
    packed = bits8(64, 256)
    x = torch.randn(40, 256).to(torch.bfloat16)
    assert route(x, packed) == "gemm-bf16"
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16_GEMM", "1")
    assert route(x, packed) == "gemm"


def test_forced_route_conditions(monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_FORCE_BF16_GEMM", "1")
    packed, _ = affine(64, 256, torch.bfloat16)
    assert route(torch.randn(32, 256).to(torch.bfloat16), packed) == "gemm-bf16"
    assert route(torch.randn(8, 256).to(torch.bfloat16), packed) != "gemm-bf16"  # small M
    packed32, _ = affine(64, 256, torch.float32)
    x32 = torch.randn(32, 256)
    for precision, taken in (("highest", False), ("high", False), ("medium", True)):
        with float32_precision(precision):
            assert (route(x32, packed32) == "gemm-bf16") == taken, precision
    packed16, _ = affine(64, 256, torch.float16)
    assert route(torch.randn(32, 256).to(torch.float16), packed16) != "gemm-bf16"
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")
    assert route(torch.randn(32, 256).to(torch.bfloat16), packed) != "gemm-bf16"


@pytest.mark.parametrize("fmt", ["affine-bf16", "affine-f32-medium", "mxfp4-bf16"])
def test_forced_route_within_the_bf16_bound(monkeypatch, fmt):
    monkeypatch.setenv("TORCH_QMM_CPU_FORCE_BF16_GEMM", "1")
    N, K, M = 300, 512, 33  # N past one 256-row tile
    xdtype = torch.float32 if "f32" in fmt else torch.bfloat16
    packed, w = mxfp4(N, K) if fmt.startswith("mxfp4") else affine(N, K, xdtype)
    x = torch.randn(M, K).to(xdtype)
    wq, s, b, bits, gs, mode = packed
    with float32_precision("medium" if xdtype == torch.float32 else "highest"):
        assert route(x, packed) == "gemm-bf16"
        y = torch_qmm.quantized_matmul(x, wq, s, b, group_size=gs, bits=bits, mode=mode)
    assert y.dtype == xdtype
    exact = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    bound = (2.0**-8 + 2.0**-18 + K * 2.0**-24) * mag + 2.0**-9 * exact.abs()
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    # bfloat16 rounding really happened (float32 x: the exact route would be ~2^-20 off).
    if xdtype == torch.float32:
        assert (err > 2.0**-14 * mag).any()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_forced_route_rounds_an_exact_sum_once(monkeypatch, bits):
    # bfloat16 x and a W whose dequantized weights are exact in bfloat16 (tests/exact_cases.py):
    # products and float32 sums are exact, so y must be the exact product rounded to nearest even,
    # bit for bit (W rounded another way, truncated y or a second rounding fail). N past one
    # 256-row tile, M from the route's 16 rows.
    from exact_cases import assert_bitwise, rounding_case

    monkeypatch.setenv("TORCH_QMM_CPU_FORCE_BF16_GEMM", "1")
    c = rounding_case(33, 300, 320, bits, 64, torch.bfloat16, True, seed=bits)
    assert c.rounded_fraction() > 0.1
    assert torch.ops.torch_qmm._cpu_route(*c.operands, bits, 64, True, "affine") == "gemm-bf16"
    y = torch_qmm.quantized_matmul(*c.operands, group_size=64, bits=bits)
    assert_bitwise(y, c.expected(), f"gemm-bf16 b{bits}")
