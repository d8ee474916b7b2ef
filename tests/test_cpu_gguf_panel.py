"""The GGUF Q4_K / Q6_K panel kernels (csrc/cpu/gguf_panel.cpp), whose vector lanes are 16 rows of
x: the float32 ones ("chunked/f32-panel-q4k", "-q6k", inside the AVX-512 float32 family) and the
bfloat16 ones for bfloat16 x ("chunked/bf16x1-panel-q4k", "-q6k", AVX512_BF16, ahead of every
family). Either takes the whole groups of 16 rows of a call and a last group of at least 14 rows;
the other kernels take the rows left. Each test runs on both (the `panel` fixture) and first
checks with torch.ops.torch_qmm._gguf_cpu_route that the call reached the panel.

Reference: gguf.quants.dequantize (the gguf package) in float64. Tolerance: tests/tolerance.py
relative to gguf_helpers.k_quant_magnitude (each product w * x is rounded once, or exact for the
bfloat16 ones, and the sums are float32); on exact operands (gguf_helpers.exact_k_blocks /
exact_x) the result must be the exact sum rounded once to the output dtype, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from cpu_features import HAS_BF16, HAS_VL
from gguf_helpers import GGUF_BF16_PANEL_NAMES, GGUF_PANEL_NAMES, Q4_K, Q6_K, assert_matches_reference
from gguf_helpers import exact_k_blocks, exact_x, expected_gguf_route, gguf_panel_rows, k_quant_magnitude
from gguf_helpers import q4k_every_scale_byte, q6k_signed_scales_and_full_high_fields, random_k_blocks

TYPES = [Q4_K, Q6_K]
# Around the group edges: 13 (no panel), 14-16 (one group), 17 (16 + 1 row on the other kernels),
# 29 (16 + 13), 30-32 (two groups), 77 (four groups + 13), 128 (eight), 129 (past the panels: the
# GEMM route).
ROWS = [13, 14, 15, 16, 17, 29, 30, 31, 32, 77, 128, 129]

# name: (built here, environment that makes the family reach it, route names, dtypes of x it takes)
PANELS = {
    # bfloat16 / float16 x of Q4_K go to the float32 family where the FMAs go first
    "f32": (HAS_VL, {"TORCH_QMM_CPU_FMA_FIRST": "1"}, GGUF_PANEL_NAMES,
            [torch.float32, torch.float16, torch.bfloat16]),
    "bf16": (HAS_VL and HAS_BF16, {"TORCH_QMM_CPU_FMA_FIRST": "0"}, GGUF_BF16_PANEL_NAMES, [torch.bfloat16]),
}


@pytest.fixture(params=list(PANELS))
def panel(request, monkeypatch) -> dict:
    built, env, names, dtypes = PANELS[request.param]
    if not built:
        pytest.skip(f"this CPU lacks the instruction set of the {request.param} panel kernels")
    for key in ("TORCH_QMM_CPU_NO_PANEL", "TORCH_QMM_CPU_NO_F32_CHUNKS", "TORCH_QMM_CPU_NO_BF16"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {**names, "dtypes": dtypes, "dtype": dtypes[0]}


def _blocks(ggml_type, n, k, seed, make=random_k_blocks, edit=None):
    blocks = make(ggml_type, n, k, np.random.default_rng(seed))
    if edit is not None:
        blocks = edit(blocks)
    return torch.from_numpy(blocks), torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()


def op(x, blocks, n, k, ggml_type):
    return torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)


def route(x, blocks, n, k, ggml_type) -> str:
    return torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(ggml_type), n, k)


def check(x, blocks, w, n, k, ggml_type, what):
    y = op(x, blocks, n, k, ggml_type)
    mag = k_quant_magnitude(x.reshape(-1, k), blocks, ggml_type).reshape(y.shape)
    assert_matches_reference(y, x.double() @ w.T, mag, x.dtype, what)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_panel_matches_gguf_dequantize(panel, ggml_type):
    """N of one W row, of whole tiles of 8 W rows and not (tiles of 1; spans of 128 at N = 261),
    1-3 super-blocks per row, every dtype of x the panel takes."""
    for dtype in panel["dtypes"]:
        for n, k in [(1, 256), (8, 256), (130, 512), (261, 768)]:
            blocks, w = _blocks(ggml_type, n, k, seed=n + k)
            x_all = torch.randn(129, k, generator=torch.Generator().manual_seed(n)).to(dtype)
            for m in ROWS:
                x = x_all[:m]
                r = route(x, blocks, n, k, ggml_type)
                assert r == expected_gguf_route(dtype, m, ggml_type), f"M={m}: {r}"
                assert (r == panel[ggml_type]) == (14 <= m <= 128), f"M={m}: {r}"
                check(x, blocks, w, n, k, ggml_type, f"{ggml_type.name} {r} M={m} N={n} K={k} {dtype}")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_exact_operands_give_the_exact_sum(panel, ggml_type):
    """Weights and x whose products and partial sums are exact in float32: the result must be the
    exact sum rounded once, so a decoding slip of a single weight (a wrong nibble, high field,
    scale or min) shows however small."""
    n, k = 40, 512
    blocks, w = _blocks(ggml_type, n, k, seed=11, make=exact_k_blocks)
    x = torch.from_numpy(exact_x(32, k, np.random.default_rng(12))).to(panel["dtype"])
    for m in (16, 30, 32):
        assert route(x[:m], blocks, n, k, ggml_type) == panel[ggml_type]
        exact = (x[:m].double() @ w.T).to(panel["dtype"])
        assert torch.equal(op(x[:m], blocks, n, k, ggml_type), exact), f"{ggml_type.name} M={m}"


def test_q4k_scales_and_mins_use_all_six_bits(panel):
    """Every 6-bit scale and min (high bits from the packed bytes): scale bytes sweeping 0..255."""
    n, k = 256, 256
    blocks, w = _blocks(Q4_K, n, k, seed=4, edit=lambda b: q4k_every_scale_byte(b, n))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5)).to(panel["dtype"])
    assert route(x, blocks, n, k, Q4_K) == panel[Q4_K]
    check(x, blocks, w, n, k, Q4_K, "all scale bytes")


def test_q6k_negative_scales_and_every_high_field(panel):
    """int8 sub-block scales of both signs (-128 included) and all four qh fields at their maximum
    in every third super-block."""
    n, k = 64, 512
    blocks, w = _blocks(Q6_K, n, k, seed=6, edit=lambda b: q6k_signed_scales_and_full_high_fields(b, n))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(panel["dtype"])
    assert route(x, blocks, n, k, Q6_K) == panel[Q6_K]
    check(x, blocks, w, n, k, Q6_K, "scales and high fields")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_in_any_group_and_thread_count(panel, ggml_type, threads):
    """A row's result does not depend on the group or lane it lands in, the zero lanes beside it,
    or the threads: rows 16-31 of a 32-row call equal a 16-row call on them, rows 16-29 of a 30-row
    call (a group of 14) the same rows; 1 and 2 threads agree."""
    n, k = 136, 768
    blocks, _ = _blocks(ggml_type, n, k, seed=9)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(10)).to(panel["dtype"])
    y32 = op(x, blocks, n, k, ggml_type)
    assert route(x[16:], blocks, n, k, ggml_type) == panel[ggml_type]
    assert torch.equal(op(x[16:], blocks, n, k, ggml_type), y32[16:])
    assert torch.equal(op(x[:30], blocks, n, k, ggml_type), y32[:30])
    torch.set_num_threads(1)
    assert torch.equal(op(x, blocks, n, k, ggml_type), y32)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_rows_past_the_groups_go_to_the_other_kernels(panel, ggml_type):
    """20 rows: the panel takes 16, the kernels of a 4-row call the last 4 (x and y offset by 16
    rows): those equal a 4-row call on them, the first 16 a 16-row call."""
    n, k = 72, 512
    blocks, w = _blocks(ggml_type, n, k, seed=13)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(14)).to(panel["dtype"])
    assert gguf_panel_rows(20) == 16
    assert route(x, blocks, n, k, ggml_type) == panel[ggml_type]
    assert route(x[16:], blocks, n, k, ggml_type) == expected_gguf_route(panel["dtype"], 4, ggml_type)
    assert "panel" not in route(x[16:], blocks, n, k, ggml_type)
    y = op(x, blocks, n, k, ggml_type)
    assert torch.equal(y[16:], op(x[16:], blocks, n, k, ggml_type))
    assert torch.equal(y[:16], op(x[:16], blocks, n, k, ggml_type))
    check(x, blocks, w, n, k, ggml_type, "16 + 4 rows")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_switch_and_range(panel, ggml_type, monkeypatch):
    """TORCH_QMM_CPU_NO_PANEL=1 leaves every row to the other kernels; x out of the chunk kernels'
    range (a value below 2^-98) skips them all, panels included."""
    n, k = 48, 256
    blocks, w = _blocks(ggml_type, n, k, seed=15)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(16)).to(panel["dtype"])
    monkeypatch.setenv("TORCH_QMM_CPU_NO_PANEL", "1")
    r = route(x, blocks, n, k, ggml_type)
    assert r == expected_gguf_route(panel["dtype"], 16, ggml_type) and "panel" not in r
    check(x, blocks, w, n, k, ggml_type, "panel stepped aside")
    monkeypatch.delenv("TORCH_QMM_CPU_NO_PANEL")
    x[3, 7] = 1e-35
    assert route(x, blocks, n, k, ggml_type) == "gemm"
    check(x, blocks, w, n, k, ggml_type, "x out of range")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_float32_x_at_medium_precision_takes_the_bfloat16_panel(ggml_type, monkeypatch):
    """float32 x under matmul precision "medium" is one bfloat16 term (QmmArgs::x_bf16_terms): the
    bfloat16 panel rounds it to nearest, within the tolerance of that precision."""
    if not PANELS["bf16"][0]:
        pytest.skip("this CPU lacks AVX512_BF16")
    monkeypatch.setenv("TORCH_QMM_CPU_FMA_FIRST", "0")
    n, k = 40, 512
    blocks, w = _blocks(ggml_type, n, k, seed=17)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(18))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert route(x, blocks, n, k, ggml_type) == GGUF_BF16_PANEL_NAMES[ggml_type]
        y = op(x, blocks, n, k, ggml_type)
    finally:
        torch.set_float32_matmul_precision(before)
    mag = k_quant_magnitude(x, blocks, ggml_type)
    assert_matches_reference(y, x.double() @ w.T, mag, torch.float32, "medium", precision="medium")
    # x rounded to nearest even, not truncated (off by up to 2^-8 of each x), so that the float32
    # accumulation bound alone holds against the same rounding elsewhere: Q6_K's products against
    # x so rounded; Q4_K (whose mins meet sums of x in float32) against its bfloat16 chunk kernel,
    # which rounds x that way (put_terms).
    if ggml_type == Q6_K:
        assert_matches_reference(y, x.bfloat16().double() @ w.T, mag, torch.float32, "x rounded to nearest")
    else:
        monkeypatch.setenv("TORCH_QMM_CPU_NO_PANEL", "1")
        torch.set_float32_matmul_precision("medium")
        try:
            assert route(x, blocks, n, k, ggml_type) == "chunked/bf16x1"
            y_chunk = op(x, blocks, n, k, ggml_type)
        finally:
            torch.set_float32_matmul_precision(before)
        assert_matches_reference(y, y_chunk.double(), mag, torch.float32, "x rounded as bf16x1 rounds it")


def test_float16_x_of_q4k_takes_the_float32_panel_where_it_takes_rows(monkeypatch):
    """float16 x (two bfloat16 terms) of Q4_K: the float32 family goes first where its panel
    kernels take rows (from 14), the bfloat16 chunk kernels below; the results against float64."""
    if not (HAS_VL and HAS_BF16):
        pytest.skip("the order concerns CPUs with both the float32 panel and AVX512_BF16")
    monkeypatch.setenv("TORCH_QMM_CPU_FMA_FIRST", "0")
    n, k = 40, 512
    blocks, w = _blocks(Q4_K, n, k, seed=19)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(20)).half()
    assert route(x[:13], blocks, n, k, Q4_K) == "chunked/bf16x2"
    for m in (14, 16, 20):
        assert route(x[:m], blocks, n, k, Q4_K) == GGUF_PANEL_NAMES[Q4_K] == expected_gguf_route(torch.float16, m, Q4_K)
        check(x[:m], blocks, w, n, k, Q4_K, f"float16 M={m}")
