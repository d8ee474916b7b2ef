"""Every CPU affine_qmm route, reached on purpose at and around its boundaries, checked bit for bit.

Each case first asserts the route torch.ops.torch_qmm._cpu_route names (the table below restates
csrc/cpu/qmm_kernels.h: first, transpose=True, bfloat16 x from 16 rows takes the bfloat16 GEMM
route where the CPU has bfloat16 matrix units (tests/cpu_features.py takes_bf16_gemm; its products
are exact on these problems, whose weights are exact in bfloat16); then AVX-512 chunk kernels from
one chunk of K (tests/cpu_features.py affine_chunk_route: the float32 one for bits 4 / 8 up to 24
/ 16 rows, first for float32 x and on Intel CPUs for 16-bit x, where bits 4 / 8 never take the
bfloat16 ones; the bfloat16 ones up to chunked_max_rows rows), then the AVX2 4-bit / 8-bit chunk kernels up to 15 rows from K = 64 / 32,
fused below 16 rows, GEMM from 16),
then runs two exact problems (tests/exact_cases.py): one whose float32 accumulation is exact (y
must be the exact product rounded to nearest even: truncation or double rounding fails), one
that selects single x values (float32 x must be used with all 24 bits: the third bfloat16 term;
float16 x with all 11). Shapes sit on both sides of every boundary: M at each threshold and row
block (4), K one group below, at and above each chunk (512/bits codes for bits 2/4/8, 32 for
3/5/6, 64 for the AVX2 4-bit chunk; the fused tile's 1024-code K chunk for M >= 3; the GEMM
tile's 512), N not a multiple of any tile (37, 129; transpose=False spans of 64 + 32).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import torch_qmm
from cpu_features import F32_MAX_ROWS, HAS_BF16_MATRIX_UNITS, affine_chunk_route, takes_bf16_gemm
from exact_cases import assert_bitwise, rounding_case, selection_case
from test_cpu_chunked import AVX2_AFFINE_MAX_ROWS, AVX2_CHUNKS, HAS_AVX2, HAS_AVX512, HAS_BF16, HAS_VBMI, MAX_ROWS

BITS = (2, 3, 4, 5, 6, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GEMM_MIN_ROWS = 16
TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
# Environment switches a case may set: float32-only kernels; the AVX-512 float32 chunk kernels
# stepped aside (the AVX2 ones then serve, as on CPUs without AVX-512).
NO_BF16, NO_F32 = "TORCH_QMM_CPU_NO_BF16", "TORCH_QMM_CPU_NO_F32_CHUNKS"
# The route order of Intel cores (the float32 multipliers before the bfloat16 ones for 16-bit x),
# forced so that every CPU checks both orders.
FMA_FIRST = "TORCH_QMM_CPU_FMA_FIRST"


def chunk_codes(bits: int) -> int:
    return 32 if bits in (3, 5, 6) else 512 // bits


def expected_route(bits, dtype, M, K, transpose, switch) -> str:
    """`switch`: the environment switch the case sets (SWITCHES), or None."""
    no_bf16, no_f32 = switch == NO_BF16, switch == NO_F32
    if takes_bf16_gemm(M, dtype, transpose, precision="highest", no_bf16=no_bf16, bits=bits, k=K, no_f32=no_f32):
        return "gemm-bf16"
    chunked = affine_chunk_route(bits, TERMS[dtype], M, K, no_bf16=no_bf16, no_f32=no_f32) if transpose else None
    return chunked or ("fused" if M < GEMM_MIN_ROWS else "gemm")


def _cases():
    cases = []
    for i, (bits, dtype) in enumerate(itertools.product(BITS, DTYPES)):
        gs = (32, 64, 128)[i % 3]
        limit = MAX_ROWS[(bits, TERMS[dtype])]
        ms = {1, 2, 3, 4, 5, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, GEMM_MIN_ROWS + 1}
        if limit is not None:
            ms |= {limit, limit + 1}
        if bits in F32_MAX_ROWS:
            ms |= {F32_MAX_ROWS[bits], F32_MAX_ROWS[bits] + 1}
        chunk = chunk_codes(bits)
        # K: one chunk plus a group (every M); below, at and above one chunk (at M = 1).
        k_main = max(chunk, gs) + gs
        for M in sorted(ms):
            cases.append((bits, gs, dtype, True, M, 37, k_main, None))
        for K in sorted({chunk - 32, chunk, chunk + 32} - {0}):
            cases.append((bits, 32, dtype, True, 1, 37, K, None))
        if bits in AVX2_CHUNKS:  # the AVX2 chunk: 64 (3-bit, 4-bit) or 32 (5, 6, 8-bit) codes
            c2 = AVX2_CHUNKS[bits]
            for M, K in itertools.product((1, 5), sorted({c2 - 32, c2, c2 + 32} - {0})):
                cases.append((bits, 32, dtype, True, M, 37, K, None))
            # Past the AVX-512 chunk, with the AVX-512 float32 kernels stepped aside.
            for M in (1, 3, GEMM_MIN_ROWS - 1):
                cases.append((bits, 32, dtype, True, M, 37, k_main, NO_F32))
        # Intel's order for 16-bit x: the float32 kernel up to its last row, then its bits stay
        # off the bfloat16 kernels (the fused or GEMM route takes the call).
        if bits in F32_MAX_ROWS and dtype != torch.float32:
            for M in (1, F32_MAX_ROWS[bits], F32_MAX_ROWS[bits] + 1):
                cases.append((bits, 32, dtype, True, M, 37, k_main, FMA_FIRST))
        # The fused tile: float32-only kernels (TORCH_QMM_CPU_NO_BF16=1), M >= 3 walks K in
        # 1024-code chunks: K at and across one chunk, 4-row blocks and their tails.
        for M, K in ((3, 1056), (5, 1024), (7, 2080)):
            cases.append((bits, 32, dtype, True, M, 37, K, NO_BF16))
        # GEMM tiles: N across the 128-row tile, K across the 512-code tile.
        cases.append((bits, 32, dtype, True, GEMM_MIN_ROWS + 1, 129, 544, NO_BF16))
        # transpose=False: W [K, N] quantized along N; N in spans of 64 and a tail of 32, odd K.
        for M in (1, 3, 4, 5, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, GEMM_MIN_ROWS + 1):
            cases.append((bits, 32, dtype, False, M, 96 if M % 2 else 160, 45, None))
        cases.append((bits, 32, dtype, False, GEMM_MIN_ROWS, 160, 545, None))
    return list(dict.fromkeys(cases))  # once each, in order


CASES = _cases()


def _id(c):
    bits, gs, dtype, transpose, M, N, K, switch = c
    return (f"b{bits}-gs{gs}-{str(dtype).split('.')[1]}-{'T' if transpose else 'N'}-M{M}-N{N}-K{K}"
            + {None: "", NO_BF16: "-nobf16", NO_F32: "-nof32", FMA_FIRST: "-fmafirst"}[switch])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_cpu_route_is_exact_at_its_boundaries(case, monkeypatch):
    bits, gs, dtype, transpose, M, N, K, switch = case
    for name in (NO_BF16, NO_F32, FMA_FIRST):
        monkeypatch.delenv(name, raising=False)
    if switch:
        monkeypatch.setenv(switch, "1")
    want_route = expected_route(bits, dtype, M, K, transpose, switch)
    for kind, make in (("rounding", rounding_case), ("selection", selection_case)):
        c = make(M, N, K, bits, gs, dtype, transpose, seed=zlib.crc32(_id(case).encode()) % 10_000)
        if make is rounding_case and dtype != torch.float32:
            assert c.rounded_fraction() > 0.1, "the problem must need rounding in this dtype"
        route = torch.ops.torch_qmm._cpu_route(*c.operands, bits, gs, transpose)
        y = torch_qmm.quantized_matmul(*c.operands, transpose=transpose, group_size=gs, bits=bits)
        assert_bitwise(y, c.expected(), f"{kind} {_id(case)} ({route})")
        assert route == want_route, f"{_id(case)}: route {route}, expected {want_route}"


def test_every_cpu_route_is_reached():
    """The table above reaches every kernel this machine has."""
    routes = {expected_route(c[0], c[2], c[4], c[6], c[3], c[7]) for c in CASES}
    want = {"fused", "gemm"} | ({"gemm-bf16"} if HAS_BF16_MATRIX_UNITS else set())
    if HAS_AVX512:
        want |= {"chunked/f32"} | ({"chunked/bf16x1", "chunked/bf16x2", "chunked/bf16x3"} if HAS_BF16 else set())
    if HAS_AVX2:
        want |= {f"chunked/avx2-u{bits}" for bits in (3, 4, 5, 6, 8)}
    assert want <= routes, f"not reached: {want - routes}"


@pytest.mark.skipif(not HAS_AVX512, reason="the float32 chunk kernel is AVX-512 only")
def test_float32_chunk_kernel_is_exact(monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_NO_BF16", "1")
    monkeypatch.delenv(NO_F32, raising=False)
    for dtype, make in itertools.product(DTYPES, (rounding_case, selection_case)):
        c = make(1, 37, 256, 4, 64, dtype, True, seed=5)
        assert torch.ops.torch_qmm._cpu_route(*c.operands, 4, 64, True) == "chunked/f32"
        y = torch_qmm.quantized_matmul(*c.operands, group_size=64, bits=4)
        assert_bitwise(y, c.expected(), f"chunked/f32 {dtype}")


# Sparse x with every bit of its dtype against MLX-quantized weights with nonzero biases: each
# output sums a few products, so every route must be within a few roundings of the terms it adds
# (reference.qmm_magnitude: |s*q| and the hoisted |b|), far below ACC_RTOL. The exact problems
# above have x exact in bfloat16 (rounding) or biases 0 (selection); here a bias sum(x) kept in a
# narrower type, or x rounded, fails. One case per route shape, bit widths rotating.
SPARSE_CASES = [c for i, c in enumerate(CASES) if c[2] != torch.bfloat16 and i % 4 == 0]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=_id)
def test_cpu_route_sums_sparse_x_within_a_few_roundings(case, monkeypatch):
    from tolerance import assert_within_few_roundings, sparse_x
    from torch_qmm import reference

    bits, gs, dtype, transpose, M, N, K, switch = case
    for name in (NO_BF16, NO_F32, FMA_FIRST):
        monkeypatch.delenv(name, raising=False)
    if switch:
        monkeypatch.setenv(switch, "1")
    seed = zlib.crc32(_id(case).encode()) % 10_000
    rows, cols = (N, K) if transpose else (K, N)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) + 0.5 * torch.randn(rows, 1, generator=g)).to(dtype)
    wq, s, b = torch_qmm.quantize(w, group_size=gs, bits=bits)
    values = min(4, max(1, K // gs))
    x = sparse_x(M, K, values, gs if K >= gs else K, dtype, seed)
    route = torch.ops.torch_qmm._cpu_route(x, wq, s, b, bits, gs, transpose)
    assert route == expected_route(bits, dtype, M, K, transpose, switch)
    y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=gs, bits=bits)
    assert_within_few_roundings(y, reference.qmm(x, wq, s, b, bits, gs, transpose),
                                reference.qmm_magnitude(x, wq, s, b, bits, gs, transpose), dtype, values,
                                f"{_id(case)} ({route})")
