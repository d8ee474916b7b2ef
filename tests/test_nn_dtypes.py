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
