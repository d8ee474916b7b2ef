"""JSON files of model folders (config.json, index files) read with errors naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

# config.json / index files of real models are kilobytes to a few megabytes.
MAX_JSON_BYTES = 64 * 2**20


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is too large, not UTF-8, not
    JSON, nested too deeply or not an object."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {size} bytes, larger than the {MAX_JSON_BYTES} a JSON config can be")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value
