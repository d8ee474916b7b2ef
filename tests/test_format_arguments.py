"""Arguments that only some formats accept, and the shapes and dtypes the fakes promise.

Each case is checked where the user meets it: the module refuses a combination when it is built
(not at its first call), the ops refuse a result dtype they do not produce, and the meta kernels
(what torch.compile traces with) give exactly the dtypes and shapes the CPU kernels return, for
every mode.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm.nn import QuantLinear
from torch_qmm.formats import FORMATS

FP_MODES = [m for m in FORMATS if m != "affine"]


@pytest.mark.parametrize("mode", FP_MODES)
def test_int8_activations_with_an_fp_mode_are_refused_when_the_layer_is_built(mode):
    with pytest.raises(ValueError, match=r"argument 'activations'.*" + mode):
        QuantLinear(64, 16, mode=mode, activations="int8")


def test_int8_activations_with_affine_are_accepted():
    layer = QuantLinear(64, 16, bits=4, group_size=32, activations="int8")
    assert layer.activations == "int8"


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("mode", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8])
def test_dequantize_refuses_a_result_dtype_it_does_not_produce(mode, dtype, device):
    w = torch.randn(8, 64)
    q = torch_qmm.quantize(w, mode=mode)
    q = [t.to(device) for t in q]
    wq, scales = q[0], q[1]
    biases = q[2] if len(q) == 3 else None
    with pytest.raises(TypeError, match=r"argument 'dtype' must be float32, float16 or bfloat16"):
        torch_qmm.dequantize(wq, scales, biases, mode=mode, dtype=dtype)


@pytest.mark.parametrize("mode", list(FORMATS))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fake_quantize_gives_the_real_dtypes_and_shapes(mode, wdtype):
    w = torch.randn(2, 8, 128).to(wdtype)
    real = torch_qmm.quantize(w, mode=mode)
    fake = torch_qmm.quantize(w.to("meta"), mode=mode)
    assert len(fake) == len(real) == (3 if mode == "affine" else 2)
    for r, f in zip(real, fake):
        assert f.device.type == "meta"
        assert (f.dtype, tuple(f.shape)) == (r.dtype, tuple(r.shape))
    # The scales' dtype mlx.core.quantize returns for the same mode and input dtype.
    mx_dtype = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[wdtype]
    mx_scales = mx.quantize(mx.array(np.zeros((8, 128), np.float32)).astype(mx_dtype), mode=mode)[1]
    assert str(real[1].dtype).split(".")[-1] == str(mx_scales.dtype).split(".")[-1]


@pytest.mark.parametrize("mode", list(FORMATS))
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16, torch.bfloat16])
def test_fake_dequantize_gives_the_real_dtype_and_shape(mode, dtype):
    w = torch.randn(8, 128, dtype=torch.float16)
    q = torch_qmm.quantize(w, mode=mode)
    biases = q[2] if len(q) == 3 else None
    real = torch_qmm.dequantize(q[0], q[1], biases, mode=mode, dtype=dtype)
    meta = [t.to("meta") for t in q]
    fake = torch_qmm.dequantize(meta[0], meta[1], meta[2] if len(q) == 3 else None, mode=mode, dtype=dtype)
    assert (fake.dtype, tuple(fake.shape)) == (real.dtype, tuple(real.shape))
    if dtype is None:  # the default result dtype is mlx.core.dequantize's
        mq = mx.quantize(mx.array(w.float().numpy()).astype(mx.float16), mode=mode)
        mx_out = mx.dequantize(*mq, mode=mode)
        assert str(real.dtype).split(".")[-1] == str(mx_out.dtype).split(".")[-1]
    else:
        assert real.dtype == dtype
