"""gguf_qmm: the native GGUF op (Q2_K .. Q6_K, IQ4_XS), checked against gguf.quants.dequantize (the gguf package's
decoder) with a float64 matmul, and its bad-input errors, on every backend of the `device` fixture
(tests/conftest.py: cpu, the Metal kernels on metalsim, mps on a Mac). Route-by-route Metal tests:
tests/test_metal_gguf.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from gguf_helpers import NATIVE_K_TYPES, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, assert_matches_reference, k_quant_magnitude, random_k_blocks
from torch_qmm.interop import GGUFLinear
from torch_qmm.interop.gguf_types import NATIVE_TYPES, block_info
from torch_qmm.ops import gguf_matmul

SHAPES = [(1, 256), (7, 512), (33, 768), (130, 256)]  # (N, K): odd N, several super-blocks


def _case(ggml_type, n, k, seed=0):
    rng = np.random.default_rng(seed)
    blocks = random_k_blocks(ggml_type, n, k, rng)
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()  # [n, k]
    return torch.from_numpy(blocks), w


def test_block_geometry_agrees_with_gguf_package():
    assert NATIVE_TYPES == tuple(sorted(int(t) for t in NATIVE_K_TYPES))
    for t in NATIVE_K_TYPES:
        assert block_info(int(t)) == GGML_QUANT_SIZES[t]


@pytest.mark.parametrize(
    "ggml_type,shape,m,dtype",
    list(itertools.product(NATIVE_K_TYPES, SHAPES, [1, 3, 17], [torch.float32, torch.float16, torch.bfloat16])),
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_gguf_qmm_matches_gguf_dequantize(device, ggml_type, shape, m, dtype):
    n, k = shape
    blocks, w = _case(ggml_type, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = gguf_matmul(x.to(device), blocks.to(device), int(ggml_type), n, k)
    xd = x.double()
    assert_matches_reference(y, xd @ w.T, k_quant_magnitude(x, blocks, ggml_type), dtype,
                             f"{ggml_type.name} M={m} N={n} K={k}")


def test_gguf_qmm_batched_and_strided_input(device):
    blocks, w = _case(Q4_K, 9, 512)
    x = torch.randn(2, 5, 1024)[..., ::2].to(device)  # [2, 5, 512], non-contiguous
    y = gguf_matmul(x, blocks.to(device), int(Q4_K), 9, 512)
    xd = x.cpu().double()
    assert_matches_reference(y, xd @ w.T, k_quant_magnitude(x.reshape(-1, 512), blocks, Q4_K).reshape(2, 5, 9),
                             torch.float32, "batched")


def test_gguf_linear_holds_the_blocks_and_adds_bias(device):
    blocks, w = _case(Q6_K, 5, 256)
    layer = GGUFLinear(256, 5, int(Q6_K), bias=True)
    layer.blocks.copy_(blocks)
    layer.bias.copy_(torch.arange(5.0))
    x = torch.randn(3, 256)
    xd = x.double()
    assert_matches_reference(layer.to(device)(x.to(device)), xd @ w.T + torch.arange(5.0).double(),
                             k_quant_magnitude(x, blocks, Q6_K) + torch.arange(5.0).double(),
                             torch.float32, "GGUFLinear")
    assert set(layer.state_dict()) == {"blocks", "bias", "_extra_state"}
    assert layer.state_dict()["_extra_state"].tolist() == [int(Q6_K)]  # the GGUF type


def test_gguf_qmm_opcheck_and_compile():
    blocks, _ = _case(Q4_K, 3, 256)
    x = torch.randn(2, 256)
    torch.library.opcheck(torch.ops.torch_qmm.gguf_qmm, (x, blocks, int(Q4_K), 3, 256))
    compiled = torch.compile(lambda a: gguf_matmul(a, blocks, int(Q4_K), 3, 256), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), gguf_matmul(x, blocks, int(Q4_K), 3, 256))


# ---- bad input --------------------------------------------------------------------------------

def test_unsupported_ggml_type_lists_the_supported_ones():
    blocks, _ = _case(Q4_K, 3, 256)
    with pytest.raises(ValueError, match=r"'ggml_type' must be one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\), 16 \(IQ2_XXS\), "
                                         r"17 \(IQ2_XS\), 18 \(IQ3_XXS\), 19 \(IQ1_S\), 21 \(IQ3_S\), 22 \(IQ2_S\), 23 \(IQ4_XS\), "
                                         r"29 \(IQ1_M\), "
                                         r"got 34"):
        gguf_matmul(torch.randn(1, 256), blocks, 34, 3, 256)
    with pytest.raises(ValueError, match=r"got 8 \(Q8_0: convert it to the affine format"):
        gguf_matmul(torch.randn(1, 256), blocks, 8, 3, 256)
    with pytest.raises(ValueError, match=r"got 20 \(IQ4_NL: convert it to the affine format"):
        gguf_matmul(torch.randn(1, 256), blocks, 20, 3, 256)
    with pytest.raises(ValueError, match=r"got 39 \(MXFP4: it is MLX's mxfp4, torch_qmm.interop.gguf.to_fp\)"):
        gguf_matmul(torch.randn(1, 256), blocks, 39, 3, 256)


def test_blocks_shape_disagreeing_with_n_k_is_an_error():
    blocks, _ = _case(Q4_K, 3, 512)
    with pytest.raises(ValueError, match=r"'blocks' must have shape \[N, K/256\*144\] = \[4, 288\]"):
        gguf_matmul(torch.randn(1, 512), blocks, int(Q4_K), 4, 512)
    with pytest.raises(ValueError, match=r"= \[3, 420\]"):  # Q4_K bytes read as Q6_K
        gguf_matmul(torch.randn(1, 512), blocks, int(Q6_K), 3, 512)


def test_k_not_a_multiple_of_256_is_an_error():
    with pytest.raises(ValueError, match=r"'K' must be a positive multiple of 256 \(the super-block size\), got 300"):
        gguf_matmul(torch.randn(1, 300), torch.zeros(3, 144, dtype=torch.uint8), int(Q4_K), 3, 300)


def test_dtype_mismatches_are_type_errors():
    blocks, _ = _case(Q4_K, 3, 256)
    with pytest.raises(TypeError, match="'blocks' must be uint8"):
        gguf_matmul(torch.randn(1, 256), blocks.to(torch.int32), int(Q4_K), 3, 256)
    with pytest.raises(TypeError, match="'x' must be float32, float16 or bfloat16, got Double"):
        gguf_matmul(torch.randn(1, 256, dtype=torch.float64), blocks, int(Q4_K), 3, 256)
    with pytest.raises(ValueError, match="'x' must have last dimension K=256"):
        gguf_matmul(torch.randn(1, 512), blocks, int(Q4_K), 3, 256)


def test_gguf_linear_rejects_unsupported_types():
    with pytest.raises(ValueError, match=r"'ggml_type' must be one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\), 16 \(IQ2_XXS\), "
                                         r"17 \(IQ2_XS\), 18 \(IQ3_XXS\), 19 \(IQ1_S\), 21 \(IQ3_S\), 22 \(IQ2_S\), 23 \(IQ4_XS\), "
                                         r"29 \(IQ1_M\), "
                                         r"got 34 \(TQ1_0\)"):
        GGUFLinear(256, 4, 34)


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.uint8)


# (x, blocks, ggml_type, N, K, error, message): one argument wrong each.
BAD = {
    "K-zero": (torch.randn(1, 0), _zeros(3, 0), Q4_K, 3, 0, ValueError, r"'K' must be a positive multiple of 256 .*got 0"),
    "K-negative": (torch.randn(1, 256), _zeros(3, 144), Q4_K, 3, -256, ValueError, r"'K' must be a positive .*got -256"),
    "N-negative": (torch.randn(1, 256), _zeros(0, 144), Q4_K, -1, 256, ValueError, r"'N' must be >= 0, got -1"),
    "blocks-1d": (torch.randn(1, 256), _zeros(3 * 144), Q4_K, 3, 256, ValueError, r"'blocks' must have shape \[N, K/256\*144\]"),
    "blocks-3d": (torch.randn(1, 256), _zeros(1, 3, 144), Q4_K, 3, 256, ValueError, r"'blocks' must have shape"),
    "blocks-rows": (torch.randn(1, 256), _zeros(2, 210), Q6_K, 3, 256, ValueError, r"= \[3, 210\].*got \[2, 210\]"),
    "x-scalar": (torch.tensor(1.0), _zeros(3, 144), Q4_K, 3, 256, ValueError, r"'x' must have last dimension K=256"),
    "x-int": (torch.ones(1, 256, dtype=torch.int32), _zeros(3, 144), Q4_K, 3, 256, TypeError, r"'x' must be float32"),
    "type-TQ1_0": (torch.randn(1, 256), _zeros(3, 54), 34, 3, 256, ValueError,
                  r"must be one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\)"),
}
OPS = ("gguf_qmm", "gguf_qmm_int8_activations")


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_are_refused_by_every_op_and_its_fake(case, op, device):
    # The meta kernels (shape-only runs, torch.compile) must raise what the CPU kernels raise.
    x, blocks, ggml_type, n, k, error, message = BAD[case]
    with pytest.raises(error, match=message):
        getattr(torch.ops.torch_qmm, op)(x.to(device), blocks.to(device), int(ggml_type), n, k)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("ggml_type", [Q2_K, Q3_K, Q5_K], ids=lambda t: t.name)
def test_the_int8_activation_op_refuses_types_without_its_kernels(ggml_type, device):
    blocks, _ = _case(ggml_type, 3, 256)
    with pytest.raises(ValueError, match=rf"gguf_qmm_int8_activations: argument 'ggml_type' must be one of 12 \(Q4_K\), "
                                         rf"14 \(Q6_K\) \(the types with int8-activation kernels\), got {int(ggml_type)}"):
        torch.ops.torch_qmm.gguf_qmm_int8_activations(torch.randn(1, 256).to(device), blocks.to(device),
                                                      int(ggml_type), 3, 256)


@pytest.mark.parametrize("op", OPS)
def test_x_and_blocks_on_two_devices_are_refused(op):
    with pytest.raises(ValueError, match=r"'x' is on cpu but 'blocks' is on meta"):
        getattr(torch.ops.torch_qmm, op)(torch.randn(1, 256), _zeros(3, 144).to("meta"), int(Q4_K), 3, 256)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("m,n", [(0, 3), (2, 0)])
def test_empty_products_have_their_shape(op, m, n, device):
    blocks, _ = _case(Q6_K, max(n, 1), 512)
    y = getattr(torch.ops.torch_qmm, op)(torch.randn(2, m, 512).to(device), blocks[:n].to(device), int(Q6_K), n, 512)
    assert y.shape == (2, m, n) and y.dtype == torch.float32 and y.device.type == device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ggml_type", NATIVE_K_TYPES, ids=lambda t: t.name)
def test_gguf_qmm_rounds_the_exact_sum_once(device, ggml_type, dtype):
    # Weights and x whose products and sums are exact in float32 (gguf_helpers.exact_k_blocks):
    # every route must return the exact product rounded to nearest even in the output dtype, bit
    # for bit; truncation, double rounding or a dropped term fails. M crosses every CPU and Metal
    # route (1 | 2 | 3-4 | 5-16 | 17+), N = 37 is odd.
    from exact_cases import assert_bitwise
    from gguf_helpers import exact_k_blocks, exact_x

    N, K = 37, 512
    rng = np.random.default_rng(int(ggml_type) + 7)
    blocks = exact_k_blocks(ggml_type, N, K, rng)
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    for M in (1, 2, 3, 9, 17, 33):
        x = torch.from_numpy(exact_x(M, K, rng)).to(dtype)
        exact = x.double() @ w.T
        assert torch.equal(exact.float().double(), exact), "the problem must be exact in float32"
        if dtype != torch.float32:
            assert (exact.to(dtype).double() != exact).float().mean() > 0.3, "the problem must need rounding"
        y = gguf_matmul(x.to(device), torch.from_numpy(blocks).to(device), int(ggml_type), N, K)
        assert_bitwise(y, exact.to(dtype), f"{ggml_type.name} M={M} {dtype} on {device}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gguf_qmm_carries_x_unrounded(device, dtype):
    # One weight 1 per row (gguf_helpers.one_hot_k_blocks): y[:, n] = x[:, cols[n]] exactly, so
    # x must reach the sum with all its bits (float32: 24) on every route. Q4_K only, with its mins
    # 0: Q6_K's zero weight is a code of 32, whose offset the kernels hoist (sum of 32 x over the
    # sub-block, subtracted), so there a full-precision x is rounded by the cancelling sums, within
    # the accumulation bound (the exact problem above covers Q6_K).
    ggml_type = Q4_K
    from exact_cases import assert_bitwise
    from gguf_helpers import one_hot_k_blocks

    N, K = 37, 512
    rng = np.random.default_rng(int(ggml_type))
    cols = [int(c) for c in rng.integers(0, K, N)]
    blocks = one_hot_k_blocks(ggml_type, cols, K)
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    assert torch.equal(w, torch.nn.functional.one_hot(torch.tensor(cols), K).double())
    for M in (1, 2, 3, 9, 17, 33):
        x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 3).to(dtype)
        y = gguf_matmul(x.to(device), torch.from_numpy(blocks).to(device), int(ggml_type), N, K)
        assert_bitwise(y, x[:, cols], f"{ggml_type.name} M={M} {dtype} on {device}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_gguf_qmm_sums_sparse_x_within_a_few_roundings(device, ggml_type, dtype):
    # Four nonzero x values per row, each with every bit of its dtype, against random blocks: each
    # output sums four products, so its float32 error is a few roundings of the terms the kernel
    # adds (k_quant_magnitude: |d*sc*q| and the hoisted min / 32 offset), far below ACC_RTOL.
    # float32 x rounded to 16 bits, a float16 sub-block sum or a scale kept in float16 fails.
    from tolerance import assert_within_few_roundings, sparse_x

    N, K = 37, 768
    blocks, w = _case(ggml_type, N, K, seed=int(ggml_type) + 3)
    for M in (1, 2, 3, 9, 17, 33):
        x = sparse_x(M, K, 4, 32, dtype, seed=M)
        y = gguf_matmul(x.to(device), blocks.to(device), int(ggml_type), N, K)
        assert_within_few_roundings(y, x.double() @ w.T, k_quant_magnitude(x, blocks, ggml_type), dtype, 4,
                                    f"{ggml_type.name} M={M} {dtype} on {device}")
