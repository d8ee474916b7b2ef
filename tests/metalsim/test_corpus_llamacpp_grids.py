"""The lattice i-quants' codebooks and sign table against llama.cpp's own C tables (ggml-common.h
from the llama-cpp-python sdist, the source llama.cpp compiles for CPU and Metal): metal/gguf_iq_grids.h
is generated from the gguf package, so this checks that package's grids and torch_qmm's header
against the C source nobody here wrote; the sign parity that the decoders compute (gguf_format.h
even_sign_byte, gguf_blocks._even_sign_bytes) against ksigns_iq2xs."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import metalsim_corpus as corpus
from torch_qmm import gguf_blocks

HEADER = Path(__file__).resolve().parents[2] / "metal" / "gguf_iq_grids.h"
# torch_qmm's table -> llama.cpp's
NAMES = {"kIQ2XXSGrid": "iq2xxs_grid", "kIQ2XSGrid": "iq2xs_grid", "kIQ2SGrid": "iq2s_grid",
         "kIQ3XXSGrid": "iq3xxs_grid", "kIQ3SGrid": "iq3s_grid", "kIQ1SGrid": "iq1s_grid"}


def _numbers(body: str) -> list[int]:
    return [int(v.rstrip("uUlL"), 0) for v in re.split(r"[,\s]+", body) if v]


def _ggml_tables() -> dict[str, list[int]]:
    text = (corpus.llama_metal() / "ggml-common.h").read_text()
    found = re.findall(r"^GGML_TABLE_BEGIN\(\w+, (\w+), \w+\)(.*?)^GGML_TABLE_END\(\)", text, re.S | re.M)
    return {name: _numbers(body) for name, body in found}


def _ours() -> dict[str, list[int]]:
    found = re.findall(r"uint\d+_t (\w+)\[\d+\] = \{([^}]*)\};", HEADER.read_text())
    return {name: _numbers(body) for name, body in found}


def test_codebooks_equal_llama_cpp_tables():
    ggml, ours = _ggml_tables(), _ours()
    for name, theirs in NAMES.items():
        assert ours[name] == ggml[theirs], name


def test_sign_parity_equals_ksigns_iq2xs():
    ksigns = _ggml_tables()["ksigns_iq2xs"]
    assert len(ksigns) == 128
    assert gguf_blocks._even_sign_bytes(torch.arange(128)).tolist() == ksigns
