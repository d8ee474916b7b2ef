"""The chunk driver's K slabs (csrc/cpu/chunk_driver.h): a block of x rows may walk K in slabs,
each tile's accumulators carried from slab to slab, so that every y[m, n] is summed over the
chunks in the same order as in one pass over K. TORCH_QMM_CPU_SLAB_BYTES sets the slab budget of
every kernel (0: one pass; 1: one chunk per slab), so each chunk kernel this CPU has must give
bit-identical results under every budget: one pass, one chunk per slab, a budget that leaves a
ragged last slab, and the kernel's own default. Shapes: K of many chunks plus (affine) a K tail,
spans with a ragged last tile, M in blocks of 4, 2 and 1. That one pass is right is the business
of the kernels' own tests (against the float64 reference); here only the slabs are in question.
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

BUDGETS = ["0", "1", "5000", None]  # None: each kernel's own
MS = [1, 2, 4, 7]  # blocks of x rows: 1; 2; 4; 4 + 2 + 1
N = 45  # tiles of 2 and 4 rows leave a ragged last tile


def under_every_budget(monkeypatch, call):
    """call() under each budget; asserts all results are bit-identical and returns one."""
    results = []
    for budget in BUDGETS:
        if budget is None:
            monkeypatch.delenv("TORCH_QMM_CPU_SLAB_BYTES", raising=False)
        else:
            monkeypatch.setenv("TORCH_QMM_CPU_SLAB_BYTES", budget)
        results.append(call())
    for budget, y in zip(BUDGETS[1:], results[1:]):
        assert torch.equal(y, results[0]), f"budget {budget} differs from one pass by {(y - results[0]).abs().max()}"
    return results[0]


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 32), (8, 64)])
def test_affine_chunk_kernels_give_the_same_sums_under_every_slab_budget(monkeypatch, bits, group_size, dtype, int8):
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    K = 64 * 40 + 32 if group_size == 32 else 128 * 21  # group 32: 4-bit K tail of 32 past 40 chunks
    w = torch.randn(N, K, generator=gen).to(dtype)
    wq, scales, biases = quantize(w, group_size, bits)
    for m in MS:
        x = torch.randn(m, K, generator=gen).to(dtype)
        if int8:
            route = torch.ops.torch_qmm._cpu_route_int8_activations(x, wq, scales, biases, "affine", bits, group_size)
            assert route.startswith("int8x/") and route != "int8x/scalar", route
        else:
            route = torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, group_size)
            assert route.startswith("chunked/"), route

        def call():
            with torch_qmm.activation_quantization("int8" if int8 else None):
                return quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)

        under_every_budget(monkeypatch, call)


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_fp_mode_chunk_kernels_give_the_same_sums_under_every_slab_budget(monkeypatch, mode):
    gen = torch.Generator().manual_seed(7)
    K = 64 * 41
    wq, scales = quantize(torch.randn(N, K, generator=gen), mode=mode)[:2]
    for m in MS:
        x = torch.randn(m, K, generator=gen)
        under_every_budget(monkeypatch, lambda: quantized_matmul(x, wq, scales, None, transpose=True, mode=mode))


# Families stepped aside (environment switches of csrc/cpu/qmm_kernels.h), so that each GGUF chunk
# family this CPU has meets every budget: the AVX-512 float32 kernels, then the AVX2 ones, and
# the AVX512_BF16 dot-product kernels where both step aside (up to their row limits).
STEP_ASIDE = {"all-families": [], "no-f32-chunks": ["TORCH_QMM_CPU_NO_F32_CHUNKS"],
              "bf16-chunks": ["TORCH_QMM_CPU_NO_F32_CHUNKS", "TORCH_QMM_CPU_NO_AVX2_CHUNKS"]}


# The int8 kernels are one family (the switches above do not move them).
@pytest.mark.parametrize("int8,aside", [(False, aside) for aside in STEP_ASIDE] + [(True, "all-families")],
                         ids=[f"exact-{aside}" for aside in STEP_ASIDE] + ["int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ggml_type", [12, 14], ids=["Q4_K", "Q6_K"])
def test_gguf_chunk_kernels_give_the_same_sums_under_every_slab_budget(monkeypatch, ggml_type, dtype, int8, aside):
    for variable in STEP_ASIDE[aside]:
        monkeypatch.setenv(variable, "1")
    rng = np.random.default_rng(ggml_type)
    K = 256 * 11
    blocks = torch.from_numpy(random_k_blocks(ggml_type, N, K, rng))
    for m in MS:
        x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32)).to(dtype)
        if int8:
            route = torch.ops.torch_qmm._gguf_cpu_route_int8_activations(x, blocks, ggml_type, N, K)
            assert route.startswith("int8x/") and route != "int8x/scalar", route
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

        under_every_budget(monkeypatch, call)


@pytest.mark.parametrize("value", ["abc", "-1", "16k", "99999999999999999999"])
def test_a_slab_budget_that_is_not_a_byte_count_is_a_clear_error(monkeypatch, value):
    gen = torch.Generator().manual_seed(3)
    wq, scales, biases = quantize(torch.randn(N, 256, generator=gen), 32, 4)
    x = torch.randn(4, 256, generator=gen)
    assert torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, 4, 32).startswith("chunked/")
    monkeypatch.setenv("TORCH_QMM_CPU_SLAB_BYTES", value)
    with pytest.raises(ValueError, match=f"TORCH_QMM_CPU_SLAB_BYTES must be a byte count .*got '{value}'"):
        quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
