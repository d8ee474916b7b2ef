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
