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
