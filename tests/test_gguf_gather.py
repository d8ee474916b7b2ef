"""gguf_gather_matmul (torch_qmm::gguf_gather_qmm): y = x @ W[indices].T for a stack of GGUF K-quant
expert weights (every native type), checked against gguf.quants.dequantize with a float64 matmul on every backend
of the `device` fixture; its errors, torch.compile and opcheck; GGUFSwitchLinear's state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from gguf_helpers import NATIVE_K_TYPES, Q4_K, Q6_K, assert_matches_reference, k_quant_magnitude, random_k_blocks
from torch_qmm import ops
from torch_qmm.activations import activation_quantization
from torch_qmm.interop.gguf_gather import gguf_gather_matmul
from torch_qmm.interop.modules import GGUFSwitchLinear
from torch_qmm.ops import gguf_matmul

E, N, K = 5, 9, 512


def _experts(ggml_type, seed=0):
    """(blocks uint8 [E, N, bytes], W float64 [E, N, K]) as gguf decodes them."""
    rng = np.random.default_rng(seed)
    blocks = random_k_blocks(ggml_type, E * N, K, rng)
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double().reshape(E, N, K)
    return torch.from_numpy(blocks).reshape(E, N, -1), w


def _reference(x, w, blocks, indices, ggml_type):
    """(y_ref, magnitude) float64 [*batch, M, N]: each row block of x against its expert."""
    batch = torch.broadcast_shapes(x.shape[:-2], indices.shape)
    xs = x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
    ids = indices.expand(batch).reshape(-1).tolist()
    ref = torch.stack([xs[p].double() @ w[e].T for p, e in enumerate(ids)])
    mag = torch.stack([k_quant_magnitude(xs[p], blocks[e], ggml_type) for p, e in enumerate(ids)])
    return ref.reshape(*batch, x.shape[-2], N), mag.reshape(*batch, x.shape[-2], N)


@pytest.mark.parametrize("ggml_type", NATIVE_K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape, idx_shape", [
    ((7, 1, 1, K), (7, 3)),  # QuantFusedExperts' unsorted pairs: each token's row against its k experts
    ((12, 1, K), (12,)),  # sorted pairs, one row each
    ((3, 4, K), (3,)),  # several rows per pair
])
def test_gguf_gather_matches_gguf_dequantize(device, ggml_type, dtype, x_shape, idx_shape):
    blocks, w = _experts(ggml_type)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(x_shape, generator=g).to(dtype)
    indices = torch.randint(0, E, idx_shape, generator=g)
    indices.view(-1)[0] = E - 1  # the last expert's rows, wherever the draw leaves it out
    y = gguf_gather_matmul(x.to(device), blocks.to(device), int(ggml_type), N, K, indices.to(device))
    ref, mag = _reference(x, w, blocks, indices, ggml_type)
    assert_matches_reference(y, ref, mag, dtype, f"{ggml_type.name} x {list(x_shape)} indices {list(idx_shape)}")


def test_gguf_gather_int8_activations_take_gguf_matmuls_int8_path():
    blocks, _ = _experts(Q4_K, seed=2)
    x = torch.randn(6, 1, K, generator=torch.Generator().manual_seed(3))
    indices = torch.tensor([4, 0, 4, 2, 0, 1])
    with activation_quantization("int8"):
        y = gguf_gather_matmul(x, blocks, int(Q4_K), N, K, indices)
    want = torch.stack([gguf_matmul(x[p], blocks[e], int(Q4_K), N, K, activations="int8")
                        for p, e in enumerate(indices.tolist())])
    exact = gguf_gather_matmul(x, blocks, int(Q4_K), N, K, indices)
    torch.testing.assert_close(y, want, rtol=0, atol=0)  # the same int8 kernel on the same rows
    assert not torch.equal(y, exact)


@pytest.mark.parametrize("kwargs, message", [
    (dict(indices=torch.tensor([0, 5])), r"argument 'indices' must be in \[0, 5\).*got 5"),
    (dict(indices=torch.tensor([0, -1])), r"argument 'indices' must be in \[0, 5\).*got -1"),
    (dict(indices=torch.tensor([0.0, 1.0])), r"argument 'indices' must be an integer tensor, got torch.float32"),
    (dict(indices=torch.tensor([0, 1, 2])), r"argument 'indices' of shape \[3\] does not broadcast with x's batch dims \[2\]"),
    (dict(ggml_type=8), r"argument 'ggml_type' must be one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\), 16 \(IQ2_XXS\), .*, 29 \(IQ1_M\), got 8"),
    (dict(K=100, x=torch.randn(2, 1, 100)), r"gguf_gather_matmul: argument 'K' must be a multiple of 256, got 100"),
    (dict(N=8), r"argument 'blocks' must be uint8 \[E, N=8, 288\] \(Q4_K blocks of K=512\), got torch.uint8 \[5, 9, 288\]"),
    (dict(x=torch.randn(2, 1, 256)), r"argument 'x' must be a float tensor \[..., M, K=512\], got torch.float32 \[2, 1, 256\]"),
])
def test_gguf_gather_bad_arguments_name_the_argument(kwargs, message):
    blocks, _ = _experts(Q4_K)
    args = dict(x=torch.randn(2, 1, K), blocks=blocks, ggml_type=int(Q4_K), N=N, K=K, indices=torch.tensor([0, 1]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        gguf_gather_matmul(**args)


def test_gguf_gather_op_passes_opcheck():
    blocks, _ = _experts(Q6_K)
    x, indices = torch.randn(4, 2, K), torch.tensor([3, 0, 3, 1])
    torch.library.opcheck(torch.ops.torch_qmm.gguf_gather_qmm.default, (x, blocks, int(Q6_K), N, K, indices, "exact"))


def test_gguf_switch_linear_compiles_with_fullgraph_and_keeps_its_format_in_state_dict():
    blocks, w = _experts(Q6_K, seed=4)
    layer = GGUFSwitchLinear(E, K, N, int(Q6_K))
    layer.blocks.copy_(blocks)
    x = torch.randn(8, 1, 1, K, generator=torch.Generator().manual_seed(5))
    indices = torch.randint(0, E, (8, 2), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, indices), layer(x, indices), rtol=0, atol=0)
    ref, mag = _reference(x, w, blocks, indices, Q6_K)
    assert_matches_reference(layer(x, indices), ref, mag, torch.float32, "GGUFSwitchLinear")

    state = layer.state_dict()
    other = GGUFSwitchLinear(E, K, N, int(Q6_K))
    other.load_state_dict(state)
    assert torch.equal(other.blocks, blocks)
    # a Q4_K layer given that state (its blocks of the Q4_K shape) refuses it by the format, not a shape
    with pytest.raises(ValueError, match=r"the state holds ggml_type=14 \(Q6_K\), this layer has ggml_type=12 \(Q4_K\)"):
        GGUFSwitchLinear(E, K, N, int(Q4_K)).load_state_dict(
            {**state, "blocks": torch.zeros(E, N, K // 256 * 144, dtype=torch.uint8)})


@pytest.mark.parametrize("ggml_type", NATIVE_K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("slice_rows", [None, 4, 5])
def test_gguf_gather_gradient_in_x_is_dy_times_each_pairs_expert(ggml_type, slice_rows, monkeypatch):
    # x [T, 1, 1, K] broadcast over k experts per token (QuantFusedExperts' call): dx sums the
    # token's pairs. Reference: float64 dy @ W_e, W_e as gguf decodes it (which the backward's decode
    # equals bit for bit). Each element of dx is k float32 sums of N products, then the k summed:
    # at most N + k roundings of 2^-24 relative to the sum of the terms' magnitudes (one spare).
    # slice_rows: W decoded that many rows at a time (a layer larger than GGUF_DX_SLICE_BYTES), the
    # last slice partial for 4 and 5 when N = 9.
    if slice_rows is not None:
        monkeypatch.setattr(ops, "GGUF_DX_SLICE_BYTES", slice_rows * 4 * K)
        assert ops.gguf_dx_slice_rows(K) == slice_rows < N
    blocks, w = _experts(ggml_type, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 1, 1, K, generator=g, requires_grad=True)
    indices = torch.randint(0, E, (6, 3), generator=g)
    y = gguf_gather_matmul(x, blocks, int(ggml_type), N, K, indices)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    want = torch.zeros(6, 1, 1, K, dtype=torch.float64)
    for t in range(6):
        for j, e in enumerate(indices[t].tolist()):
            want[t, 0, 0] += dy[t, j, 0].double() @ w[e]
    mag = torch.zeros_like(want)
    for t in range(6):
        for j, e in enumerate(indices[t].tolist()):
            mag[t, 0, 0] += dy[t, j, 0].double().abs() @ w[e].abs()
    assert ((x.grad.double() - want).abs() <= 2 ** -24 * (N + 3 + 1) * mag).all()


def test_gguf_gather_forward_mode_tangent_is_the_product_of_the_tangent():
    import torch.autograd.forward_ad as fwAD

    blocks, _ = _experts(Q4_K, seed=9)
    x, t = torch.randn(4, 1, K), torch.randn(4, 1, K)
    indices = torch.tensor([1, 3, 1, 0])
    with fwAD.dual_level():
        y = gguf_gather_matmul(fwAD.make_dual(x, t), blocks, int(Q4_K), N, K, indices)
        tangent = fwAD.unpack_dual(y).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, gguf_gather_matmul(t, blocks, int(Q4_K), N, K, indices), rtol=0, atol=0)


def test_gguf_gather_int8_activations_refuse_a_gradient():
    blocks, _ = _experts(Q4_K)
    x = torch.randn(2, 1, K, requires_grad=True)
    y = gguf_gather_matmul(x, blocks, int(Q4_K), N, K, torch.tensor([0, 1]), activations="int8")
    with pytest.raises(RuntimeError, match=r"gguf_gather_matmul: no gradient with respect to its input x"):
        y.sum().backward()


def test_gguf_gather_int8_activations_refuse_a_forward_mode_tangent():
    import torch.autograd.forward_ad as fwAD

    blocks, _ = _experts(Q4_K)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=r"gguf_gather_matmul: no gradient with respect to its"):
        gguf_gather_matmul(fwAD.make_dual(torch.randn(2, 1, K), torch.randn(2, 1, K)), blocks, int(Q4_K), N, K,
                           torch.tensor([0, 1]), activations="int8")
