"""The chunk driver's schedules (csrc/cpu/chunk_driver.h), which must never change a result:

* K slabs: a block of x rows may walk K in slabs, each tile's accumulators carried from slab to
  slab, so that every y[m, n] is summed over the chunks in the same order as in one pass over K.
  TORCH_QMM_CPU_SLAB_BYTES sets the slab budget of every kernel (0: one pass; 1: one chunk per
  slab).
* x parts: each row of x is prepared in parts along K (chunks on group boundaries; the last part
  owns the K tail), taken by the threads before any W is read. TORCH_QMM_CPU_X_PARTS sets the
  parts per row (1: whole rows; more than a row has units: one part per unit).
* x blocks: the rows of x go through each span in blocks of at most 4, 2 or 1 rows (each chunk
  decoded once per block; 3 rows left take one block of 3 in kernels that declare it). TORCH_QMM_CPU_X_BLOCK caps the block below the kernel's own limit.

So each chunk kernel this CPU has must give bit-identical results under every schedule: one pass,
one chunk per slab, a budget that leaves a ragged last slab, the kernel's own default, and x in
one part, in ragged parts and in as many parts as it can take, and x in blocks of one and of two
rows. Shapes: K of many chunks plus
(affine) a K tail, groups of one and of two chunks, spans with a ragged last tile, M in blocks of
4, 2 and 1. That one schedule is right is the business of the kernels' own tests (against the
float64 reference); here only the schedules are in question.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm.ops import gguf_matmul, quantize, quantized_matmul

from cpu_features import HAS_AVX2, HAS_BF16, fma_first
from gguf_helpers import random_k_blocks

pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the chunk kernels need AVX2 (other CPUs take the fused ones)")

# (TORCH_QMM_CPU_SLAB_BYTES, TORCH_QMM_CPU_X_PARTS, TORCH_QMM_CPU_X_BLOCK); None: unset (each
# kernel's own slabs and blocks; parts for the threads this process has).
SCHEDULE_VARIABLES = ("TORCH_QMM_CPU_SLAB_BYTES", "TORCH_QMM_CPU_X_PARTS", "TORCH_QMM_CPU_X_BLOCK")
SCHEDULES = [("0", "1", None), ("1", "1", None), ("5000", "1", None), (None, None, None), ("0", "3", None),
             ("1", "100000", None), (None, None, "1"), ("5000", "3", "2"), ("0", "1", "3")]
MS = [1, 2, 4, 7]  # blocks of x rows: 1; 2; 4; 4 + 2 + 1
N = 45  # tiles of 2 and 4 rows leave a ragged last tile


def under_every_schedule(monkeypatch, call):
    """call() under each schedule; asserts all results are bit-identical and returns one."""
    results = []
    for schedule in SCHEDULES:
        for variable, value in zip(SCHEDULE_VARIABLES, schedule):
            if value is None:
                monkeypatch.delenv(variable, raising=False)
            else:
                monkeypatch.setenv(variable, value)
        results.append(call())
    for schedule, y in zip(SCHEDULES[1:], results[1:]):
        assert torch.equal(y, results[0]), f"(slab bytes, x parts, x block) {schedule} differs from one pass by {(y - results[0]).abs().max()}"
    return results[0]


# Families stepped aside (environment switches of csrc/cpu/qmm_kernels.h), so that each chunk
# family this CPU has meets every schedule: exact, the AVX-512 float32 kernels, then the AVX2
# ones, and the AVX512_BF16 dot-product kernels where both step aside (up to their row limits);
# int8, the 512-bit kernels, the 256-bit ones and the portable one.
STEP_ASIDE = {"all-families": [], "no-f32-chunks": ["TORCH_QMM_CPU_NO_F32_CHUNKS"],
              "bf16-chunks": ["TORCH_QMM_CPU_NO_F32_CHUNKS", "TORCH_QMM_CPU_NO_AVX2_CHUNKS"],
              "int8-256": ["TORCH_QMM_CPU_NO_INT8_512"], "int8-portable": ["TORCH_QMM_CPU_NO_AVX2_CHUNKS"]}
EXACT_ASIDE = ["all-families", "no-f32-chunks", "bf16-chunks"]
INT8_ASIDE = ["all-families", "int8-256", "int8-portable"]
FAMILIES = pytest.mark.parametrize("int8,aside", [(False, a) for a in EXACT_ASIDE] + [(True, a) for a in INT8_ASIDE],
                                   ids=[f"exact-{a}" for a in EXACT_ASIDE] + [f"int8-{a}" for a in INT8_ASIDE])


def assert_int8_route(route: str, aside: str) -> None:
    """The int8 call reached the family the test means: 512-bit, 256-bit or portable."""
    assert route.startswith("int8x/"), route
    if aside == "int8-portable":
        assert route == "int8x/scalar", route
    else:
        assert route != "int8x/scalar" and not (aside == "int8-256" and "-512" in route), route


@FAMILIES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 32), (8, 64), (8, 128)])
def test_affine_chunk_kernels_give_the_same_sums_under_every_schedule(monkeypatch, bits, group_size, dtype, int8,
                                                                      aside):
    for variable in STEP_ASIDE[aside]:
        monkeypatch.setenv(variable, "1")
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    K = 64 * 40 + 32 if group_size == 32 else 128 * 21  # group 32: 4-bit K tail of 32 past 40 chunks
    w = torch.randn(N, K, generator=gen).to(dtype)
    wq, scales, biases = quantize(w, group_size, bits)
    for m in MS:
        x = torch.randn(m, K, generator=gen).to(dtype)
        if int8:
            route = torch.ops.torch_qmm._cpu_route_int8_activations(x, wq, scales, biases, "affine", bits, group_size)
            assert_int8_route(route, aside)
        else:
            route = torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, group_size)
            if aside != "all-families" and not route.startswith("chunked/"):
                continue  # past the row limits of the families left
            assert route.startswith("chunked/"), route

        def call():
            with torch_qmm.activation_quantization("int8" if int8 else None):
                return quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)

        under_every_schedule(monkeypatch, call)


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_fp_mode_chunk_kernels_give_the_same_sums_under_every_schedule(monkeypatch, mode):
    gen = torch.Generator().manual_seed(7)
    K = 64 * 41
    wq, scales = quantize(torch.randn(N, K, generator=gen), mode=mode)[:2]
    for m in MS:
        x = torch.randn(m, K, generator=gen)
        under_every_schedule(monkeypatch, lambda: quantized_matmul(x, wq, scales, None, transpose=True, mode=mode))


@pytest.mark.parametrize("ggml_type", [16, 29], ids=["IQ2_XXS", "IQ1_M"])
def test_lattice_kernel_gives_the_same_sums_under_every_schedule(monkeypatch, ggml_type):
    """The lattice i-quants' kernel, which also takes blocks of 3 rows of x (M = 3; 7 = 4 + 3; under
    TORCH_QMM_CPU_X_BLOCK=3 every M in blocks of 3, 2 and 1)."""
    rng = np.random.default_rng(ggml_type)
    K = 256 * 11
    blocks = torch.from_numpy(random_k_blocks(ggml_type, N, K, rng))
    for m in [*MS, 3, 6]:
        x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32))
        assert torch.ops.torch_qmm._gguf_cpu_route(x, blocks, ggml_type, N, K).startswith("chunked/avx2-iq"), m
        under_every_schedule(monkeypatch, lambda: gguf_matmul(x, blocks, ggml_type, N, K))


@FAMILIES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ggml_type", [12, 14], ids=["Q4_K", "Q6_K"])
def test_gguf_chunk_kernels_give_the_same_sums_under_every_schedule(monkeypatch, ggml_type, dtype, int8, aside):
    for variable in STEP_ASIDE[aside]:
        monkeypatch.setenv(variable, "1")
    rng = np.random.default_rng(ggml_type)
    K = 256 * 11
    blocks = torch.from_numpy(random_k_blocks(ggml_type, N, K, rng))
    for m in MS:
        x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32)).to(dtype)
        if int8:
            route = torch.ops.torch_qmm._gguf_cpu_route_int8_activations(x, blocks, ggml_type, N, K)
            assert_int8_route(route, aside)
        else:
            route = torch.ops.torch_qmm._gguf_cpu_route(x, blocks, ggml_type, N, K)
            if aside == "bf16-chunks":
                # The bfloat16 kernels take M=1 wherever the CPU has them (and they go first);
                # past their row limits (3 terms of float32 x) the fused route takes the call.
                if m == 1 and HAS_BF16 and not fma_first():
                    assert route.startswith("chunked/bf16x"), route
                if not route.startswith("chunked/"):
                    continue
            assert route.startswith("chunked/"), route

        def call():
            with torch_qmm.activation_quantization("int8" if int8 else None):
                return gguf_matmul(x, blocks, ggml_type, N, K)

        under_every_schedule(monkeypatch, call)


@pytest.mark.parametrize("variable,value,expected", [
    *[("TORCH_QMM_CPU_SLAB_BYTES", v, "a byte count") for v in ["abc", "-1", "16k", "99999999999999999999"]],
    *[("TORCH_QMM_CPU_X_PARTS", v, "a count of parts from 1 to 1048576") for v in ["abc", "0", "-2", "3.5", "1048577"]],
    *[("TORCH_QMM_CPU_X_BLOCK", v, "a count of rows of x from 1 to 4") for v in ["abc", "0", "5", "2.0"]],
])
def test_a_schedule_variable_that_is_not_a_count_is_a_clear_error(monkeypatch, variable, value, expected):
    gen = torch.Generator().manual_seed(3)
    wq, scales, biases = quantize(torch.randn(N, 256, generator=gen), 32, 4)
    for m in (1, 4):
        x = torch.randn(m, 256, generator=gen)
        assert torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, 4, 32).startswith("chunked/")
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=f"{variable} must be {expected}.*got '{value}'"):
            quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
        monkeypatch.delenv(variable)
