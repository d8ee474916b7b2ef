"""The tokenizer a GGUF file describes, written as transformers tokenizer files.

A GGUF file has no tokenizer.json: it carries the vocabulary, merges, token types, special token
ids and chat template as tokenizer.ggml.* / tokenizer.chat_template metadata. transformers builds
a fast tokenizer from that metadata (AutoTokenizer.from_pretrained(..., gguf_file=...), its
integrations/gguf), and its save_pretrained writes the files AutoTokenizer and mlx_lm.load read
(tokenizer.json, tokenizer_config.json, chat_template.jinja). This module only calls those.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

from .gguf import GGUFFile

_MODEL_KEY = "tokenizer.ggml.model"


def save_gguf_tokenizer(gguf: str | os.PathLike | GGUFFile, folder: str | os.PathLike,
                        shown_as: str | os.PathLike | None = None) -> list[str]:
    """Writes the tokenizer of `gguf` into `folder` (which must exist); returns the file names written.

    A file without tokenizer metadata, or with a tokenizer transformers cannot build, gets a
    warning and no files (the weights are still usable, but AutoTokenizer and mlx_lm.load need
    tokenizer files: copy the original model's). shown_as: the folder the warnings name (default
    `folder`; e.g. the destination that a temporary output folder becomes).
    """
    f = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
    folder = Path(folder)
    shown = Path(shown_as) if shown_as is not None else folder
    kind = f.get_metadata(_MODEL_KEY)
    if kind is None:
        warnings.warn(f"{f.path}: no {_MODEL_KEY} metadata, so no tokenizer files were written to {shown}; "
                      "AutoTokenizer and mlx_lm.load need them (copy the original model's)", stacklevel=2)
        return []
    try:
        tokenizer = gguf_tokenizer(f)
    except Exception as e:  # transformers' builders raise errors of many kinds on metadata they cannot use
        # (ValueError, KeyError, TypeError, huggingface_hub's StrictDataclassFieldValidationError for
        # a special token id of a float type, ...): the weights are still good
        warnings.warn(f"{f.path}: transformers cannot build its {kind!r} tokenizer ({type(e).__name__}: {e}), "
                      f"so no tokenizer files were written to {shown}; AutoTokenizer and mlx_lm.load need them "
                      "(copy the original model's)", stacklevel=2)
        return []
    return sorted(Path(p).name for p in tokenizer.save_pretrained(folder))


def gguf_tokenizer(gguf: str | os.PathLike | GGUFFile):
    """The transformers tokenizer built from the metadata of `gguf` alone (transformers' errors
    propagate). transformers reads a GGUF holding only the file's architecture and tokenizer.*
    metadata, written into a folder of its own: from_pretrained also reads tokenizer_config.json
    from the folder it is given (the GGUF's folder may hold another model's), and parses the
    model's metadata too, which it fails on for some architectures (gpt-oss's rope.scaling keys)."""
    from transformers import AutoTokenizer

    f = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
    with tempfile.TemporaryDirectory() as tmp:
        _write_tokenizer_only(f, Path(tmp) / "model.gguf")
        return AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf", local_files_only=True)


def tokenizer_fields(f: GGUFFile) -> list:
    """[(key, value, gguf.GGUFValueType, array item type or None)] of f's tokenizer.* metadata."""
    from gguf import GGUFValueType

    out = []
    for key, entry in f.header.kv.items():
        if key.startswith("tokenizer."):
            array = entry.value_type == GGUFValueType.ARRAY
            out.append((key, f.get_metadata(key), GGUFValueType(entry.value_type),
                        GGUFValueType(entry.item_type) if array else None))
    return out


def _write_tokenizer_only(f: GGUFFile, path: Path) -> None:
    """A GGUF at `path` with f's architecture and its tokenizer.* metadata (types kept), no tensors."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), f.architecture or "llama")
    for key, value, vtype, sub_type in tokenizer_fields(f):
        writer.add_key_value(key, value, vtype, sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
