"""gguf_qmm's gradient with respect to x (dx = dy @ W, torch_qmm/ops.py) and the pure-torch decode
of the K-quant blocks it uses (torch_qmm/gguf_blocks.py), checked against gguf.quants.dequantize
(the gguf package's decoder) and a float64 product, on every backend of the `device` fixture.

Tolerance: W is decoded to the gguf package's float32 weights exactly (the bit-for-bit tests
below) and dy enters float32 exactly, so dx differs from the float64 dy @ W only by the float32
accumulation of N products and one rounding to x's dtype: tests/tolerance.py's rule with the
magnitude |dy| @ |W| (ACC_RTOL for the sum in any order, OUT_RTOL / OUT_ATOL of the dtype for the
final rounding: 2^-24 float32, 2^-11 float16, 2^-8 bfloat16). The exact problems check the
same result to the bit: a product computed in a 16-bit type, or rounded twice, fails them.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from gguf import quants
from torch import nn

import torch_qmm.ops as ops
from exact_cases import assert_bitwise
from gguf_helpers import (IQ4_XS, LATTICE_TYPES, set_lattice_d, NATIVE_K_TYPES, ONE_HOT_TYPES, Q2_K, Q3_K, Q4_K, Q6_K, assert_matches_reference, exact_k_blocks, exact_x, one_hot_k_blocks,
                          random_k_blocks)
from torch_qmm import gguf_blocks
from torch_qmm.interop import GGUFLinear
from torch_qmm.interop.gguf_types import NATIVE_TYPES, block_info
from torch_qmm.ops import gguf_matmul

TYPES = list(NATIVE_K_TYPES)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gguf_w(blocks: np.ndarray, ggml_type) -> torch.Tensor:
    """W [N, K] in float64: the gguf package's float32 decode."""
    return torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()


# ---- the decode ------------------------------------------------------------------------------


def _assert_same_bits(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    """float32 equal bit for bit (so -0 != 0); NaN where the other is NaN (payloads aside)."""
    want = torch.from_numpy(np.ascontiguousarray(want))
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    got = got.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN in other places"
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~nan
    assert not bool(differ.any()), (f"{what}: {int(differ.sum())} of {got.numel()} weights differ, first at "
                                    f"{differ.nonzero()[0].tolist()}")


def _edge_blocks(ggml_type, rng: np.random.Generator) -> np.ndarray:
    """One row per special float16 super-block scale (zeros of both signs, the smallest and largest
    subnormals, the smallest normal, the largest finite values, infinities), with extreme
    sub-block scales: Q4_K every 6-bit scale and min 63 in row pairs, Q6_K int8 scales -128 / 127,
    Q2_K every 4-bit scale and min 15, Q3_K and IQ4_XS every scale -32 / 31; the lattice i-quants the
    special d with random sub-block scales."""
    specials = np.array([0.0, -0.0, 2.0**-24, 2.0**-14 - 2.0**-24, 2.0**-14, 65504.0, -65504.0, np.inf, -np.inf,
                         1.0, -3.5], "<f2")
    n = len(specials)
    blocks = random_k_blocks(ggml_type, n, 512, rng).reshape(n, 2, -1)
    f16 = specials.view(np.uint8).reshape(n, 1, 2)
    if ggml_type == Q4_K:
        blocks[..., 0:2] = f16  # d
        blocks[..., 2:4] = f16[::-1]  # dmin
        blocks[::2, :, 4:16] = 0xFF  # every scale and min 63
    elif ggml_type == Q6_K:
        blocks[..., 208:210] = f16
        blocks[::2, 0, 192:208] = 0x80  # -128
        blocks[::2, 1, 192:208] = 0x7F  # 127
    elif ggml_type == Q2_K:
        blocks[..., 80:82] = f16  # d
        blocks[..., 82:84] = f16[::-1]  # dmin
        blocks[::2, :, 0:16] = 0xFF  # every scale and min 15
    elif ggml_type in LATTICE_TYPES:  # every scale from the random bytes
        set_lattice_d(blocks, ggml_type, np.broadcast_to(specials[:, None], (n, 2)))
    elif ggml_type == IQ4_XS:
        blocks[..., 0:2] = f16
        blocks[::2, 0, 2:8] = 0x00  # every scale l - 32 = -32
        blocks[::2, 1, 2:8] = 0xFF  # every scale 31
    else:
        blocks[..., 108:110] = f16
        blocks[::2, 0, 96:108] = 0x00  # every scale -32
        blocks[::2, 1, 96:108] = 0xFF  # every scale 31
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf_dequantize_bit_for_bit(device, ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    _, block_bytes = block_info(int(ggml_type))
    cases = {
        "random": random_k_blocks(ggml_type, 37, 768, rng),
        # every byte random: NaN / Inf / subnormal super-block scales included
        "random bytes": rng.integers(0, 256, size=(16, 3 * block_bytes), dtype=np.uint8),
        "edge": _edge_blocks(ggml_type, rng),
        "exact": exact_k_blocks(ggml_type, 5, 512, rng),
        "zeros": np.zeros((2, 2 * block_bytes), np.uint8),
    }
    if ggml_type in ONE_HOT_TYPES:  # (IQ4_XS has no zero value)
        cases["one-hot"] = one_hot_k_blocks(ggml_type, [0, 31, 32, 100, 255, 256, 300, 511], 512)
    with np.errstate(invalid="ignore", over="ignore"):
        for name, blocks in cases.items():
            got = gguf_blocks.dequantize_rows(torch.from_numpy(blocks).to(device), int(ggml_type))
            assert got.device.type == torch.device(device).type
            _assert_same_bits(got, quants.dequantize(blocks, ggml_type), f"{ggml_type.name} {name}")


def test_dequantize_rows_geometry_and_bad_arguments():
    assert sorted(gguf_blocks.BLOCK_BYTES) == sorted(NATIVE_TYPES)
    for t in NATIVE_TYPES:
        assert (gguf_blocks.WEIGHTS_PER_BLOCK, gguf_blocks.BLOCK_BYTES[t]) == block_info(t)
    with pytest.raises(ValueError, match=r"ggml_type must be one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\), "
                                         r"16 \(IQ2_XXS\), 17 \(IQ2_XS\), 18 \(IQ3_XXS\), 19 \(IQ1_S\), 21 \(IQ3_S\), "
                                         r"22 \(IQ2_S\), 23 \(IQ4_XS\), 29 \(IQ1_M\), got 34"):
        gguf_blocks.dequantize_rows(torch.zeros(1, 54, dtype=torch.uint8), 34)
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[rows, K/256 \* 210\]"):
        gguf_blocks.dequantize_rows(torch.zeros(1, 144, dtype=torch.uint8), int(Q6_K))


# ---- dx ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("slice_rows", [None, 5], ids=["one-slice", "5-row-slices"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_qmm_dx_matches_float64_reference(device, monkeypatch, ggml_type, dtype, slice_rows):
    N, K = 37, 512  # odd N: the 5-row slices end with a slice of 2
    if slice_rows is not None:
        monkeypatch.setattr(ops, "GGUF_DX_SLICE_BYTES", slice_rows * 4 * K)
    rng = np.random.default_rng(int(ggml_type))
    blocks = random_k_blocks(ggml_type, N, K, rng)
    w = _gguf_w(blocks, ggml_type)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, K, generator=g).to(dtype).to(device).requires_grad_()  # [B, T, K]
    y = gguf_matmul(x, torch.from_numpy(blocks).to(device), int(ggml_type), N, K)
    dy = torch.randn(2, 5, N, generator=g).to(dtype)
    y.backward(dy.to(device))
    dyd = dy.double()
    assert_matches_reference(x.grad, dyd @ w, dyd.abs() @ w.abs(), dtype,
                             f"{ggml_type.name} {dtype} dx slices of {slice_rows} rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_qmm_dx_is_the_exact_product_rounded_once(device, ggml_type, dtype):
    # Weights and dy whose products and sums are exact in float32 (gguf_helpers.exact_k_blocks,
    # exact_x; N terms per output, fewer than the K the helpers bound): dx must be the exact
    # dy @ W rounded once to x's dtype, bit for bit.
    N, K = 200, 512
    rng = np.random.default_rng(int(ggml_type) + 1)
    blocks = exact_k_blocks(ggml_type, N, K, rng)
    w = _gguf_w(blocks, ggml_type)
    dy = torch.from_numpy(exact_x(6, N, rng)).to(dtype).reshape(2, 3, N)
    exact = dy.double() @ w
    assert torch.equal(exact.float().double(), exact), "the problem must be exact in float32"
    if dtype != torch.float32:
        assert (exact.to(dtype).double() != exact).float().mean() > 0.3, "the problem must need rounding"
    x = torch.zeros(2, 3, K, dtype=dtype, device=device, requires_grad=True)
    gguf_matmul(x, torch.from_numpy(blocks).to(device), int(ggml_type), N, K).backward(dy.to(device))
    assert_bitwise(x.grad, exact.to(dtype), f"{ggml_type.name} {dtype} dx")


def test_gguf_qmm_dx_decodes_w_a_slice_of_rows_at_a_time(monkeypatch):
    # A layer whose float32 W (2100 x 4096 x 4 bytes, 34 MB) is larger than GGUF_DX_SLICE_BYTES:
    # the backward decodes every row once, never more than the bound at a time.
    N, K = 2100, 4096
    blocks = torch.from_numpy(random_k_blocks(Q4_K, N, K, np.random.default_rng(0)))
    decoded = []
    real = gguf_blocks.dequantize_rows

    def spy(b, ggml_type):
        decoded.append(b.shape[0])
        return real(b, ggml_type)

    monkeypatch.setattr(gguf_blocks, "dequantize_rows", spy)
    x = torch.randn(3, K, requires_grad=True)
    gguf_matmul(x, blocks, int(Q4_K), N, K).sum().backward()
    assert sum(decoded) == N and len(decoded) > 1, decoded
    assert max(decoded) * K * 4 <= ops.GGUF_DX_SLICE_BYTES, decoded
    assert ops.GGUF_DX_SLICE_BYTES <= 64 << 20


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (1, None)], ids=["M=0", "N=0", "x-1d"])
def test_gguf_qmm_dx_of_empty_and_1d_products_has_x_shape(shape):
    m, n = shape
    K = 512
    n_rows = 3 if n is None else n
    blocks = torch.from_numpy(random_k_blocks(Q6_K, max(n_rows, 1), K, np.random.default_rng(1))[:n_rows])
    x = (torch.randn(K) if m == 1 and n is None else torch.randn(2, m, K)).requires_grad_()
    gguf_matmul(x, blocks, int(Q6_K), n_rows, K).sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    if n == 0 or m == 0:
        assert not bool(x.grad.any())


def test_gradient_into_blocks_is_a_clear_error():
    # blocks are uint8, which autograd never asks a gradient of; the backward still refuses one.
    ctx = types.SimpleNamespace(needs_input_grad=(True, True, False, False, False))
    with pytest.raises(RuntimeError, match="torch_qmm.gguf_qmm: no gradient with respect to 'blocks'"):
        ops._gguf_qmm_backward(ctx, torch.zeros(1, 4))
    with pytest.raises(RuntimeError, match="floating point"):
        torch.zeros(4, 144, dtype=torch.uint8).requires_grad_()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_qmm_backward_compiles_fullgraph(ggml_type):
    torch._dynamo.reset()  # one code object per type: each run's compiles count alone
    N, K = 9, 512
    blocks = torch.from_numpy(random_k_blocks(ggml_type, N, K, np.random.default_rng(2)))

    def fn(x):
        return gguf_matmul(x, blocks, int(ggml_type), N, K)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for m in (3, 5):
        x = torch.randn(2, m, K)
        dy = torch.randn(2, m, N)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn(xe).backward(dy)
        compiled(xc).backward(dy)
        assert torch.equal(xc.grad, xe.grad), f"{ggml_type.name} M={m}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_linear_in_a_model_passes_exact_gradients_to_earlier_layers(device, ggml_type):
    # nn.Linear -> GGUFLinear, loss = sum(y * c). Every value is a small multiple of a power of two
    # (c, x0: of 2^-3, the first weight of 2^-6, W of 2^-6 (Q2_K, Q4_K) or 2^-4 (Q3_K, Q6_K): dh of 2^-9;
    # the lattice i-quants' W of 2^-7 (exact_k_blocks): dh of 2^-10)
    # and every sum's magnitude (float64 |a| @ |b|) is checked to stay below 2^24 of its unit, so
    # the float32 gradients are exact: x.grad and the first layer's weight / bias gradients must
    # equal the float64 chain rule with W decoded by the gguf package, bit for bit.
    K0, K, N = 16, 256, 16
    rng = np.random.default_rng(int(ggml_type) + 5)
    blocks = exact_k_blocks(ggml_type, N, K, rng)
    w = _gguf_w(blocks, ggml_type)
    w0 = torch.from_numpy(rng.integers(-8, 9, size=(K, K0)) / 64.0)
    x0 = torch.from_numpy(rng.integers(-8, 9, size=(2, 3, K0)) / 8.0)
    c = torch.from_numpy(rng.integers(-8, 9, size=(2, 3, N)) / 8.0)

    gguf_layer = GGUFLinear(K, N, int(ggml_type), bias=True)
    gguf_layer.blocks.copy_(torch.from_numpy(blocks))
    first = nn.Linear(K0, K)
    with torch.no_grad():
        first.weight.copy_(w0)
        first.bias.zero_()
    model = nn.Sequential(first, gguf_layer).to(device)
    x = x0.float().to(device).requires_grad_()
    (model(x) * c.float().to(device)).sum().backward()

    dh = c @ w  # the GGUF layer's input gradient [2, 3, K]
    dh_unit = 2**-10 if ggml_type in LATTICE_TYPES else 2**-9
    want = {"x.grad": (dh @ w0, dh.abs() @ w0.abs(), dh_unit * 2**-6),
            "first.weight.grad": (dh.reshape(-1, K).T @ x0.reshape(-1, K0),
                                  dh.reshape(-1, K).abs().T @ x0.reshape(-1, K0).abs(), dh_unit * 2**-3),
            "first.bias.grad": (dh.reshape(-1, K).sum(0), dh.reshape(-1, K).abs().sum(0), dh_unit)}
    got = {"x.grad": x.grad, "first.weight.grad": first.weight.grad, "first.bias.grad": first.bias.grad}
    assert float((c.abs() @ w.abs()).max()) < 2**24 * dh_unit, "dh must be exact in float32"
    for name, (value, magnitude, unit) in want.items():
        assert float(magnitude.max()) < 2**24 * unit, f"{name} must be exact in float32"
        assert torch.equal((value / unit).round(), value / unit), f"{name}: multiples of {unit}"
        assert_bitwise(got[name], value.float(), f"{ggml_type.name} {name}")
