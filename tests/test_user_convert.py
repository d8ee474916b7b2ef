"""`convert` as a new user runs it on folders found in the wild."""

from __future__ import annotations

import pytest
import torch

from torch_qmm.__main__ import main

transformers = pytest.importorskip("transformers")
from test_interop_gguf_llama import hf_model  # noqa: E402


def test_a_folder_with_only_pickle_weights_is_refused_naming_the_folder(tmp_path, capsys):
    # An older transformers folder: config.json + pytorch_model.bin. transformers would read the
    # .bin through torch.load; convert loads safetensors only (README, Interop).
    src = tmp_path / "old-hf"
    model = hf_model(tied=False)
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert str(src) in err and "pytorch_model.bin" in err and "safetensors" in err
    assert len(err.strip().splitlines()) == 1
    assert not dst.exists()


def test_a_folder_with_no_weights_at_all_is_refused_naming_the_folder(tmp_path, capsys):
    src = tmp_path / "config-only"
    hf_model(tied=False).config.save_pretrained(src)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(src) in err and "no .safetensors weights" in err
