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
