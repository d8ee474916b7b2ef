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


# ---- Module construction and state loading --------------------------------------------------------

from torch_qmm.interop.modules import GGUFLinear, QuantEmbedding  # noqa: E402
from torch_qmm.nn_moe import QuantSwitchLinear  # noqa: E402


@pytest.mark.parametrize("kwargs, arg", [
    ({"in_features": 0}, "in_features"), ({"in_features": -64}, "in_features"),
    ({"in_features": 64.0}, "in_features"), ({"out_features": 0}, "out_features"),
    ({"out_features": -1}, "out_features"), ({"out_features": True}, "out_features"),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_quant_linear_refuses_sizes_that_are_not_positive_ints(kwargs, arg):
    args = {"in_features": 64, "out_features": 8, **kwargs}
    with pytest.raises(ValueError, match=rf"argument '{arg}' must be a positive int, got {kwargs[arg]!r}"):
        QuantLinear(args["in_features"], args["out_features"], group_size=32)


@pytest.mark.parametrize("make, arg", [
    (lambda: QuantEmbedding(0, 64, group_size=32), "num_embeddings"),
    (lambda: QuantEmbedding(16, -32, group_size=32), "embedding_dim"),
    (lambda: QuantSwitchLinear(2, 64, 0, group_size=32), "out_features"),
    (lambda: GGUFLinear(256, 0, 12), "out_features"),
    (lambda: GGUFLinear(0, 8, 12), "in_features"),
], ids=["embedding-num", "embedding-dim", "switch-out", "gguf-out", "gguf-in"])
def test_quantized_modules_refuse_sizes_that_are_not_positive_ints(make, arg):
    with pytest.raises(ValueError, match=rf"argument '{arg}' must be a positive int"):
        make()


@pytest.mark.parametrize("kwargs, message", [
    ({"bits": 4.0}, r"argument 'bits' must be an int, got 4\.0"),
    ({"group_size": "64"}, r"argument 'group_size' must be an int, got '64'"),
    ({"bits": 7}, r"argument 'bits' must be one of \(2, 3, 4, 5, 6, 8\), got 7 \(mode 'affine'\)"),
    ({"group_size": 16}, r"argument 'group_size' must be one of \(32, 64, 128\), got 16 \(mode 'affine'\)"),
    ({"mode": "mxfp4", "bits": 8}, r"argument 'bits' must be 4, got 8 \(mode 'mxfp4'\)"),
    ({"mode": "mxfp8", "group_size": 64}, r"argument 'group_size' must be 32, got 64 \(mode 'mxfp8'\)"),
    ({"activations": "int4"}, r"argument 'activations' must be None \(exact\) or one of \('int8',\), got 'int4'"),
    ({"mode": "nvfp4", "activations": "int8"}, r"argument 'activations' must be None for mode 'nvfp4'"),
    ({"dtype": torch.float64}, r"argument 'dtype' must be one of"),
    ({"dtype": torch.int8}, r"argument 'dtype' must be one of"),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_quant_linear_refuses_bad_combinations_when_built(kwargs, message):
    kind = TypeError if "dtype" in kwargs else ValueError
    with pytest.raises(kind, match=message):
        QuantLinear(128, 8, **kwargs)


def _state_cases():
    g = torch.Generator().manual_seed(3)
    linear = QuantLinear.from_linear(torch.nn.Linear(128, 8), bits=4, group_size=32)
    fp = QuantLinear.from_linear(torch.nn.Linear(128, 8), mode="mxfp4")
    switch = QuantSwitchLinear.from_float(torch.randn(3, 8, 64, generator=g), torch.randn(3, 8, generator=g),
                                          bits=3, group_size=32)
    emb = QuantEmbedding.from_embedding(torch.nn.Embedding(10, 64), bits=8, group_size=64)
    gguf = GGUFLinear(256, 4, 12, bias=True)
    return {
        "linear-qweight": (linear, "qweight", lambda t: t[:, :-1]),
        "linear-scales": (linear, "scales", lambda t: t[:4]),
        "linear-biases": (linear, "biases", lambda t: t.reshape(-1)),
        "linear-bias": (linear, "bias", lambda t: t[:7]),
        "mxfp4-scales": (fp, "scales", lambda t: t[:, :2]),
        "switch-qweight": (switch, "qweight", lambda t: t[:2]),
        "switch-bias": (switch, "bias", lambda t: t[0]),
        "embedding-scales": (emb, "scales", lambda t: torch.cat([t, t])),
        "gguf-blocks": (gguf, "blocks", lambda t: t[:, :100]),
    }


@pytest.mark.parametrize("case", sorted(_state_cases()))
def test_state_of_another_shape_is_refused_naming_the_key_and_both_shapes(case):
    module, key, cut = _state_cases()[case]
    state = dict(module.state_dict())
    own = list(state[key].shape)
    state[key] = cut(state[key])
    before = {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    want = (rf"{type(module).__name__} '{key}': expected shape \[{', '.join(map(str, own))}\] \(this layer, "
            rf".*\), got \[{', '.join(map(str, state[key].shape))}\]")
    for strict in (True, False):
        with pytest.raises(ValueError, match=want):
            module.load_state_dict(state, strict=strict)
    # refused before anything is copied
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def test_state_shapes_are_checked_under_a_prefix():
    model = torch.nn.Sequential(QuantLinear(64, 4, group_size=32))
    state = dict(model.state_dict())
    state["0.scales"] = state["0.scales"][:, :1]
    with pytest.raises(ValueError, match=r"QuantLinear '0\.scales': expected shape \[4, 2\] .*got \[4, 1\]"):
        model.load_state_dict(state)
