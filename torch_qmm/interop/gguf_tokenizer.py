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
    propagate). The file is linked into a folder of its own: from_pretrained also reads
    tokenizer_config.json from the folder it is given, and the GGUF's folder may hold another model's."""
    from transformers import AutoTokenizer

    f = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / "model.gguf"
        link.symlink_to(f.path.resolve())
        return AutoTokenizer.from_pretrained(tmp, gguf_file=link.name, local_files_only=True)
