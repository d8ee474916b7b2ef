"""The opt-in int8-activation gguf_qmm (csrc/cpu/actq_gguf.cpp): Q4_K and Q6_K blocks times x
quantized to int8 per super-block of 256 (X_BLOCK; llama.cpp's q8_K granularity).

Oracles (independent of the kernels): gguf-py's dequantize for W (float64), and x's int8
quantization written from its definition in tests/test_cpu_actq.py (quantize_x, blocks of 256).

Bounds checked, as for the affine int8 path (tests/test_cpu_actq.py):
- against the exact product W x: |y - W x| <= sum over blocks b of (d_b / 2) * sum_{i in b} |w_i|
  plus float32 slack 2^-20 * sum |w| (|x| + d);
- against W times the dequantized x (the kernel's own codes): float32 accumulation only,
  2^-20 * sum |w| |x_deq|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

import torch_qmm
from cpu_features import HAS_GGUF_INT8_512, int8_gguf_route
from gguf_helpers import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, random_k_blocks
from test_cpu_actq import SLACK, quantize_x

ops = torch.ops.torch_qmm
KIND = {Q4_K: "q4k", Q6_K: "q6k"}
X_BLOCK = 256  # x values per int8 scale: one super-block


@pytest.fixture(params=["512", "256"])
def width(request, monkeypatch):
    """The 512-bit kernels where the CPU has them, or the 256-bit ones (TORCH_QMM_CPU_NO_INT8_512=1).
    Returns whether the 512-bit ones are stepped aside."""
    if request.param == "512" and not HAS_GGUF_INT8_512:
        pytest.skip("no AVX512BW here")
    no_512 = request.param == "256"
    if no_512:
        monkeypatch.setenv("TORCH_QMM_CPU_NO_INT8_512", "1")
    else:
        monkeypatch.delenv("TORCH_QMM_CPU_NO_INT8_512", raising=False)
    return no_512


def case(ggml_type, n: int, k: int, seed: int = 0):
    blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(seed))
    return torch.from_numpy(blocks), torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()


def check_bounds(y, x, w):
    y = y.double()
    exact = x.double() @ w.T
    x_deq, d = quantize_x(x, X_BLOCK)
    step = (d / 2) @ w.abs().T
    slack = SLACK * ((x.double().abs() + d) @ w.abs().T)
    err = (y - exact).abs()
    assert (err <= step + slack).all(), f"worst excess {(err - step - slack).max().item():.3g}"
    tight = (y - x_deq @ w.T).abs()
    assert (tight <= SLACK * (x_deq.abs() @ w.abs().T)).all(), f"max {(tight / (x_deq.abs() @ w.abs().T)).max():.3g}"
    assert (err > 0).any()  # not the exact product: the int8 rounding shows


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 8])
def test_error_within_the_int8_step(ggml_type, M, width):
    N, K = 37, 768  # N odd: tiles of 2 W rows leave one; 3 super-blocks
    blocks, w = case(ggml_type, N, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * torch.linspace(0.1, 3.0, K)
    route = ops._gguf_cpu_route_int8_activations(x, blocks, int(ggml_type), N, K)
    assert route == int8_gguf_route(KIND[ggml_type], no_512=width)
    check_bounds(ops.gguf_qmm_int8_activations(x, blocks, int(ggml_type), N, K), x, w)


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_scalar_kernel(ggml_type, monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    N, K = 21, 512
    blocks, w = case(ggml_type, N, K, seed=2)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(7))
    assert ops._gguf_cpu_route_int8_activations(x, blocks, int(ggml_type), N, K) == "int8x/scalar"
    check_bounds(ops.gguf_qmm_int8_activations(x, blocks, int(ggml_type), N, K), x, w)


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_two_threads_and_batched_x(ggml_type, width):
    N, K = 600, 1024  # two threads: spans of 72 W rows, then of 16
    blocks, w = case(ggml_type, N, K, seed=3)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert ops._cpu_threads(x, N, K) == 2
        y = ops.gguf_qmm_int8_activations(x, blocks, int(ggml_type), N, K)
    finally:
        torch.set_num_threads(before)
    assert y.shape == (2, 3, N)
    check_bounds(y.reshape(6, N), x.reshape(6, K), w)


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_round_once(dtype, ggml_type, width):
    N, K = 19, 256
    blocks, w = case(ggml_type, N, K, seed=5)
    x = torch.randn(3, K).to(dtype)
    y = ops.gguf_qmm_int8_activations(x, blocks, int(ggml_type), N, K)
    assert y.dtype == dtype
    x_deq, _ = quantize_x(x.float(), X_BLOCK)
    ref = x_deq @ w.T
    tol = 2 * SLACK * (x_deq.abs() @ w.abs().T) + torch.finfo(dtype).eps / 2 * ref.abs()
    assert ((y.double() - ref).abs() <= tol).all()


def test_nonfinite_x_takes_the_exact_kernel():
    N, K = 8, 256
    blocks, _ = case(Q4_K, N, K)
    x = torch.randn(2, K)
    x[0, 3] = float("nan")
    assert ops._gguf_cpu_route_int8_activations(x, blocks, int(Q4_K), N, K) == "exact"
    torch.testing.assert_close(ops.gguf_qmm_int8_activations(x, blocks, int(Q4_K), N, K),
                               ops.gguf_qmm(x, blocks, int(Q4_K), N, K), rtol=0, atol=0, equal_nan=True)


def test_gguf_matmul_follows_the_argument_and_the_setting():
    N, K = 16, 256
    blocks, _ = case(Q4_K, N, K)
    x = torch.randn(2, K)
    exact = ops.gguf_qmm(x, blocks, int(Q4_K), N, K)
    int8 = ops.gguf_qmm_int8_activations(x, blocks, int(Q4_K), N, K)
    assert not torch.equal(exact, int8)
    assert torch.equal(torch_qmm.ops.gguf_matmul(x, blocks, int(Q4_K), N, K), exact)
    assert torch.equal(torch_qmm.ops.gguf_matmul(x, blocks, int(Q4_K), N, K, activations="int8"), int8)
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(torch_qmm.ops.gguf_matmul(x, blocks, int(Q4_K), N, K), int8)
    with pytest.raises(ValueError, match="argument 'activations'"):
        torch_qmm.ops.gguf_matmul(x, blocks, int(Q4_K), N, K, activations="int4")


@pytest.mark.parametrize("ggml_type", [Q2_K, Q3_K, Q5_K], ids=lambda t: t.name)
def test_types_without_int8_kernels_stay_exact_in_the_setting_and_refuse_the_argument(ggml_type):
    # activation_quantization leaves calls it has no kernel for exact (as it does for fp modes);
    # an explicit activations="int8" raises, for gguf_matmul and gguf_gather_matmul alike.
    from torch_qmm.interop.gguf_gather import gguf_gather_matmul

    N, K = 16, 512
    blocks, _ = case(ggml_type, N, K, seed=5)
    x = torch.randn(3, K)
    exact = ops.gguf_qmm(x, blocks, int(ggml_type), N, K)
    experts = torch.stack([blocks, blocks.flip(0)])
    indices = torch.tensor([1])
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(torch_qmm.ops.gguf_matmul(x, blocks, int(ggml_type), N, K), exact)
        gathered = gguf_gather_matmul(x[None], experts, int(ggml_type), N, K, indices)
    assert torch.equal(gathered[0], ops.gguf_qmm(x, blocks.flip(0), int(ggml_type), N, K))
    message = rf"argument 'activations': 'int8' has kernels for ggml types \(12, 14\) \(Q4_K, Q6_K\) only, got ggml_type {int(ggml_type)}"
    with pytest.raises(ValueError, match="gguf_matmul: " + message):
        torch_qmm.ops.gguf_matmul(x, blocks, int(ggml_type), N, K, activations="int8")
    with pytest.raises(ValueError, match="gguf_gather_matmul: " + message):
        gguf_gather_matmul(x[None], experts, int(ggml_type), N, K, indices, activations="int8")


def test_gguf_linear_follows_the_setting():
    # GGUFLinear (the module GGUF imports build) runs through gguf_matmul, so the context manager
    # reaches models loaded from GGUF files.
    from torch_qmm.interop.modules import GGUFLinear

    N, K = 16, 256
    blocks, _ = case(Q6_K, N, K, seed=3)
    layer = GGUFLinear(K, N, int(Q6_K), bias=False)
    layer.blocks.copy_(blocks)
    x = torch.randn(3, K)
    assert torch.equal(layer(x), ops.gguf_qmm(x, blocks, int(Q6_K), N, K))
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(layer(x), ops.gguf_qmm_int8_activations(x, blocks, int(Q6_K), N, K))


def test_bad_arguments_name_them():
    blocks, _ = case(Q4_K, 4, 256)
    with pytest.raises(ValueError, match="K"):
        ops.gguf_qmm_int8_activations(torch.randn(1, 200), blocks, int(Q4_K), 4, 200)


def test_opcheck():
    blocks, _ = case(Q6_K, 8, 256)
    torch.library.opcheck(ops.gguf_qmm_int8_activations.default, (torch.randn(2, 256), blocks, int(Q6_K), 8, 256),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_nonfinite_block_scales_give_the_exact_result(ggml_type, width):
    # An Inf or NaN float16 super-block scale d makes the int8 result non-finite: the call must
    # redo it exactly (gguf_qmm: IEEE arithmetic weight by weight, NaN where a code times Inf is
    # 0 * Inf), not return the int8 kernel's Inf.
    N, K = 6, 512
    blocks, _ = case(ggml_type, N, K, seed=9)
    d_at = 0 if ggml_type == Q4_K else 208
    bb = 144 if ggml_type == Q4_K else 210
    raw = blocks.clone()
    for row, bits in ((1, 0x7C00), (4, 0x7E00)):  # +Inf, NaN in the second super-block of the row
        raw[row, bb + d_at:bb + d_at + 2] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))
    exact = ops.gguf_qmm(x, raw, int(ggml_type), N, K)
    assert not torch.isfinite(exact[:, [1, 4]]).any() and torch.isfinite(exact[:, [0, 2, 3, 5]]).all()
    torch.testing.assert_close(ops.gguf_qmm_int8_activations(x, raw, int(ggml_type), N, K), exact,
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_ties_round_half_to_even(ggml_type, width):
    from test_cpu_actq import _tie_x

    N, K = 9, 256
    blocks, w = case(ggml_type, N, K, seed=4)
    x = _tie_x(K)
    x_deq, _ = quantize_x(x, X_BLOCK)
    y = ops.gguf_qmm_int8_activations(x, blocks, int(ggml_type), N, K).double()
    assert ((y - x_deq @ w.T).abs() <= SLACK * (x_deq.abs() @ w.abs().T)).all()


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_extreme_blocks(ggml_type, width):
    # Super-block 0 of every row: d = 0 (Q4_K: dmin kept, so the weights are the offsets -dmin*m
    # alone). Super-block 1: every code and scale field at its largest (Q4_K: codes 15, scales and
    # mins 63; Q6_K: codes 63, scales -128 and 127), against x whose block 1 is constant, every
    # code 127: the largest integer products the kernels form (int16 pairs, int32 sums).
    N, K = 11, 768
    blocks, _ = case(ggml_type, N, K, seed=5)
    bb = 144 if ggml_type == Q4_K else 210
    raw = blocks.numpy().reshape(N, K // 256, bb).copy()
    if ggml_type == Q4_K:
        raw[:, 0, 0:2] = 0
        raw[:, 1, 4:144] = 0xFF
    else:
        raw[:, 0, 208:210] = 0
        raw[:, 1, 0:192] = 0xFF
        raw[:, 1, 192:208] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)
    raw = raw.reshape(N, -1)
    w = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    assert (w[:, :256] == 0).all() == (ggml_type == Q6_K) and (w[:, :256] != 0).any() == (ggml_type == Q4_K)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3))
    x[:, 256:512] = torch.tensor([2.5, -1.5, 3.0, -0.5]).unsqueeze(1)
    x_deq, d = quantize_x(x, X_BLOCK)
    assert ((x_deq / d)[:, 256:512].abs() == 127).all()  # every code of block 1 at the largest
    check_bounds(ops.gguf_qmm_int8_activations(x, torch.from_numpy(raw), int(ggml_type), N, K), x, w)
