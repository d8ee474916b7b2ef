"""Command line: python -m torch_qmm {selftest,demo,bench,convert,inspect} ...

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
this file only lists them.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import select
import signal
import sys
import traceback

from .cli_errors import exit_code, one_line

# name -> (module, one-line help)
SUBCOMMANDS = {
    "selftest": ("torch_qmm.selftest", "run every kernel route against the float64 reference; table + JSON report"),
    "demo": ("torch_qmm.demo", "quantize a small built-in model: error, memory saved, speed"),
    "bench": ("torch_qmm.bench", "benchmark affine_qmm against F.linear, int8/int4 packs and MLX; JSON + plot"),
    "convert": ("torch_qmm.interop.cli_convert",
                "a transformers folder or GGUF file into a torch_qmm or MLX folder (GGUF: lossless where possible)"),
    "inspect": ("torch_qmm.interop.cli_inspect", "list a checkpoint's layers, formats and bytes (GGUF, safetensors, MLX)"),
}


_DEBUG_HELP = "on an error, print the full traceback instead of one line"


class Terminated(BaseException):
    """SIGTERM (kill, timeout, a CI runner), raised wherever the command is, so that it unwinds as
    Ctrl-C does: partial outputs are removed on the way out."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reading end is closed (`... | head` has read enough)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll on this platform, or stdout is no file
        return False


def _unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exits (2) through the subcommand's parser, whose usage lists the options the user meant,
    naming each unrecognized option with the closest option it has (a mistyped `--groupsize`:
    did you mean --group-size?)."""
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for arg in unknown:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns its exit code: 0 done, 1 a bad input file or failed run, 2 a bad
    argument (argparse's own usage errors exit with 2 through SystemExit)."""
    parser = argparse.ArgumentParser(prog="python -m torch_qmm", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    modules, parsers = {}, {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        parsers[name] = sub.add_parser(name, help=help_text, description=getattr(module, "DESCRIPTION", help_text),
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parsers[name])
        parsers[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        modules[name] = module
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(parsers[args.command], unknown)
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread (an embedding program): SIGTERM stays as it is
        previous = None
    try:
        code = int(modules[args.command].run(args) or 0)
        sys.stdout.flush()  # a closed stdout pipe shows here, not at the interpreter's exit
        return code
    except (KeyboardInterrupt, Terminated) as e:  # partial outputs were already removed on the way out
        if args.debug:
            raise
        killed = isinstance(e, Terminated)
        print(f"{parsers[args.command].prog}: {'terminated' if killed else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if killed else signal.SIGINT)
    except BrokenPipeError:
        if args.debug or not _stdout_reader_gone():
            raise
        # The reader of stdout stopped reading (`inspect ... | head`): stop quietly, as a shell's
        # commands do (exit 128 + SIGPIPE); stdout goes to devnull so that the interpreter's final
        # flush raises nothing either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as e:  # one line per error; the traceback only when asked
        if args.debug:
            traceback.print_exc()
        else:
            hint = "" if isinstance(e, (ValueError, OSError)) else " (unexpected: re-run with --debug and report it)"
            print(f"{parsers[args.command].prog}: error: {one_line(e)}{hint}", file=sys.stderr)
        return exit_code(e)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
