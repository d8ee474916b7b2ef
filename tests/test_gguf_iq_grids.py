"""metal/gguf_iq_grids.h (the lattice i-quants' codebooks for C++ and Metal) is what
csrc/gen_gguf_iq_grids.py writes from the gguf package's grids, and its entries decode back to them."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import numpy as np
from gguf import quants

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "metal" / "gguf_iq_grids.h"


def test_header_is_the_generators_output(tmp_path):
    gen = runpy.run_path(str(ROOT / "csrc" / "gen_gguf_iq_grids.py"))
    out = tmp_path / "grids.h"
    gen["main"](["gen", str(out)])
    assert out.read_text() == HEADER.read_text(), "run python csrc/gen_gguf_iq_grids.py"


def _tables() -> dict[str, list[int]]:
    text = HEADER.read_text()
    found = re.findall(r"uint(\d+)_t (\w+)\[(\d+)\] = \{([^}]*)\};", text)
    return {name: [int(v.rstrip("ul"), 16) for v in body.replace("\n", " ").split(",") if v.strip()]
            for _, name, _, body in found}


def test_every_entry_unpacks_to_the_gguf_grid():
    tables = _tables()
    for name, cls in (("kIQ2XXSGrid", quants.IQ2_XXS), ("kIQ2XSGrid", quants.IQ2_XS), ("kIQ2SGrid", quants.IQ2_S),
                      ("kIQ3XXSGrid", quants.IQ3_XXS), ("kIQ3SGrid", quants.IQ3_S), ("kIQ1SGrid", quants.IQ1_S)):
        cls.init_grid()
        entries, width = cls.grid_shape
        words = np.array(tables[name], dtype=np.uint64)
        assert words.shape == (entries,), name
        values = ((words[:, None] >> (8 * np.arange(width, dtype=np.uint64))) & 0xFF).astype(np.uint8).view(np.int8)
        assert np.array_equal(values.astype(np.float32), np.asarray(cls.grid).reshape(entries, width)), name
