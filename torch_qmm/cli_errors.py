"""Errors of the command line (`python -m torch_qmm ...`) and how they end the process.

A UsageError is a bad argument (exit code 2, like argparse's own errors); any other error is a
bad input file or a failed run (exit code 1). Either prints one line naming the file, tensor or
argument; `--debug` prints the traceback instead.
"""

from __future__ import annotations

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
