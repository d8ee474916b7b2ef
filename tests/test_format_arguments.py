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


# ---- error paths of the MoE and GGUF constructors -----------------------------------------------

from torch_qmm.interop.gguf import q4_k_to_affine  # noqa: E402
from torch_qmm.nn_moe import QuantFusedExperts  # noqa: E402


def _switch_parts():
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(5))
    return torch_qmm.quantize(w, group_size=32, bits=4)


@pytest.mark.parametrize("make, message", [
    (lambda: QuantSwitchLinear.from_float(torch.randn(8, 64)), r"argument 'weight' must be a float tensor "
                                                               r"\[num_experts, out, in\], got torch.float32 \[8, 64\]"),
    (lambda: QuantSwitchLinear.from_float(torch.ones(2, 8, 64, dtype=torch.int32)), r"argument 'weight' must be a float"),
    (lambda: QuantSwitchLinear.from_float(torch.randn(2, 8, 64), torch.zeros(2, 7)),
     r"argument 'bias' must have shape \[2, 8\], got \[2, 7\]"),
    (lambda: QuantSwitchLinear.from_quantized(_switch_parts()[0].view(torch.int32), *_switch_parts()[1:],
                                              bits=4, group_size=32),
     r"argument 'qweight' must be a uint32 tensor \[num_experts, out, in\*bits/32\], got torch.int32"),
    (lambda: QuantSwitchLinear.from_quantized(_switch_parts()[0], _switch_parts()[1][:, :, :1], _switch_parts()[2],
                                              bits=4, group_size=32),
     r"argument 'scales' must have shape \[2, 8, 2\] \(num_experts=2, out=8, in=64, bits=4, group_size=32\), "
     r"got \[2, 8, 1\]"),
    (lambda: QuantSwitchLinear.from_quantized(*_switch_parts()[:2], None, bits=4, group_size=32),
     r"argument 'biases': mode 'affine' has biases, got None"),
    (lambda: QuantSwitchLinear.from_quantized(*_switch_parts(), bias=torch.zeros(2, 9), bits=4, group_size=32),
     r"argument 'bias' must have shape \[2, 8\], got \[2, 9\]"),
    (lambda: QuantSwitchLinear.from_quantized(*_switch_parts(), bias=torch.zeros(8), bits=4, group_size=32),
     r"argument 'bias' must have shape \[2, 8\], got \[8\]"),  # (copy_ would broadcast it to every expert)
    (lambda: QuantSwitchLinear.from_quantized(*torch_qmm.quantize(torch.randn(2, 8, 64), mode="mxfp4"),
                                              torch.zeros(2, 8, 2), mode="mxfp4"),
     r"argument 'biases': mode 'mxfp4' has no biases, got a tensor"),
], ids=["weight-2d", "weight-int", "bias-shape", "qweight-int32", "scales-shape", "biases-missing", "bias-shape-q",
        "bias-of-one-expert-q", "biases-for-fp"])
def test_switch_linear_constructors_name_the_bad_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_fused_experts_refuse_projections_that_do_not_chain():
    gate_up = QuantSwitchLinear(2, 64, 2 * 32, group_size=32)
    for down in (QuantSwitchLinear(3, 32, 64, group_size=32), QuantSwitchLinear(2, 64, 64, group_size=32),
                 QuantSwitchLinear(2, 32, 32, group_size=32)):
        with pytest.raises(ValueError, match=r"QuantFusedExperts: gate_up_proj \[E=2, 64, 64\] and down_proj "
                                             r"\[E=\d, \d+, \d+\] must be \[E, 2I, H\] and \[E, H, I\]"):
            QuantFusedExperts(gate_up, down, torch.nn.SiLU())


@pytest.mark.parametrize("blocks, N, K, message", [
    (np.zeros((2, 144), np.int8), 2, 256, r"q4_k_to_affine: blocks must be uint8, got int8"),
    (torch.zeros(2, 144, dtype=torch.int16), 2, 256, r"q4_k_to_affine: blocks must be uint8, got torch.int16"),
    (np.zeros((2, 144), np.uint8), 2, 128, r"need N >= 1 and K a positive multiple of 256 .*got N=2, K=128"),
    (np.zeros((0, 144), np.uint8), 0, 256, r"need N >= 1 .*got N=0, K=256"),
    (np.zeros((2, 144), np.uint8), 2, 512, r"blocks must be uint8 \[N, K/256 \* 144\] = \[2, 288\] for N=2, K=512, "
                                           r"got shape \[2, 144\]"),
], ids=["numpy-int8", "torch-int16", "K-128", "N-0", "shape"])
def test_q4_k_to_affine_names_what_is_wrong(blocks, N, K, message):
    with pytest.raises(ValueError, match=message):
        q4_k_to_affine(blocks, N, K)


@pytest.mark.parametrize("blocks, N, K, ggml_type, message", [
    (np.zeros((2, 176), np.uint16), 2, 256, 13, r"k_quant_to_affine: blocks must be uint8, got uint16"),
    (np.zeros((2, 176), np.uint8), 2, 512, 13, r"k_quant_to_affine: blocks must be uint8 \[N, K/256 \* 176\] = \[2, 352\] "
                                               r"for N=2, K=512, got shape \[2, 176\]"),
    (np.zeros((2, 210), np.uint8), 2, 256, 14, r"k_quant_to_affine: argument 'ggml_type' must be 12 \(Q4_K\), 13 "
                                               r"\(Q5_K\) or 23 \(IQ4_XS\), got 14"),
    (np.zeros((2, 176), np.uint8), 2, 256, "Q5_K", r"argument 'ggml_type' must be 12 \(Q4_K\), 13 \(Q5_K\) or 23 "
                                                   r"\(IQ4_XS\), got 'Q5_K'"),
], ids=["dtype", "shape", "Q6_K", "str"])
def test_k_quant_to_affine_names_what_is_wrong(blocks, N, K, ggml_type, message):
    from torch_qmm.interop.gguf import k_quant_to_affine

    with pytest.raises(ValueError, match=message):
        k_quant_to_affine(blocks, N, K, ggml_type)


def test_q4_k_to_affine_refuses_non_finite_and_overflowing_scales():
    block = np.zeros((1, 144), np.uint8)
    block[0, 0:2] = np.array([np.inf], "<f2").view(np.uint8)
    block[0, 4] = 1
    with pytest.raises(ValueError, match=r"non-finite float16 d/dmin"):
        q4_k_to_affine(block, 1, 256)
    block[0, 0:2] = np.array([60000.0], "<f2").view(np.uint8)  # d * 63 overflows float16, not float32
    block[0, 4] = 63
    assert torch.isfinite(q4_k_to_affine(block, 1, 256)[1]).all()
    with pytest.raises(ValueError, match=r"scales/biases overflow torch.float16; use dtype=torch.float32"):
        q4_k_to_affine(block, 1, 256, dtype=torch.float16)


def test_gguf_linear_refuses_a_type_it_does_not_run():
    with pytest.raises(ValueError, match=r"argument 'ggml_type' must be one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\), "
                                         r"16 \(IQ2_XXS\), .*, 23 \(IQ4_XS\), 29 \(IQ1_M\), got 8 \(Q8_0\)"):
        GGUFLinear(256, 4, 8)
    with pytest.raises(ValueError, match=r"argument 'in_features' must be a multiple of 256, got 320"):
        GGUFLinear(320, 4, 14)


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_switch_linear_from_quantized_refuses_scales_of_the_other_kind(mode):
    from torch_qmm.nn_moe import QuantSwitchLinear

    w = torch.randn(2, 8, 64)
    parts = torch_qmm.quantize(w.reshape(16, 64), group_size=32, bits=4, mode=mode)
    qweight, scales = parts[0].reshape(2, 8, -1), parts[1].reshape(2, 8, -1)
    biases = parts[2].reshape(2, 8, -1) if mode == "affine" else None
    # the same values in the other kind: uint8 for affine's float scales, float32 for e8m0 bytes
    wrong = scales.to(torch.uint8) if scales.is_floating_point() else scales.to(torch.float32)
    with pytest.raises(ValueError, match="'scales'"):
        QuantSwitchLinear.from_quantized(qweight, wrong, biases, bits=4, group_size=32, mode=mode)
    module = QuantSwitchLinear.from_quantized(qweight, scales, biases, bits=4, group_size=32, mode=mode)
    assert torch.equal(module.scales, scales)


def test_biases_on_another_device_than_the_weights_are_refused():
    w = torch.randn(16, 64)
    wq, scales, biases = torch_qmm.quantize(w, group_size=32, bits=4)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="device"):
        torch_qmm.quantized_matmul(x, wq, scales, biases.to("meta"), group_size=32, bits=4)


@pytest.mark.parametrize("mode", FP_MODES)
def test_fp_scales_on_another_device_than_the_weights_are_refused(mode):
    # The fp modes have no biases: wq and scales alone must share a device.
    wq, scales = torch_qmm.quantize(torch.randn(16, 64), mode=mode)
    for op, args in [(torch_qmm.quantized_matmul, (torch.randn(2, 64), wq, scales.to("meta"))),
                     (torch_qmm.dequantize, (wq, scales.to("meta")))]:
        with pytest.raises(ValueError, match=r"'wq' and 'scales' must be on one device, got cpu, meta"):
            op(*args, mode=mode)


@pytest.mark.parametrize("which", ["lhs_indices", "rhs_indices"])
def test_gather_indices_on_another_device_than_x_are_refused(which):
    wq, scales, biases = torch_qmm.quantize(torch.randn(3, 16, 64), group_size=32, bits=4)
    x = torch.randn(3, 1, 64)
    idx = {which: torch.tensor([0, 2, 1], device="meta")}
    with pytest.raises(ValueError, match=rf"gather_qmm: argument '{which}' is on meta but 'x' is on cpu"):
        torch_qmm.gather_qmm(x, wq, scales, biases, group_size=32, bits=4, **idx)


def test_quantize_refuses_rows_too_long_to_pack():
    # K * 8 must fit in int64 (checked before anything is allocated; an expanded meta tensor holds
    # no data). 2^60 is just past the limit, 2^60 - 64 the largest multiple of 64 within it.
    def rows(k):
        return torch.empty(1, 1, device="meta").expand(1, k)

    with pytest.raises(ValueError, match=rf"quantize: the last dimension of 'w' \(K={2**60}\) is too "
                                         r"large to pack: K\*bits must fit in int64"):
        torch_qmm.quantize(rows(2**60), group_size=64, bits=4)
    wq, _, _ = torch_qmm.quantize(rows(2**60 - 64), group_size=64, bits=4)
    assert wq.shape == (1, (2**60 - 64) // 8)
