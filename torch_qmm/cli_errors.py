"""Errors of the command line (`python -m torch_qmm ...`) and how they end the process.

A UsageError is a bad argument (exit code 2, like argparse's own errors); any other error is a
bad input file or a failed run (exit code 1). Either prints one line naming the file, tensor or
argument; `--debug` prints the traceback instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

EXIT_FAILURE = 1
EXIT_USAGE = 2


class UsageError(ValueError):
    """A command-line argument that is wrong whatever the files hold (exit code 2)."""


def exit_code(error: BaseException) -> int:
    return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILURE


def one_line(error: BaseException) -> str:
    """The error as one line: its message (with the exception type when that is not a plain
    ValueError/OSError-style message a user can act on)."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (ValueError, OSError)):
        return text
    return f"{type(error).__name__}: {text}"


def output_file(text: str) -> Path:
    """argparse type of an output file (a JSON report, next to it a plot), checked before the run
    that writes it: not an existing folder, and its folder either existing and writable or to be
    created in a writable one (the writers create missing parents). A bad path is a usage error
    when given, not an OSError after minutes of running."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path to write, got {text!r} (a folder)" if text else
                                         "expected a file path to write, got ''")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(ancestor)!r} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(ancestor)!r} is not writable")
    return path
