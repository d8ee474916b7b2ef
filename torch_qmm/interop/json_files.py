"""JSON files of model folders (config.json, index files) read with errors naming the file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

# config.json / index files of real models are kilobytes to a few megabytes.
MAX_JSON_BYTES = 64 * 2**20


def check_regular_file(path: Path) -> None:
    """ValueError naming `path` unless it is a regular file (or a symbolic link to one): a
    directory, a FIFO (whose reader waits for a writer) or a device (/dev/zero: endless) is not
    a model file."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise ValueError(f"{path}: {kind}, expected a regular file")


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is too large, not UTF-8, not
    JSON, nested too deeply or not an object."""
    path = Path(path)
    check_regular_file(path)
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
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value
