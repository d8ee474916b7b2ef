"""Higher-order and forward-mode autograd through the products and the modules built on them
(torch_qmm/ops.py, "Forward mode"). Forward mode (torch.func.jvp / jacfwd, torch.autograd.forward_ad):
the tangent of a product linear in x is the product of x's tangent; without the Python functions
carrying it, the ops drop a tangent and jvp is silently zero. Double backward: the backward rules
are the same differentiable products. Both checked against float64 products of the weights the
kernels multiply by (torch_qmm.reference for affine, the gguf package's decode for GGUF blocks).

Tolerance: tests/tolerance.py's rule, magnitude |tangent| @ |W| (for affine |s*q| + |b|, as the
product's own tests), and one rounding to the dtype of the result; a chain of products adds each
product's bound, carried through |W| (stated at each test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from gguf import quants
from torch import nn

import torch_qmm
from gguf_helpers import Q4_K, Q6_K, random_k_blocks
from torch_qmm import reference
from torch_qmm.interop import GGUFLinear
from torch_qmm.nn import QuantLinear
from torch_qmm.nn_moe import QuantSwitchLinear
from tolerance import assert_matches_reference


def _affine(rows: int, cols: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch_qmm.quantize(torch.randn(rows, cols, generator=g).to(dtype), group_size=32, bits=4)


@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_jvp_of_quantized_matmul_is_the_product_of_the_tangent(transpose, dtype):
    wq, scales, biases = _affine(48, 64, 0, dtype)  # W [48, 64]: K 64 (T) or 48 (N)
    k = 64 if transpose else 48
    g = torch.Generator().manual_seed(1)
    x, t = (torch.randn(3, 5, k, generator=g).to(dtype) for _ in range(2))
    y, jvp = torch.func.jvp(lambda x: torch_qmm.quantized_matmul(x, wq, scales, biases, transpose, 32, 4), (x,), (t,))
    t2 = t.reshape(-1, k)
    ref = reference.qmm(t2, wq, scales, biases, 4, 32, transpose).reshape(jvp.shape)
    mag = reference.qmm_magnitude(t2, wq, scales, biases, 4, 32, transpose).reshape(jvp.shape)
    assert_matches_reference(jvp, ref, mag, dtype, "jvp")
    assert torch.equal(y, torch_qmm.quantized_matmul(x, wq, scales, biases, transpose, 32, 4))


def test_jacfwd_of_quant_linear_is_its_weight():
    layer = QuantLinear.from_linear(nn.Linear(64, 24, bias=True), bits=4, group_size=32)
    jac = torch.func.jacfwd(layer)(torch.randn(64))  # [24, 64]: one product per basis vector of x
    eye = torch.eye(64)
    args = (layer.qweight, layer.scales, layer.biases, 4, 32)
    assert_matches_reference(jac, reference.qmm(eye, *args).T, reference.qmm_magnitude(eye, *args).T,
                             torch.float32, "jacfwd")


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_forward_ad_through_gguf_linear(ggml_type):
    N, K = 24, 256
    blocks = random_k_blocks(ggml_type, N, K, np.random.default_rng(int(ggml_type)))
    w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
    layer = GGUFLinear(K, N, int(ggml_type))
    layer.blocks.copy_(torch.from_numpy(blocks))
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(4, K, generator=g), torch.randn(4, K, generator=g)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t))).tangent
    assert tangent is not None, "GGUFLinear dropped the tangent of x"
    assert_matches_reference(tangent, t.double() @ w.T, t.double().abs() @ w.abs().T, torch.float32, "tangent")


def test_jvp_of_quant_switch_linear_with_repeated_experts():
    layer = QuantSwitchLinear.from_float(torch.randn(4, 32, 64), bits=4, group_size=32)
    idx = torch.tensor([[1, 1], [3, 0], [1, 3]])
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(3, 1, 1, 64, generator=g), torch.randn(3, 1, 1, 64, generator=g)
    _, jvp = torch.func.jvp(lambda x: layer(x, idx), (x,), (t,))  # [3, 2, 1, 32]
    for p, e in enumerate(idx.tolist()):
        args = (layer.qweight[e[0]], layer.scales[e[0]], layer.biases[e[0]], 4, 32)
        args2 = (layer.qweight[e[1]], layer.scales[e[1]], layer.biases[e[1]], 4, 32)
        for j, a in enumerate((args, args2)):
            assert_matches_reference(jvp[p, j], reference.qmm(t[p, 0], *a), reference.qmm_magnitude(t[p, 0], *a),
                                     torch.float32, f"pair {p}, {j}")


@pytest.mark.parametrize("product", ["qmm", "gather_qmm"])
def test_hessian_vector_product_forward_over_reverse(product):
    # L = sum(f(x)^2) with f(x) = x @ W.T: grad = 2 f(x) @ W and its directional derivative along v
    # is 2 (v @ W.T) @ W, so the backward rules must carry the tangent of dy too.
    wq, scales, biases = _affine(24, 64, 4)
    if product == "qmm":
        f = lambda x: torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)  # noqa: E731
    else:
        f = lambda x: torch_qmm.gather_qmm(x, wq[None], scales[None], biases[None],  # noqa: E731
                                           rhs_indices=torch.zeros(3, dtype=torch.long), group_size=32, bits=4)
    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 64, generator=g)
    with fwAD.dual_level():
        xd = fwAD.make_dual(x, v).requires_grad_()
        (gx,) = torch.autograd.grad((f(xd) ** 2).sum(), xd, create_graph=True)
        hvp = fwAD.unpack_dual(gx).tangent
    assert hvp is not None, "the backward dropped the tangent of dy"
    w = reference.dequantize(wq, scales, biases, 4, 32)
    terms = reference.qmm_magnitude(torch.eye(64), wq, scales, biases, 4, 32).T  # |s*q| + |b|, [24, 64]
    ref = 2 * (v.double() @ w.T) @ w
    # Two float32 products in a row, each within the rule for its own terms: the second's bound is
    # relative to mag, and the first's error, relative to |v| @ terms.T, reaches the result through
    # 2 |W| <= 2 terms, so at most as much again: the magnitude doubled.
    mag = 2 * (v.double().abs() @ terms.T) @ terms
    assert_matches_reference(hvp, ref, 2 * mag, torch.float32, "hvp")


def test_tangents_the_products_cannot_carry_are_clear_errors():
    wq, scales, biases = _affine(8, 64, 6)
    x = torch.randn(2, 64)
    with fwAD.dual_level():
        s = fwAD.make_dual(scales, torch.ones_like(scales))
        with pytest.raises(RuntimeError, match="torch_qmm.qmm: no gradient with respect to 'scales'"):
            torch_qmm.quantized_matmul(x, wq, s, biases, group_size=32, bits=4)
        xd = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="qmm_int8_activations: no gradient with respect to its input x"):
            torch_qmm.quantized_matmul(xd, wq, scales, biases, group_size=32, bits=4, activations="int8")
        blocks = torch.from_numpy(random_k_blocks(Q4_K, 8, 256, np.random.default_rng(0)))
        xd = fwAD.make_dual(torch.randn(2, 256), torch.ones(2, 256))
        with pytest.raises(RuntimeError, match="gguf_qmm_int8_activations: no gradient with respect to its input x"):
            torch_qmm.ops.gguf_matmul(xd, blocks, 12, 8, 256, activations="int8")


@pytest.mark.parametrize("frozen", ["scales", "biases"])
@pytest.mark.parametrize("product", ["qmm", "gather_qmm"])
def test_a_tangent_on_the_scales_or_biases_of_either_affine_product_is_refused(product, frozen):
    # The float operands of the quantized weights are frozen (no gradient, so no tangent): a
    # tangent on any of them is an error naming it, for gather_qmm as for quantized_matmul, not
    # dropped (the product of x alone is not the jvp then).
    wq, scales, biases = _affine(8, 64, 6)
    x = torch.randn(2, 64)
    if product == "gather_qmm":
        wq, scales, biases, x = wq[None], scales[None], biases[None], x[None]
    with fwAD.dual_level():
        operands = {"scales": scales, "biases": biases}
        operands[frozen] = fwAD.make_dual(operands[frozen], torch.ones_like(operands[frozen]))
        with pytest.raises(RuntimeError, match=f"torch_qmm.{product}: no gradient with respect to '{frozen}'"):
            if product == "qmm":
                torch_qmm.quantized_matmul(x, wq, operands["scales"], operands["biases"], group_size=32, bits=4)
            else:
                torch_qmm.gather_qmm(x, wq, operands["scales"], operands["biases"], group_size=32, bits=4)


@pytest.mark.parametrize("product", ["qmm", "gather_qmm", "gguf_qmm"])
def test_double_backward_matches_float64(product):
    # L = sum(f(x)^2), g = dL/dx = 2 f(x) @ W, H = sum(g^2): dH/dx = 8 x W.T W W.T W, through four
    # float32 products (f, g, and the two of H's backward), each within the rule for its own terms
    # and carried through |W| <= terms by the later ones: the magnitude four times over.
    if product == "gguf_qmm":
        blocks = random_k_blocks(Q6_K, 24, 256, np.random.default_rng(7))
        w = torch.from_numpy(quants.dequantize(blocks, Q6_K)).double()
        terms, K = w.abs(), 256
        f = lambda x: torch_qmm.ops.gguf_matmul(x, torch.from_numpy(blocks), int(Q6_K), 24, 256)  # noqa: E731
    else:
        wq, scales, biases = _affine(24, 64, 7)
        w = reference.dequantize(wq, scales, biases, 4, 32)
        terms, K = reference.qmm_magnitude(torch.eye(64), wq, scales, biases, 4, 32).T, 64
        if product == "qmm":
            f = lambda x: torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)  # noqa: E731
        else:
            f = lambda x: torch_qmm.gather_qmm(x, wq[None], scales[None], biases[None],  # noqa: E731
                                               rhs_indices=torch.tensor([0, 0, 0]), group_size=32, bits=4)
    x = torch.randn(3, 1, K, generator=torch.Generator().manual_seed(8)).requires_grad_()
    (g,) = torch.autograd.grad((f(x) ** 2).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad((g ** 2).sum(), x)
    ref = 8 * x.detach().double() @ w.T @ w @ w.T @ w
    mag = 8 * x.detach().double().abs() @ terms.T @ terms @ terms.T @ terms
    assert_matches_reference(h, ref, 4 * mag, torch.float32, f"{product} double backward")


def _x_shapes(fn, name: str) -> tuple[torch.Tensor, list[list[int]]]:
    """fn()'s result and the shape of the first argument of every call of the op `name` the
    profiler saw (under vmap the first is the batched call as vmap sees it, per element)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = fn()
    return out, [e.input_shapes[0] for e in prof.events() if e.name == name]


def test_vmap_over_x_is_one_call():
    # The products take x with leading dimensions: a batch of x needs no loop (PyTorch's fallback
    # would call the op once per element, with a performance warning).
    torch.manual_seed(7)
    q = QuantLinear.from_linear(nn.Linear(128, 48), bits=4, group_size=64)
    x = torch.randn(5, 3, 128)
    y, shapes = _x_shapes(lambda: torch.func.vmap(q)(x), "torch_qmm::qmm")
    assert shapes[1:] == [[5, 3, 128]] and torch.equal(y, q(x))
    y_in = torch.func.vmap(q, in_dims=1, out_dims=1)(x)  # batch along another dimension
    assert torch.equal(y_in, torch.stack([q(x[:, i]) for i in range(3)], 1))

    _assert_gguf_vmap_over_x_is_one_call("gguf_qmm", seed=1)


def _assert_gguf_vmap_over_x_is_one_call(name: str, seed: int) -> None:
    blocks = torch.from_numpy(random_k_blocks(Q4_K, 16, 512, np.random.default_rng(seed)))
    xg = torch.randn(4, 2, 512)
    op = getattr(torch.ops.torch_qmm, name)
    y, shapes = _x_shapes(lambda: torch.func.vmap(lambda t: op(t, blocks, int(Q4_K), 16, 512))(xg),
                          f"torch_qmm::{name}")
    assert shapes[1:] == [[4, 2, 512]] and torch.equal(y, op(xg, blocks, int(Q4_K), 16, 512))


def test_vmap_over_weights_is_each_elements_call():
    # A batch of scales (e.g. several quantized versions of one layer): one call per element,
    # each equal to the unbatched call.
    torch.manual_seed(8)
    wq, scales, biases = torch_qmm.quantize(torch.randn(32, 128), group_size=32, bits=4)
    many = torch.stack([scales, scales * 2, scales * -0.5])
    x = torch.randn(2, 128)
    op = torch.ops.torch_qmm.qmm
    y = torch.func.vmap(lambda s: op(x, wq, s, biases, "affine", 4, 32, True))(many)
    assert torch.equal(y, torch.stack([op(x, wq, s, biases, "affine", 4, 32, True) for s in many]))


def test_vmap_over_x_and_weights_along_any_dimensions():
    # Every batched argument at its own dimension, x too; against a loop over the batch, bit for bit
    # (each element is the same call as the loop's).
    torch.manual_seed(8)
    wq, scales, biases = torch_qmm.quantize(torch.randn(32, 128), group_size=32, bits=4)
    many = torch.stack([scales, scales * 2, scales * -0.5])
    x = torch.randn(3, 2, 128)
    op = torch.ops.torch_qmm.qmm
    h = lambda t, s: op(t, wq, s, biases, "affine", 4, 32, True)  # noqa: E731
    loop = torch.stack([h(x[i], many[i]) for i in range(3)])
    assert torch.equal(torch.func.vmap(h)(x, many), loop)  # x and scales batched together
    assert torch.equal(torch.func.vmap(h, in_dims=(0, 1))(x, many.movedim(0, 1)), loop)
    assert torch.equal(torch.func.vmap(h, in_dims=(1, 0), out_dims=1)(x.movedim(0, 1), many), loop.movedim(0, 1))
    stacked = torch.stack([wq, wq.flip(0)])  # a batch of packed words
    g = lambda w: op(x[0], w, scales, biases, "affine", 4, 32, True)  # noqa: E731
    assert torch.equal(torch.func.vmap(g)(stacked), torch.stack([g(w) for w in stacked]))
    x4 = torch.randn(2, 4, 3, 128)  # x batched along a middle dimension of 4
    f = lambda t: op(t, wq, scales, biases, "affine", 4, 32, True)  # noqa: E731
    assert torch.equal(torch.func.vmap(f, in_dims=2)(x4), torch.stack([f(x4[:, :, i]) for i in range(3)]))


def test_vmap_of_the_int8_ops_over_x_is_one_call():
    wq, scales, biases = torch_qmm.quantize(torch.randn(32, 128, generator=torch.Generator().manual_seed(9)),
                                            group_size=32, bits=4)
    x = torch.randn(5, 3, 128)
    op = torch.ops.torch_qmm.qmm_int8_activations
    y, shapes = _x_shapes(lambda: torch.func.vmap(lambda t: op(t, wq, scales, biases, "affine", 4, 32))(x),
                          "torch_qmm::qmm_int8_activations")
    assert shapes[1:] == [[5, 3, 128]] and torch.equal(y, op(x, wq, scales, biases, "affine", 4, 32))
    _assert_gguf_vmap_over_x_is_one_call("gguf_qmm_int8_activations", seed=2)


def test_vmap_over_an_empty_batch_of_weights():
    wq, scales, biases = torch_qmm.quantize(torch.randn(48, 128), group_size=64, bits=4)
    x = torch.randn(3, 128)
    op = torch.ops.torch_qmm.qmm
    y = torch.func.vmap(lambda s: op(x, wq, s, biases, "affine", 4, 64, True))(scales[None][:0])
    assert y.shape == (0, 3, 48) and y.dtype == torch.float32
    with pytest.raises(ValueError, match="scales"):  # the op's own checks still run on the element
        torch.func.vmap(lambda s: op(x, wq, s, biases, "affine", 4, 64, True))(scales[None, :, :1][:0])


def test_vmap_of_dequantize_and_of_a_quantized_embedding():
    # dequantize has a rule of its own: the batch's matrices are dequantized as one stack of rows
    # (no per-element loop, no performance warning); QuantEmbedding reads its rows with index_select
    # there, which refuses ids out of range (batched ids have no values to check on the host).
    import warnings

    from torch_qmm.interop.modules import QuantEmbedding

    torch.manual_seed(3)
    stack = [torch_qmm.quantize(torch.randn(8, 64), group_size=32, bits=4) for _ in range(3)]
    wq, scales, biases = (torch.stack(t) for t in zip(*stack))
    deq = torch.ops.torch_qmm.dequantize
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torch.func.vmap(lambda w, s, b: deq(w, s, b, "affine", 4, 32, None))(wq, scales, biases)
        y_scales_only = torch.func.vmap(lambda s: deq(wq[0], s, biases[0], "affine", 4, 32, None), in_dims=1)(
            scales.movedim(0, 1))
    assert torch.equal(y, torch.stack([deq(*t, "affine", 4, 32, None) for t in stack]))
    assert torch.equal(y_scales_only, torch.stack([deq(wq[0], s, biases[0], "affine", 4, 32, None) for s in scales]))
    empty = torch.func.vmap(lambda w, s, b: deq(w, s, b, "affine", 4, 32, None))(wq[:0], scales[:0], biases[:0])
    assert empty.shape == (0, 8, 64)
    with pytest.raises(ValueError, match="argument 'scales' must have shape"):  # each element checked as alone
        torch.func.vmap(lambda w, s, b: deq(w, s, b, "affine", 4, 32, None))(wq, scales[:, None], biases)

    table = QuantEmbedding.from_embedding(nn.Embedding(100, 64), bits=4, group_size=32)
    ids = torch.tensor([[1, 2, 3], [4, 5, 99]])
    assert torch.equal(torch.func.vmap(table)(ids), table(ids))
    for bad in (100, -1):
        wrong = ids.clone()
        wrong[1, 2] = bad
        with pytest.raises(RuntimeError, match="out of bounds"):
            torch.func.vmap(table)(wrong)
