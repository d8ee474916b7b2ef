"""QuantSwitchLinear against MLX (mx.quantize for the bits, mx.gather_qmm for the products), and
its argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_qmm

from torch_qmm.formats import FORMATS
from torch_qmm.nn_moe import QuantSwitchLinear, packed_bytes

mx = pytest.importorskip("mlx.core")

E, OUT, IN = 4, 48, 64
GROUP = {"affine": 32}
# float32: compared with mx.gather_qmm; both sides decode the same codes and accumulate K=64
# products in float32, in other orders: a few ulps of the largest |y| (bound 1e-5 relative).
# bfloat16: compared with float64 products of MLX's float32 decoding of the weights (MLX's own
# bfloat16 gather_qmm rounds inside the sum, 2e-2 off here); ours is that rounded once to
# bfloat16 after a float32 sum: within one bfloat16 ulp (2**-8 relative) of the largest, bound 2**-7.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
_MX = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def to_mx(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    return mx.array(t.numpy())


def to_torch(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def mlx_quantized(w: torch.Tensor, mode: str):
    parts = mx.quantize(to_mx(w), group_size=GROUP.get(mode, FORMATS[mode].default_group_size),
                        bits=FORMATS[mode].default_bits, mode=mode)
    return [to_torch(p) for p in parts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", list(FORMATS))
@pytest.mark.parametrize("tokens", [3, 40])  # 40 x 2 pairs: the sorted path of the caller
def test_switch_linear_matches_mx_gather_qmm(mode, dtype, tokens):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(E, OUT, IN, generator=g) / 8).to(dtype)
    # with a bias, a bfloat16 output is rounded twice (the product, then the sum): float32 only
    bias = torch.randn(E, OUT, generator=g) if dtype == torch.float32 else None
    parts = mlx_quantized(w, mode)
    layer = QuantSwitchLinear.from_quantized(*parts[:2], parts[2] if len(parts) > 2 else None, bias=bias,
                                             group_size=GROUP.get(mode), mode=mode, dtype=dtype)
    x = torch.randn(tokens, 1, 1, IN, generator=g).to(dtype)
    idx = torch.rand(tokens, E, generator=g).argsort(-1)[:, :2]
    mx_parts = [to_mx(p) if p.dtype == torch.bfloat16 else mx.array(p.numpy()) for p in parts]
    if dtype == torch.float32:
        want = mx.gather_qmm(to_mx(x), *mx_parts, rhs_indices=mx.array(idx.numpy().astype(np.uint32)),
                             transpose=True, group_size=layer.group_size, bits=layer.bits, mode=mode)
        want = to_torch(want) + bias[idx].unsqueeze(-2)
    else:
        w_mlx = to_torch(mx.dequantize(*mx_parts[:2], mx_parts[2] if len(mx_parts) > 2 else None,
                                       group_size=layer.group_size, bits=layer.bits, mode=mode, dtype=mx.float32))
        want = (x.double() @ w_mlx.double()[idx].transpose(-1, -2)).float()
    got = layer(x, idx)
    assert got.shape == (tokens, 2, 1, OUT) and got.dtype == dtype
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < RTOL[dtype], f"{mode} {dtype}: {err:.3g}"
    # the pairs sorted by expert (sorted_indices), as QuantFusedExperts hands them over
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    xs = x.reshape(-1, 1, IN)[order // 2]
    ys = layer(xs, flat[order], sorted_indices=True)
    assert torch.equal(ys.reshape(-1, OUT), got.reshape(-1, OUT)[order])


@pytest.mark.parametrize("mode", list(FORMATS))
def test_from_float_holds_mlx_quantize_bits(mode):
    w = torch.randn(E, OUT, IN, generator=torch.Generator().manual_seed(1))
    layer = QuantSwitchLinear.from_float(w, group_size=GROUP.get(mode), mode=mode)
    parts = mlx_quantized(w, mode)
    for ours, theirs in zip((layer.qweight, layer.scales, layer.biases), parts):
        assert torch.equal(ours, theirs)
    assert packed_bytes(layer) == sum(p.numel() * p.element_size() for p in parts)


def test_argument_errors():
    with pytest.raises(ValueError, match=r"argument 'weight' must be a float tensor \[num_experts, out, in\], got "
                                         r"torch.float32 \[48, 64\]"):
        QuantSwitchLinear.from_float(torch.zeros(OUT, IN))
    with pytest.raises(ValueError, match="argument 'in_features' must be a multiple of group_size=64, got 48"):
        QuantSwitchLinear(E, 48, OUT)
    with pytest.raises(ValueError, match="argument 'num_experts' must be a positive int, got 0"):
        QuantSwitchLinear(0, IN, OUT)
    parts = mlx_quantized(torch.randn(E, OUT, IN), "affine")
    with pytest.raises(ValueError, match=r"argument 'scales' must have shape \[4, 48, 2\]"):
        QuantSwitchLinear.from_quantized(parts[0], parts[1][:, :, :1], parts[2], group_size=32)
    with pytest.raises(ValueError, match="argument 'biases': mode 'affine' has biases, got None"):
        QuantSwitchLinear.from_quantized(parts[0], parts[1], None, group_size=32)


def test_state_of_another_format_is_refused():
    a = QuantSwitchLinear(E, IN, OUT, bits=8, group_size=32)
    b = QuantSwitchLinear(E, IN * 2, OUT, bits=4, group_size=64)  # the same buffer shapes
    assert a.qweight.shape == b.qweight.shape and a.scales.shape == b.scales.shape
    with pytest.raises(ValueError, match="the state holds bits=8, group_size=32"):
        b.load_state_dict(a.state_dict())


def test_bias_takes_indices_of_every_accepted_dtype():
    # gather_qmm takes int32, int64 and uint32 (MLX's) indices; the bias rows must follow the same ones
    g = torch.Generator().manual_seed(3)
    layer = QuantSwitchLinear.from_float(torch.randn(E, OUT, IN, generator=g), torch.randn(E, OUT, generator=g),
                                         group_size=32)
    x = torch.randn(5, 1, 1, IN, generator=g)
    idx = torch.randint(0, E, (5, 2), generator=g)
    want = layer(x, idx)
    for dtype in (torch.int32, torch.uint32):
        torch.testing.assert_close(layer(x, idx.to(dtype)), want, rtol=0, atol=0)


def test_from_quantized_takes_its_compute_dtype_from_the_tensors():
    # dtype None: the float scales' (affine), else the bias' (fp modes), else float32.
    w = torch.randn(2, 8, 64)
    q, s, b = torch_qmm.quantize(w.bfloat16(), group_size=32, bits=4)
    layer = QuantSwitchLinear.from_quantized(q, s, b, group_size=32, bits=4)
    assert (layer.scales.dtype, layer.biases.dtype) == (torch.bfloat16, torch.bfloat16)
    assert torch.equal(layer.scales, s) and torch.equal(layer.biases, b)
    layer = QuantSwitchLinear.from_quantized(q, s, b, bias=torch.ones(2, 8).half(), group_size=32, bits=4)
    assert layer.bias.dtype == torch.bfloat16  # the scales' dtype wins over the bias'
    q, s = torch_qmm.quantize(w, mode="mxfp4")
    bias = torch.randn(2, 8).half()
    layer = QuantSwitchLinear.from_quantized(q, s, bias=bias, mode="mxfp4")
    assert layer.bias.dtype == torch.float16 and torch.equal(layer.bias, bias) and torch.equal(layer.scales, s)
    assert QuantSwitchLinear.from_quantized(q, s, mode="mxfp4").extra_repr().endswith("mode=mxfp4")  # no float buffer
    layer = QuantSwitchLinear.from_quantized(q, s, bias=bias, mode="mxfp4", dtype=torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
