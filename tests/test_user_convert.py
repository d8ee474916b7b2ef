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


def test_gguf_calibration_text_is_tokenized_by_the_file_s_own_tokenizer(tmp_path):
    # A GGUF downloaded next to another model's tokenizer.json: `convert --calibration` must
    # tokenize with the tokenizer it writes to DST (the GGUF's), not the neighbour's (transformers
    # reads a tokenizer.json from the folder it is given).
    import argparse

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from test_interop_mlx_lm import PROMPT, smollm2_gguf
    from torch_qmm.interop.cli_convert import _calibration

    path = smollm2_gguf()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / "model.gguf").symlink_to(path)
    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(downloads / "tokenizer.json"))
    text = tmp_path / "calib.txt"
    text.write_text(PROMPT)
    args = argparse.Namespace(calibration=text, method="gptq", src=downloads / "model.gguf")
    samples = _calibration(args, is_gguf=True)
    assert [s.tolist() for s in samples] == [[reference(PROMPT, add_special_tokens=False).input_ids]]
