"""QuantLinear's compute dtype (torch_qmm/nn.py): refused when not float32/float16/bfloat16;
from_linear quantizes the weight cast to the compute dtype, as mlx.nn.QuantizedLinear does with a
layer of that dtype (the expected codes, scales and biases come from mlx.core.quantize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from torch_qmm.nn import QuantLinear

mx = pytest.importorskip("mlx.core")


def test_float64_compute_dtype_refused():
    with pytest.raises(TypeError, match="argument 'dtype'"):
        QuantLinear(64, 8, dtype=torch.float64)


@pytest.mark.parametrize("dtype, mx_dtype", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
def test_from_linear_quantizes_the_weight_in_the_compute_dtype(dtype, mx_dtype):
    torch.manual_seed(0)
    linear = nn.Linear(128, 16)  # float32
    q = QuantLinear.from_linear(linear, bits=4, group_size=64, dtype=dtype)
    w = mx.array(linear.weight.detach().numpy()).astype(getattr(mx, mx_dtype))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    assert np.array_equal(np.array(wq).view(np.uint32), q.qweight.numpy())
    assert torch.equal(q.scales.float(), torch.from_numpy(np.array(scales.astype(mx.float32))))
    assert torch.equal(q.biases.float(), torch.from_numpy(np.array(biases.astype(mx.float32))))
    assert q.scales.dtype == dtype and q.bias.dtype == dtype


def test_from_linear_keeps_the_layer_dtype():
    linear = nn.Linear(64, 8).to(torch.float16)
    q = QuantLinear.from_linear(linear)
    assert q.scales.dtype == torch.float16 and q.bias.dtype == torch.float16


def _mlx_quantize(w: torch.Tensor, dtype: torch.dtype, group_size: int, bits: int):
    """mlx.core.quantize of w cast to dtype, as torch tensors (scales and biases in float32)."""
    m = mx.array(w.detach().float().numpy()).astype({torch.float32: mx.float32, torch.float16: mx.float16,
                                                    torch.bfloat16: mx.bfloat16}[dtype])
    wq, s, b = mx.quantize(m, group_size=group_size, bits=bits)
    return (torch.from_numpy(np.array(wq).view(np.uint32)), torch.from_numpy(np.array(s.astype(mx.float32))),
            torch.from_numpy(np.array(b.astype(mx.float32))))


def _switch(weight, dtype):
    from torch_qmm.nn_moe import QuantSwitchLinear

    bias = torch.randn(weight.shape[:2], generator=torch.Generator().manual_seed(1)).to(weight.dtype)
    return QuantSwitchLinear.from_float(weight, bias=bias, bits=4, group_size=32, dtype=dtype), bias


def _embedding(weight, dtype):
    from torch_qmm.interop.modules import QuantEmbedding

    emb = nn.Embedding(*weight.shape).to(weight.dtype)
    with torch.no_grad():
        emb.weight.copy_(weight)
    return QuantEmbedding.from_embedding(emb, bits=4, group_size=32, dtype=dtype), None


def _linear(weight, dtype):
    lin = nn.Linear(weight.shape[1], weight.shape[0]).to(weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return QuantLinear.from_linear(lin, bits=4, group_size=32, dtype=dtype), lin.bias


@pytest.mark.parametrize("make", [_linear, _switch, _embedding], ids=["linear", "switch", "embedding"])
@pytest.mark.parametrize("weight_dtype, dtype", [(torch.float16, None), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_quantized_modules_from_float_take_the_compute_dtype(make, weight_dtype, dtype):
    # The compute dtype defaults to the weight's; the weight is quantized after the cast to it
    # (mlx.core.quantize of the cast weight), and a bias is kept in it.
    g = torch.Generator().manual_seed(0)
    shape = (3, 16, 64) if make is _switch else (16, 64)
    weight = (torch.randn(shape, generator=g) * 0.3).to(weight_dtype)
    module, bias = make(weight, dtype)
    want = dtype or weight_dtype
    assert module.scales.dtype == want and module.biases.dtype == want
    wq, s, b = _mlx_quantize(weight, want, 32, 4)
    assert torch.equal(module.qweight, wq)
    assert torch.equal(module.scales.float(), s) and torch.equal(module.biases.float(), b)
    if bias is not None:
        assert module.bias.dtype == want and torch.equal(module.bias, bias.detach().to(want))


# ---- torch.autocast: the modules that replace nn.Linear follow it as nn.Linear does ---------------

_U = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}  # unit roundoffs


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quant_linear_under_autocast_matches_nn_linear_under_autocast(dtype, autocast, mode):
    # The reference: nn.Linear holding the dequantized weight and the bias, under the same
    # autocast (it rounds x, W and the bias to the autocast dtype, sums in float32, rounds y).
    # QuantLinear rounds x the same way, keeps W as quantized (affine: computes in its scales'
    # dtype, a float32 layer exactly), and rounds y to its compute dtype, adds the bias there and
    # rounds to the autocast dtype. Each side rounds W (the reference), y and the bias addition at
    # most twice, each rounding costing at most the unit roundoff u of the wider-rounding dtype of
    # sum_k |x_k w_k| + |b|: a bound of 4u times that (plus float32 accumulation, far below).
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(256, 48).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 256, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(48, generator=g))
    q = QuantLinear.from_linear(lin, mode=mode)  # the mode's default bits and group size
    from torch_qmm.ops import dequantize

    ref = nn.Linear(256, 48)  # float32: autocast casts it
    with torch.no_grad():
        ref.weight.copy_(dequantize(q.qweight, q.scales, q.biases, group_size=q.group_size, bits=q.bits, mode=mode,
                                    dtype=torch.float32))
        ref.bias.copy_(q.bias.float())
    x = torch.randn(5, 256, generator=g)  # float32 activations, as a model's residual stream under autocast
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast):
        y, want = q(x), ref(x)
        assert q(x.to(autocast)).dtype == autocast
    assert y.dtype == want.dtype == autocast
    magnitude = (x.to(autocast).float().abs() @ ref.weight.abs().T) + ref.bias.abs()
    u = max(_U[autocast], _U[dtype])
    assert ((y.float() - want.float()).abs() <= 4 * u * magnitude).all()


def test_modules_replacing_linear_layers_follow_autocast_and_nothing_changes_outside():
    from torch_qmm.interop.modules import GGUFLinear, TiedQuantLinear
    from torch_qmm.nn_moe import QuantSwitchLinear

    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 32, 256, generator=g)
    switch = QuantSwitchLinear.from_float(w, bits=4, group_size=32, dtype=torch.float16)
    tied = TiedQuantLinear(_embedding(w[0], torch.float32)[0])
    gguf = GGUFLinear(256, 32, 12)  # Q4_K; zero blocks, any x dtype
    linear = QuantLinear.from_linear(nn.Linear(256, 32).to(torch.bfloat16))
    idx = torch.tensor([[0, 2], [1, 1]])
    x = torch.randn(2, 1, 256, generator=g)
    calls = {"switch": lambda m, x: m(x, idx), "tied": lambda m, x: m(x), "gguf": lambda m, x: m(x),
             "linear": lambda m, x: m(x)}
    modules = {"switch": switch, "tied": tied, "gguf": gguf, "linear": linear}
    with torch.no_grad():
        for name, m in modules.items():
            call = calls[name]
            compute = getattr(getattr(m, "embedding", m), "scales", None)
            compute = compute.dtype if compute is not None and compute.is_floating_point() else torch.float16
            with torch.autocast("cpu", dtype=torch.float16):
                y = call(m, x)
            assert y.dtype == torch.float16, name
            assert torch.equal(y, call(m, x.to(torch.float16).to(compute)).to(torch.float16)), name
            with torch.autocast("cpu", dtype=torch.float16, enabled=False):  # off: as without autocast
                if compute == torch.float32 or name == "gguf":
                    assert call(m, x).dtype == torch.float32, name
                else:
                    with pytest.raises(TypeError, match="must have the dtype of 'scales'"):
                        call(m, x)
