"""QuantLinear and quantize_model behave as a user of nn.Linear expects."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from safetensors.torch import load, save
from torch import nn

import torch_qmm
from torch_qmm import reference
from torch_qmm.formats import FORMATS
from torch_qmm.nn import QuantLinear

from tolerance import assert_matches_reference
from torch_qmm.tolerance import OUT_ATOL, OUT_RTOL, error_bound


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quant_linear_matches_reference(device, bias, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(256, 72, bias=bias).to(dtype)
    q = QuantLinear.from_linear(linear, bits=4, group_size=64).to(device)
    x = torch.randn(3, 5, 256).to(dtype)
    y = q(x.to(device))
    packed = (q.qweight.cpu(), q.scales.cpu(), q.biases.cpu(), 4, 64)
    y_ref = reference.qmm(x, *packed)
    magnitude = reference.qmm_magnitude(x, *packed)
    if not bias:
        assert_matches_reference(y.cpu(), y_ref, magnitude, dtype, "QuantLinear")
        return
    # The bias is added in the output dtype after the matmul (as nn.Linear does): the matmul's
    # bound, carried through one more rounding of the sum (half an ulp of it).
    y_sum = y_ref + linear.bias.double()
    u = OUT_RTOL[dtype]
    bound = (1 + u) * error_bound(y_ref, magnitude, dtype) + u * y_sum.abs() + OUT_ATOL[dtype]
    ratio = ((y.cpu().double() - y_sum).abs() / bound).max().item()
    assert ratio <= 1.0, f"QuantLinear with bias: worst ratio {ratio:.2f} to the two-rounding bound"


def test_quant_linear_error_is_small_against_float_layer():
    torch.manual_seed(0)
    linear = nn.Linear(512, 128)
    x = torch.randn(4, 512)
    for bits, max_rel in [(8, 0.01), (4, 0.15), (2, 0.8)]:
        q = QuantLinear.from_linear(linear, bits=bits, group_size=32)
        rel = ((q(x) - linear(x)).norm() / linear(x).norm()).item()
        assert rel < max_rel, f"{bits}-bit relative error {rel:.3f}"


def test_extra_repr_names_the_format():
    q = QuantLinear(128, 32, bias=False, bits=3, group_size=32)
    text = repr(q)
    for part in ("in_features=128", "out_features=32", "bias=False", "group_size=32", "bits=3"):
        assert part in text


def test_state_dict_round_trips_through_safetensors():
    torch.manual_seed(1)
    q = QuantLinear.from_linear(nn.Linear(128, 40), bits=5, group_size=32)
    blob = save(q.state_dict())
    fresh = QuantLinear(128, 40, bits=5, group_size=32)
    fresh.load_state_dict(load(blob))
    x = torch.randn(3, 128)
    assert torch.equal(fresh(x), q(x))
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    fresh2 = QuantLinear(128, 40, bits=5, group_size=32)
    fresh2.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(fresh2(x), q(x))


def test_to_dtype_converts_float_buffers_and_keeps_packed_words():
    q = QuantLinear.from_linear(nn.Linear(128, 16), bits=4, group_size=64)
    words = q.qweight.clone()
    q = q.to(torch.bfloat16)
    assert q.scales.dtype == q.biases.dtype == q.bias.dtype == torch.bfloat16
    assert q.qweight.dtype == torch.uint32 and torch.equal(q.qweight.view(torch.int32), words.view(torch.int32))
    y = q(torch.randn(2, 128, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_to_device_moves_every_tensor(device):
    q = QuantLinear.from_linear(nn.Linear(64, 8), bits=4, group_size=64).to(device)
    assert {t.device.type for t in [q.qweight, q.scales, q.biases, q.bias]} == {torch.device(device).type}


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(128, 256)
        self.body = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 100))
        self.odd = nn.Linear(100, 64)  # in_features not a multiple of 64: skipped

    def forward(self, x):
        return self.odd(self.body(self.inp(x)))


def test_quantize_model_swaps_eligible_linears_and_reports():
    torch.manual_seed(2)
    model = _Tiny()
    x = torch.randn(3, 128)
    y_float = model(x)
    with pytest.warns(UserWarning, match=r"skipped odd \(in_features=100 is not a multiple of group_size=64\)"):
        summary = torch_qmm.quantize_model(model, bits=8, group_size=64)
    assert summary.converted == ["inp", "body.0", "body.2"]
    assert list(summary.skipped) == ["odd"]
    assert isinstance(model.body[0], QuantLinear) and type(model.odd) is nn.Linear
    expected_before = sum(4 * (l.numel()) for l in [torch.empty(256 * 128 + 256), torch.empty(256 * 256 + 256), torch.empty(100 * 256 + 100)])
    assert summary.bytes_before == expected_before
    assert summary.bytes_after < summary.bytes_before / 3
    rel = ((model(x) - y_float).norm() / y_float.norm()).item()
    assert rel < 0.02


def test_quantize_model_respects_filter():
    model = _Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = torch_qmm.quantize_model(model, bits=4, group_size=64, filter_fn=lambda name, m: name.startswith("body"))
    assert summary.converted == ["body.0", "body.2"]
    assert type(model.inp) is nn.Linear


# ---- the fp modes (MLX's mxfp4, nvfp4, ...): buffers as mlx.core.quantize writes them ----------

FP_MODES = [m for m, f in FORMATS.items() if not f.has_biases]


def _other_fp_mode(mode: str) -> str:
    return FP_MODES[(FP_MODES.index(mode) + 1) % len(FP_MODES)]


def _mx_quantize(w: torch.Tensor, mode: str):
    """mlx.core.quantize of w (same dtype, bits for bits) as torch tensors."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    dtypes = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
    a = mx.array(w.float().numpy()).astype(dtypes[w.dtype])  # exact: w holds values of its dtype
    return [torch.from_numpy(np.array(t)) for t in mx.quantize(a, mode=mode)]


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp_quant_linear_holds_mlx_buffers_and_matches_reference(mode, dtype):
    from torch_qmm import reference_fp

    torch.manual_seed(3)
    linear = nn.Linear(256, 48).to(dtype)
    q = QuantLinear.from_linear(linear, mode=mode)
    spec = reference_fp.MODES[mode]
    assert (q.mode, q.bits, q.group_size) == (mode, spec.bits, spec.group_size)  # MLX's defaults
    assert q.biases is None and set(q.state_dict()) == {"qweight", "scales", "bias", "_extra_state"}
    wq, scales = _mx_quantize(linear.weight.detach(), mode)
    assert q.scales.dtype == torch.uint8 and torch.equal(q.scales, scales)
    assert torch.equal(q.qweight.view(torch.int32), wq.view(torch.int32))
    x = torch.randn(3, 256).to(dtype)
    ratio = _fp_layer_error_ratio(q, linear.bias, x, bias_rounded=False)
    assert ratio <= 1.0, f"{mode} QuantLinear: worst ratio {ratio:.2f} to the two-rounding bound"


def _fp_layer_error_ratio(q, bias, x, bias_rounded: bool) -> float:
    """The worst |q(x) - (W x + bias)| over its bound, W x from reference_fp in float64 (q's output
    must have x's dtype). The bias is added after the product: one more rounding to x's dtype (as in
    test_quant_linear_matches_reference), and one of the bias itself where it is wider than x
    (bias_rounded)."""
    from torch_qmm import reference_fp

    y = q(x)
    assert y.dtype == x.dtype
    args = (q.qweight, q.scales, q.mode)
    y_ref = reference_fp.qmm_fp(x, *args)
    magnitude = reference_fp.qmm_fp_magnitude(x, *args)
    y_sum = y_ref + bias.double()
    u = OUT_RTOL[x.dtype]
    rounding = u * y_sum.abs() + (u * bias.double().abs() if bias_rounded else 0)
    bound = (1 + u) * error_bound(y_ref, magnitude, x.dtype) + rounding + OUT_ATOL[x.dtype]
    return ((y.double() - y_sum).abs() / bound).max().item()


FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("layer_dtype, dtype", [(a, b) for a in FLOATS for b in FLOATS if a != b],
                         ids=lambda d: str(d)[6:])
def test_fp_quant_linear_with_a_bias_of_another_dtype_returns_x_dtype(mode, layer_dtype, dtype):
    # A layer (its bias) of one float dtype given x of another: the fp modes take any float x and
    # the output has x's dtype, the bias included (rounded to it, then the sum rounded once more).
    torch.manual_seed(5)
    linear = nn.Linear(256, 40).to(layer_dtype)
    q = QuantLinear.from_linear(linear, mode=mode)
    assert q.bias.dtype == layer_dtype
    ratio = _fp_layer_error_ratio(q, linear.bias, torch.randn(3, 256).to(dtype), bias_rounded=True)
    assert ratio <= 1.0, f"{mode} QuantLinear ({layer_dtype}), {dtype} x: worst ratio {ratio:.2f} to the bound"


@pytest.mark.parametrize("mode", FP_MODES)
def test_fp_state_round_trips_and_other_modes_are_refused(mode):
    torch.manual_seed(4)
    q = QuantLinear.from_linear(nn.Linear(128, 16), mode=mode)
    state = load(save(q.state_dict()))
    fresh = QuantLinear(128, 16, mode=mode)
    fresh.load_state_dict(state)
    x = torch.randn(2, 128)
    assert torch.equal(fresh(x), q(x))
    # Another format: refused before anything is copied, naming both modes.
    affine = QuantLinear(128, 16, bits=4, group_size=32)
    before = {k: v.clone() for k, v in affine.state_dict().items()}
    with pytest.raises(ValueError, match=rf"holds bits={q.bits}, group_size={q.group_size}, mode={mode}, this layer "
                                         rf"has bits=4, group_size=32, mode=affine"):
        affine.load_state_dict({**state, "biases": affine.biases}, strict=False)
    assert all(torch.equal(before[k], v) for k, v in affine.state_dict().items())
    other = _other_fp_mode(mode)
    with pytest.raises(ValueError, match=rf"mode={mode}, this layer has .*mode={other}"):
        QuantLinear(128, 16, mode=other).load_state_dict(state)
    with pytest.raises(ValueError, match=rf"holds bits={q.bits}, group_size=\d+, mode=\[1, 2, 3"):
        fresh.load_state_dict({**state, "_extra_state": torch.tensor([q.bits, q.group_size, 1, 2, 3, 4, 5, 6, 7, 8])})


def test_affine_state_keeps_its_two_values():
    # What torch_qmm has always written for the affine format: files of older versions still load.
    assert QuantLinear(64, 8, bits=3, group_size=32).state_dict()["_extra_state"].tolist() == [3, 32]


def test_format_arguments_are_checked_per_mode():
    with pytest.raises(ValueError, match=r"argument 'bits' must be 4, got 8 \(mode 'mxfp4'\)"):
        QuantLinear(64, 8, bits=8, mode="mxfp4")
    with pytest.raises(ValueError, match=r"argument 'group_size' must be 16, got 32 \(mode 'nvfp4'\)"):
        QuantLinear(64, 8, group_size=32, mode="nvfp4")
    with pytest.raises(ValueError, match=r"argument 'mode' must be one of 'affine', 'mxfp4', 'nvfp4'.*got 'int4'"):
        QuantLinear(64, 8, mode="int4")
    with pytest.raises(ValueError, match=r"argument 'in_features' must be a multiple of group_size=32, got 48"):
        QuantLinear(48, 8, mode="mxfp4")


@pytest.mark.parametrize("mode", FP_MODES)
def test_quantize_model_in_an_fp_mode(mode):
    torch.manual_seed(5)
    model = _Tiny()
    x = torch.randn(3, 128)
    y_float = model(x)
    with pytest.warns(UserWarning, match=r"skipped odd \(in_features=100 is not a multiple of group_size="):
        summary = torch_qmm.quantize_model(model, mode=mode)
    assert summary.converted == ["inp", "body.0", "body.2"]
    assert all(m.mode == mode and m.biases is None for m in (model.inp, model.body[0], model.body[2]))
    q = model.inp
    # codes and one byte per group instead of 32 bits (the float biases come on top)
    assert summary.bytes_after < summary.bytes_before * ((q.bits + 8 / q.group_size) / 32 + 0.02)
    rel = ((model(x) - y_float).norm() / y_float.norm()).item()
    assert rel < 0.2, f"{mode}: relative error {rel:.3f}"
    again = torch_qmm.quantize_model(model, mode=mode, filter_fn=lambda n, _: n != "odd")
    assert again.already_quantized == ["inp", "body.0", "body.2"] and not again.converted
    with pytest.raises(ValueError, match=rf"mode='affine'\): the model already holds .*inp \(bits={q.bits}, "
                                         rf"group_size=\d+, mode={mode}\)"):
        torch_qmm.quantize_model(model, bits=4, group_size=32, filter_fn=lambda n, _: n != "odd")
    with pytest.raises(ValueError, match=rf"mode='{mode}' is quantized by rtn"):
        torch_qmm.quantize_model(_Tiny(), mode=mode, method="mse")


def test_every_quantized_module_names_its_format_and_compute_dtype():
    from torch_qmm.interop.modules import GGUFLinear, QuantEmbedding, TiedQuantLinear
    from torch_qmm.nn_moe import QuantSwitchLinear

    emb = QuantEmbedding(10, 64, mode="mxfp4", dtype=torch.bfloat16)
    cases = [
        (QuantLinear(128, 8, bits=3, group_size=32, dtype=torch.float16),
         "in_features=128, out_features=8, bias=True, group_size=32, bits=3, mode=affine, dtype=torch.float16"),
        (QuantLinear(64, 8, mode="mxfp4", dtype=torch.bfloat16),  # fp modes: the bias carries the compute dtype
         "in_features=64, out_features=8, bias=True, group_size=32, bits=4, mode=mxfp4, dtype=torch.bfloat16"),
        (QuantSwitchLinear(3, 64, 8, bias=True, mode="nvfp4", dtype=torch.float16),
         "num_experts=3, in_features=64, out_features=8, bias=True, group_size=16, bits=4, mode=nvfp4, "
         "dtype=torch.float16"),
        (QuantSwitchLinear(3, 64, 8, bits=8, group_size=32).to(torch.bfloat16),
         "num_experts=3, in_features=64, out_features=8, bias=False, group_size=32, bits=8, mode=affine, "
         "dtype=torch.bfloat16"),
        (emb, "10, 64, group_size=32, bits=4, mode=mxfp4, dtype=torch.bfloat16"),
        (TiedQuantLinear(emb), "tied to QuantEmbedding(10, 64, group_size=32, bits=4, mode=mxfp4, dtype=torch.bfloat16)"),
        (QuantEmbedding(12, 128, bits=6, group_size=128).to(torch.float16),
         "12, 128, group_size=128, bits=6, mode=affine, dtype=torch.float16"),
        (GGUFLinear(256, 4, 14, bias=True), "in_features=256, out_features=4, format=Q6_K, bias=True"),
    ]
    for module, text in cases:
        assert module.extra_repr() == text


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_quantized_modules_pickle_and_copy_with_their_uint32_words(mode):
    """pickle.dumps / loads (and copy.copy / deepcopy) of each module holding packed words: the same
    buffers, bit for bit and in their dtypes, and the same outputs. torch cannot unpickle a uint32
    tensor by itself, so the modules pickle it as a view of the same bits."""
    import copy
    import pickle

    from torch_qmm.interop import QuantEmbedding
    from torch_qmm.nn_moe import QuantSwitchLinear

    torch.manual_seed(0)
    linear = QuantLinear.from_linear(nn.Linear(64, 16), mode=mode)
    emb = QuantEmbedding.from_embedding(nn.Embedding(10, 64), mode=mode)
    switch = QuantSwitchLinear.from_float(torch.randn(3, 16, 64), bias=torch.randn(3, 16), mode=mode)
    model = nn.ModuleDict({"linear": linear, "emb": emb, "switch": switch})
    x, ids, experts = torch.randn(2, 64), torch.tensor([[0, 9], [4, 4]]), torch.tensor([2, 0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), copy.copy(model)):
        after = again.state_dict()
        assert after.keys() == before.keys()
        for k, v in before.items():
            assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
        assert torch.equal(again["linear"](x), linear(x))
        assert torch.equal(again["emb"](ids), emb(ids))
        assert torch.equal(again["switch"](x[:, None], experts), switch(x[:, None], experts))
    for k, v in model.state_dict().items():  # the original is untouched
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


def test_quantize_model_of_float64_weights_names_the_layers_before_changing_anything():
    """float64 weights (no dtype= given): a TypeError naming each such layer and its dtype, with
    the model left as it was (the layers before it were converted, then a message about an
    argument 'dtype' the caller never passed)."""
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32).double(), nn.Linear(32, 8).double())
    with pytest.raises(TypeError, match=r"quantize_model: .*1 \(torch.float64\), 2 \(torch.float64\)\. Pass dtype="):
        torch_qmm.quantize_model(model, bits=4, group_size=32)
    assert [type(m) for m in model] == [nn.Linear] * 3
    with pytest.raises(TypeError, match=r"argument 'dtype' must be one of .* got torch.float64"):
        torch_qmm.quantize_model(model, bits=4, group_size=32, dtype=torch.float64)
    assert [type(m) for m in model] == [nn.Linear] * 3
    # filter_fn leaving them out, or dtype= naming a supported dtype, converts
    torch_qmm.quantize_model(model, bits=4, group_size=32, filter_fn=lambda name, m: name == "0")
    assert [type(m) for m in model] == [QuantLinear, nn.Linear, nn.Linear]
    torch_qmm.quantize_model(model, bits=4, group_size=32, dtype=torch.float32)
    assert [type(m) for m in model] == [QuantLinear] * 3 and model[2].scales.dtype == torch.float32


@pytest.mark.parametrize("default, expected", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float64, torch.float32)], ids=str)
def test_modules_built_without_a_dtype_take_the_default_dtype_as_nn_linear_does(default, expected):
    # torch.set_default_dtype: nn.Linear's parameters follow it, and so do the quantized modules'
    # float tensors; float64, which the kernels do not take, gives float32.
    from torch_qmm.interop.modules import GGUFLinear, GGUFSwitchLinear, QuantEmbedding
    from torch_qmm.nn_moe import QuantSwitchLinear

    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        modules = [QuantLinear(64, 8, bits=4, group_size=32), QuantSwitchLinear(2, 64, 8, bits=4, group_size=32),
                   QuantEmbedding(8, 64, 4, 32)]
        assert [m.scales.dtype for m in modules] == [expected] * 3
        assert QuantLinear(64, 8, mode="mxfp4").bias.dtype == expected
        assert GGUFLinear(256, 4, 12, bias=True).bias.dtype == expected
        assert GGUFSwitchLinear(2, 256, 4, 12, bias=True).bias.dtype == expected
    finally:
        torch.set_default_dtype(before)
