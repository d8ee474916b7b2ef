"""The format state of QuantLinear / QuantEmbedding (torch_qmm/format_state.py): a mode name is
stored as its ASCII codes, zero-padded to 8; a name of exactly 8 characters fits, 9 do not."""

from __future__ import annotations

import pytest
import torch

from torch_qmm.format_state import parse_quant_state, quant_state_values
from torch_qmm.nn import QuantLinear


@pytest.mark.parametrize("name", ["a", "mxfp4", "abcdefgh"])
def test_mode_name_codes_round_trip(name):
    values = quant_state_values(4, 32, name)
    assert values == (4, 32, *(ord(c) for c in name), *([0] * (8 - len(name))))
    assert parse_quant_state(values) == (4, 32, name)


def test_mode_name_of_nine_characters_refused():
    with pytest.raises(ValueError, match="longer than 8 characters"):
        quant_state_values(4, 32, "abcdefghi")


def test_bool_state_refused():
    layer = QuantLinear(64, 8, bias=False)
    state = layer.state_dict()
    state["_extra_state"] = torch.tensor([True, True])
    with pytest.raises(ValueError, match="must be an integer tensor"):
        layer.load_state_dict(state)


def _codes(text: bytes) -> tuple[int, ...]:
    return (4, 32, *text.ljust(8, b"\0"))


@pytest.mark.parametrize("codes", [
    _codes(b"mxf\xc8"),            # a code past ASCII
    (4, 32, 200, 0, 0, 0, 0, 0, 0, 0),
    (4, 32, -1, 0, 0, 0, 0, 0, 0, 0),
    _codes(b""),                   # no name
    _codes(b"affine"),             # affine is written as [bits, group_size]
    _codes(b"mx\0fp4"),            # not zero-padded after the name
    _codes(b"mx\tfp4"),            # not printable
], ids=["non-ascii", "200", "negative", "empty", "affine", "inner-zero", "tab"])
def test_codes_that_no_mode_name_writes_parse_to_no_mode(codes):
    assert parse_quant_state(codes) == (4, 32, None)


def test_a_state_spelling_no_mode_is_refused_naming_its_codes():
    layer = QuantLinear(64, 8, bias=False, mode="mxfp4")
    state = layer.state_dict()
    state["_extra_state"] = torch.tensor(_codes(b"mx\0fp4"), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"the state holds bits=4, group_size=32, mode=\[109, 120, 0, 102, 112, 52, 0, "
                                         r"0\], this layer has bits=4, group_size=32, mode=mxfp4"):
        layer.load_state_dict(state)
    assert parse_quant_state((8, 64)) == (8, 64, "affine")


def _layers():
    from torch_qmm.interop.modules import GGUFLinear, QuantEmbedding

    return {"affine": lambda: QuantLinear(64, 8, bits=4, group_size=32),
            "mxfp4": lambda: QuantLinear(64, 8, mode="mxfp4"),
            "embedding": lambda: QuantEmbedding(16, 64, 4, 32),
            "gguf": lambda: GGUFLinear(256, 4, 12)}


@pytest.mark.parametrize("layer, key, dtype, expected", [
    ("affine", "qweight", torch.float32, "torch.uint32"),  # copy_ rounded the words (2^24 and up)
    ("affine", "qweight", torch.int64, "torch.uint32"),  # wrapped modulo 2^32
    ("affine", "scales", torch.int32, "a float dtype"),
    ("affine", "biases", torch.bool, "a float dtype"),
    ("affine", "bias", torch.complex64, "a float dtype"),  # the imaginary part dropped with a warning
    ("mxfp4", "scales", torch.float32, "torch.uint8"),  # scale codes: 3.7 became 3
    ("mxfp4", "scales", torch.int64, "torch.uint8"),  # 300 became 44
    ("embedding", "qweight", torch.float32, "torch.uint32"),
    ("gguf", "blocks", torch.int64, "torch.uint8"),
])
def test_a_state_tensor_whose_dtype_copy_would_convert_is_refused(layer, key, dtype, expected):
    """load_state_dict copies with copy_, which converts any dtype: packed codes of another dtype
    (rounded or wrapped) and integer values for float tensors are refused before any copy."""
    module = _layers()[layer]()
    state = module.state_dict()
    state[key] = (torch.full(state[key].shape, 300) if dtype != torch.float32 else
                  torch.full(state[key].shape, 3.7)).to(dtype)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=rf"'{key}': expected {expected} \(this layer, .*\), got {dtype}"):
        module.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("layer, key", [("affine", "qweight"), ("mxfp4", "scales"), ("gguf", "blocks")])
def test_codes_in_the_signed_dtype_of_their_width_load_bit_for_bit(layer, key):
    """int32 packed words and int8 scale codes or blocks hold the same bits as uint32 / uint8 (as
    a .view() gives them): they load unchanged, negative values included."""
    module = _layers()[layer]()
    state = module.state_dict()
    bits = torch.randint(0, 256, (state[key].numel() * state[key].element_size(),),
                         generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    bits[:4] = 255  # the most negative signed values start with these bytes
    signed = {torch.uint32: torch.int32, torch.uint8: torch.int8}[state[key].dtype]
    state[key] = bits.view(signed).reshape(state[key].shape)
    assert (state[key] < 0).any()
    module.load_state_dict(state)
    got = module.state_dict()[key]
    assert got.dtype != signed and torch.equal(got.view(torch.uint8).flatten(), bits)
    # assign=True takes the tensor itself: viewed back to the unsigned dtype, the layer still runs.
    fresh = _layers()[layer]()
    fresh.load_state_dict(state, assign=True)
    got = fresh.state_dict()[key]
    assert got.dtype != signed and torch.equal(got.view(torch.uint8).flatten(), bits)
    assert state[key].dtype == signed  # the caller's state is left as it was
    x = torch.randn(2, fresh.in_features if hasattr(fresh, "in_features") else 256)
    torch.testing.assert_close(fresh(x), module(x), rtol=0, atol=0, equal_nan=True)


def test_float_tensors_of_another_float_dtype_load_cast():
    module = QuantLinear(64, 8, bits=4, group_size=32)
    state = module.state_dict()
    state["scales"] = torch.full((8, 2), 0.5, dtype=torch.float64)
    state["bias"] = torch.ones(8, dtype=torch.bfloat16)
    module.load_state_dict(state)
    assert module.scales.dtype == torch.float32 and torch.equal(module.scales, torch.full((8, 2), 0.5))
