"""The opt-in int8-activation path of gather_qmm (gather_qmm_int8_activations, csrc/cpu/gather_qmm.cpp;
torch_qmm.gather_qmm(..., activations="int8"), torch_qmm.activation_quantization, QuantSwitchLinear).

Oracles:
- qmm_int8_activations on each pair's own rows of x and matrix of W, bit for bit: gather_qmm's
  int8 path runs that op's kernels on each expert's gathered rows, and every row of x is quantized
  and multiplied on its own (no sum runs across rows or across rows of W), so grouping, sorting and
  slicing W's rows among threads must not change a bit;
- float64, independent of the kernels: each expert dequantized by torch_qmm.reference, x quantized
  here as docs/activation-quantization.md defines it (per block of 32 along K: d = max|x| / 127 and
  q = x / d rounded half to even, both in float32; q in [-127, 127]; d = 0 gives q = 0), and the
  pairs gathered here. Tolerance, derived: the integer dot products are exact, so y differs from
  W x_deq only by float32 rounding of the rest: each of the at most n = K/32 + K/G + 8 float32 steps
  in an output's chain (one product-and-add per block of 32 and per group's bias term, the lane
  reduction) rounds by at most 2^-24 of what it has summed, all of which is bounded by
  mag = |x_deq| @ (|s q| + |b|) (reference.qmm_magnitude), so |y - W x_deq| <= n 2^-24 mag; a
  16-bit y adds its own rounding, half an ulp of |W x_deq| plus the bound.
"""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm import reference
from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

from cpu_features import HAS_INT8_512

ops = torch.ops.torch_qmm
E = 5
UNUSED = 3  # an expert no pair uses


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (any float dtype) quantized per block of 32 along K and dequantized, float64."""
    xf = x.float()
    xb = xf.reshape(*xf.shape[:-1], xf.shape[-1] // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0  # float32, as the definition
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1.0)), 0.0).clamp(-127, 127)
    return (q.double() * d.double()).reshape(xf.shape)


def experts(N, K, bits, group_size, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, N, K, generator=g) * scale).to(dtype)
    return torch_qmm.quantize(w, group_size=group_size, bits=bits)


def pairs(sorted_rhs: bool):
    """lhs [9], rhs [9] into x [6, M, K] and W [E]: experts 0, 1, 2, 4 used by 4, 1, 3 and 1 pairs
    (uneven groups), expert UNUSED by none; pairs in expert order or shuffled."""
    rhs = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 4])
    lhs = torch.tensor([0, 3, 5, 1, 2, 4, 0, 5, 3])
    if not sorted_rhs:
        perm = torch.tensor([5, 0, 8, 2, 6, 1, 4, 7, 3])
        lhs, rhs = lhs[perm], rhs[perm]
    assert UNUSED not in rhs.tolist()
    return lhs, rhs


def per_pair_int8(x, wq, s, b, lhs, rhs, bits, group_size):
    return torch.stack([ops.qmm_int8_activations(x[i], wq[e], s[e], b[e], "affine", bits, group_size)
                        for i, e in zip(lhs.tolist(), rhs.tolist())])


@pytest.fixture(params=["512", "256"])
def width(request, monkeypatch):
    """The int8 kernels' vector width: 512-bit where the CPU has them, or 256-bit."""
    if request.param == "512" and not HAS_INT8_512:
        pytest.skip("no AVX512_VNNI + AVX512BW here")
    if request.param == "256":
        monkeypatch.setenv("TORCH_QMM_CPU_NO_INT8_512", "1")
    else:
        monkeypatch.delenv("TORCH_QMM_CPU_NO_INT8_512", raising=False)


@pytest.mark.parametrize("sorted_rhs", [False, True], ids=["shuffled", "sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
def test_matches_qmm_int8_per_pair_and_float64(bits, group_size, dtype, sorted_rhs, width, threads):
    # N = 300: with 2 threads and 4 groups, each group's rows of W are cut into two slices.
    M, N, K = 3, 300, 512
    wq, s, b = experts(N, K, bits, group_size, dtype)
    x = (torch.randn(6, M, K, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3.0, K)).to(dtype)
    lhs, rhs = pairs(sorted_rhs)
    y = ops.gather_qmm_int8_activations(x, wq, s, b, lhs, rhs, "affine", bits, group_size, sorted_rhs)
    assert y.shape == (9, M, N) and y.dtype == dtype
    assert torch.equal(y, per_pair_int8(x, wq, s, b, lhs, rhs, bits, group_size))
    # The Python function with the argument, and with the hint the other way: the same bits.
    assert torch.equal(torch_qmm.gather_qmm(x, wq, s, b, lhs, rhs, group_size=group_size, bits=bits,
                                            sorted_indices=not sorted_rhs, activations="int8"), y)

    x_deq = quantize_x(x)[lhs]  # [9, M, K]
    ref = torch.empty(9, M, N, dtype=torch.float64)
    mag = torch.empty_like(ref)
    for e in rhs.unique().tolist():
        at = rhs == e
        ref[at] = x_deq[at] @ reference.dequantize(wq[e], s[e], b[e], bits, group_size).T
        mag[at] = reference.qmm_magnitude(x_deq[at], wq[e], s[e], b[e], bits, group_size)
    tol = (K // 32 + K // group_size + 8) * 2.0**-24 * mag
    if dtype != torch.float32:
        tol = tol + torch.finfo(dtype).eps / 2 * (ref.abs() + tol)
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"worst excess {(err - tol).max().item():.3g}"
    # Not the exact product: the int8 rounding shows.
    exact = ops.gather_qmm(x, wq, s, b, lhs, rhs, "affine", bits, group_size, True, sorted_rhs)
    assert not torch.equal(y, exact)


def test_mlx_lm_layout_and_no_lhs(threads):
    # x [T, 1, 1, K] and rhs [T, k] (MLX-LM's SwitchGLU), and x [E, M, K] with no indices at all.
    wq, s, b = experts(64, 256, 4, 64)
    x = torch.randn(7, 1, 1, 256, generator=torch.Generator().manual_seed(2))
    rhs = torch.tensor([[0, 2], [2, 4], [0, 1], [4, 2], [2, 0], [1, 4], [2, 4]])
    y = torch_qmm.gather_qmm(x, wq, s, b, rhs_indices=rhs, activations="int8")
    assert y.shape == (7, 2, 1, 64)
    for t in range(7):
        for j in range(2):
            e = int(rhs[t, j])
            assert torch.equal(y[t, j], ops.qmm_int8_activations(x[t, 0], wq[e], s[e], b[e], "affine", 4, 64))
    xe = torch.randn(E, 2, 256)
    ye = torch_qmm.gather_qmm(xe, wq, s, b, activations="int8")
    assert torch.equal(ye, torch.stack([ops.qmm_int8_activations(xe[e], wq[e], s[e], b[e], "affine", 4, 64)
                                        for e in range(E)]))


def test_context_manager_argument_and_default():
    wq, s, b = experts(64, 256, 4, 32)
    x = torch.randn(6, 2, 256, generator=torch.Generator().manual_seed(3))
    lhs, rhs = pairs(False)
    exact = ops.gather_qmm(x, wq, s, b, lhs, rhs, "affine", 4, 32, True, False)
    int8 = ops.gather_qmm_int8_activations(x, wq, s, b, lhs, rhs, "affine", 4, 32, False)
    assert not torch.equal(exact, int8)

    def call(**kw):
        return torch_qmm.gather_qmm(x, wq, s, b, lhs, rhs, group_size=32, bits=4, **kw)

    assert torch.equal(call(), exact)  # the default: exact, the op's bits
    assert torch.equal(call(activations="int8"), int8)
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(call(), int8)
        with torch_qmm.activation_quantization(None):
            assert torch.equal(call(), exact)
        # transpose=False and the fp modes stay exact under the setting (no error).
        wn, sn, bn = torch_qmm.quantize(torch.randn(E, 256, 64), group_size=32, bits=4)  # W [K, N]
        assert torch.equal(torch_qmm.gather_qmm(x, wn, sn, bn, lhs, rhs, transpose=False, group_size=32, bits=4),
                           ops.gather_qmm(x, wn, sn, bn, lhs, rhs, "affine", 4, 32, False, False))
        wf, sf = torch_qmm.quantize(torch.randn(E, 64, 256), mode="mxfp4")
        assert torch.equal(torch_qmm.gather_qmm(x, wf, sf, None, lhs, rhs, mode="mxfp4"),
                           ops.gather_qmm(x, wf, sf, None, lhs, rhs, "mxfp4", 4, 32, True, False))
        # Off the CPU (meta tensors here) the call stays exact: only shapes.
        meta = [t.to("meta") for t in (x, wq, s, b, lhs, rhs)]
        assert torch_qmm.gather_qmm(*meta, group_size=32, bits=4).shape == (9, 2, 64)
    assert torch.equal(call(), exact)


def test_bad_arguments_are_named():
    wq, s, b = experts(64, 128, 4, 64)
    x = torch.randn(2, 1, 128)
    rhs = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="argument 'activations'.*'int4'"):
        torch_qmm.gather_qmm(x, wq, s, b, rhs_indices=rhs, group_size=64, bits=4, activations="int4")
    wn, sn, bn = torch_qmm.quantize(torch.randn(E, 128, 64), group_size=64, bits=4)
    with pytest.raises(ValueError, match="argument 'transpose' must be True with activations='int8'"):
        torch_qmm.gather_qmm(x, wn, sn, bn, rhs_indices=rhs, transpose=False, group_size=64, bits=4,
                             activations="int8")
    wf, sf = torch_qmm.quantize(torch.randn(E, 8, 128), mode="mxfp4")
    message = "gather_qmm_int8_activations: argument 'mode' must be 'affine'"
    with pytest.raises(ValueError, match=message):
        torch_qmm.gather_qmm(x, wf, sf, rhs_indices=rhs, mode="mxfp4", activations="int8")
    with pytest.raises(ValueError, match=message):
        ops.gather_qmm_int8_activations(x.to("meta"), wf.to("meta"), sf.to("meta"), None, None, rhs.to("meta"),
                                        "mxfp4", 4, 32, False)
    with pytest.raises(ValueError, match="argument 'activations': 'int8' runs on CPU tensors only, got x on meta"):
        torch_qmm.gather_qmm(*(t.to("meta") for t in (x, wq, s, b)), rhs_indices=rhs.to("meta"), group_size=64,
                             bits=4, activations="int8")
    # gather_qmm's own checks, under the int8 op's name for its mode check only.
    with pytest.raises(ValueError, match="argument 'rhs_indices' must hold indices in"):
        ops.gather_qmm_int8_activations(x, wq, s, b, None, torch.tensor([0, E]), "affine", 4, 64, False)
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="gather_qmm_int8_activations: no gradient"):
        torch_qmm.gather_qmm(xg, wq, s, b, rhs_indices=rhs, group_size=64, bits=4,
                             activations="int8").sum().backward()
    with torch_qmm.activation_quantization("int8"), pytest.raises(RuntimeError, match="no gradient"):
        torch_qmm.gather_qmm(xg, wq, s, b, rhs_indices=rhs, group_size=64, bits=4).sum().backward()
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(RuntimeError, match="gather_qmm_int8_activations: no gradient"):
        torch_qmm.gather_qmm(fwAD.make_dual(x, torch.ones_like(x)), wq, s, b, rhs_indices=rhs, group_size=64,
                             bits=4, activations="int8")


def test_nonfinite_x_takes_the_exact_kernels():
    wq, s, b = experts(16, 128, 4, 64)
    lhs, rhs = pairs(False)
    x = torch.randn(6, 2, 128)
    x[5, 1, 7] = float("inf")
    x[2, 0, 3] = float("nan")
    exact = ops.gather_qmm(x, wq, s, b, lhs, rhs, "affine", 4, 64, True, False)
    torch.testing.assert_close(ops.gather_qmm_int8_activations(x, wq, s, b, lhs, rhs, "affine", 4, 64, False),
                               exact, rtol=0, atol=0, equal_nan=True)
    # Block sums past float32 (the bias terms' X_g = sum of d * sum(q) ~ 6e38 for x = 1e37 over
    # a group of 64) with small weights, whose exact product is finite: qmm's exact result.
    wq, s, b = experts(16, 128, 4, 64, scale=0.01)
    big = torch.full((6, 1, 128), 1e37)
    exact = ops.gather_qmm(big, wq, s, b, lhs, rhs, "affine", 4, 64, True, False)
    assert torch.isfinite(exact).all()
    assert torch.equal(ops.gather_qmm_int8_activations(big, wq, s, b, lhs, rhs, "affine", 4, 64, False), exact)


def test_empty_calls():
    wq, s, b = experts(16, 128, 4, 64)
    y = ops.gather_qmm_int8_activations(torch.randn(2, 0, 128), wq, s, b, None, torch.tensor([1, 2]), "affine", 4,
                                        64, False)
    assert y.shape == (2, 0, 16)
    y = ops.gather_qmm_int8_activations(torch.randn(1, 1, 128), wq, s, b, None, torch.tensor([], dtype=torch.long),
                                        "affine", 4, 64, False)
    assert y.shape == (0, 1, 16)


def test_opcheck_and_meta():
    wq, s, b = experts(16, 128, 4, 64)
    args = (torch.randn(3, 2, 128), wq, s, b, torch.tensor([2, 0, 1, 2]), torch.tensor([4, 0, 4, 1]), "affine", 4,
            64, False)
    torch.library.opcheck(ops.gather_qmm_int8_activations.default, args, test_utils=("test_schema", "test_faketensor"))
    meta = ops.gather_qmm_int8_activations(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args))
    assert meta.shape == (4, 2, 16) and meta.dtype == torch.float32
    bad = (torch.randn(3, 2, 96),) + args[1:]  # K of x against W's 128
    with pytest.raises(ValueError) as real:
        ops.gather_qmm_int8_activations(*bad)
    with pytest.raises(ValueError) as on_meta:
        ops.gather_qmm_int8_activations(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in bad))
    assert str(real.value) == str(on_meta.value)


def test_compiles_fullgraph_and_follows_the_setting():
    torch._dynamo.reset()
    wq, s, b = experts(32, 256, 4, 64)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    experts_of = torch.tensor([[0, 2], [4, 2], [1, 0], [2, 4]])

    def f(x, idx):
        return torch_qmm.gather_qmm(x[:, None, None, :], wq, s, b, rhs_indices=idx, group_size=64, bits=4) * 2

    cf = torch.compile(f, fullgraph=True)
    exact = ops.gather_qmm(x[:, None, None, :], wq, s, b, None, experts_of, "affine", 4, 64, True, False) * 2
    int8 = ops.gather_qmm_int8_activations(x[:, None, None, :], wq, s, b, None, experts_of, "affine", 4, 64,
                                           False) * 2
    assert not torch.equal(exact, int8)
    assert torch.equal(cf(x, experts_of), exact)
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(cf(x, experts_of), int8)
    assert torch.equal(cf(x, experts_of), exact)
    layer = QuantSwitchLinear.from_quantized(wq, s, b, bits=4, group_size=64, activations="int8")
    cl = torch.compile(layer, fullgraph=True)
    assert torch.equal(cl(x[:, None, None, :], experts_of), int8 / 2)


class _Gate(torch.nn.Module):
    def forward(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def _moe(activations=None):
    g = torch.Generator().manual_seed(5)
    H, inter = 128, 64
    gate_up = QuantSwitchLinear.from_float(torch.randn(E, 2 * inter, H, generator=g), bits=4, group_size=32,
                                           activations=activations)
    down = QuantSwitchLinear.from_float(torch.randn(E, H, inter, generator=g), bits=8, group_size=64,
                                        activations=activations)
    return QuantFusedExperts(gate_up, down, _Gate())


@pytest.mark.parametrize("tokens", [6, 40], ids=["unsorted", "sorted"])  # 40 * 2 pairs: sorted by expert
def test_moe_module_under_the_context_manager(tokens):
    moe, moe8 = _moe(), _moe("int8")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, 128, generator=gen)
    idx = torch.rand(tokens, E, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=gen)
    exact = moe(x, idx, weights)
    with torch_qmm.activation_quantization("int8"):
        int8 = moe(x, idx, weights)
    assert torch.equal(moe8(x, idx, weights), int8)  # the per-layer setting
    assert torch.equal(moe(x, idx, weights), exact)
    # Each token through its experts one at a time, by the dense int8 op.
    gu, dn = moe.gate_up_proj, moe.down_proj
    ref = torch.zeros(tokens, 128)
    for t in range(tokens):
        for j in range(2):
            e = int(idx[t, j])
            h = ops.qmm_int8_activations(x[t:t + 1], gu.qweight[e], gu.scales[e], gu.biases[e], "affine", 4, 32)
            h = _Gate()(h)
            y = ops.qmm_int8_activations(h, dn.qweight[e], dn.scales[e], dn.biases[e], "affine", 8, 64)
            ref[t] += weights[t, j] * y[0]
    torch.testing.assert_close(int8, ref, rtol=1e-6, atol=1e-6)  # the weighted sum's order differs
    assert not torch.equal(int8, exact)
    assert (int8 - exact).norm() < 0.02 * exact.norm()


def test_switch_linear_setting_is_checked_and_shown():
    layer = QuantSwitchLinear(E, 64, 16, bits=4, group_size=32, activations="int8")
    assert "activations=int8" in repr(layer)
    assert "activations" not in repr(QuantSwitchLinear(E, 64, 16, bits=4, group_size=32))
    with pytest.raises(ValueError, match="argument 'activations' must be None for mode 'mxfp4'"):
        QuantSwitchLinear(E, 64, 16, mode="mxfp4", activations="int8")
    with pytest.raises(ValueError, match="argument 'activations'.*'int4'"):
        QuantSwitchLinear(E, 64, 16, activations="int4")
