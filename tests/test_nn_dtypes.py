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
