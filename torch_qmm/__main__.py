"""Command line: python -m torch_qmm {demo,bench,convert,inspect} ...

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from .cli_errors import EXIT_FAILURE, exit_code, one_line

# name -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("torch_qmm.demo", "quantize a small built-in model: error, memory saved, speed"),
    "bench": ("torch_qmm.bench", "benchmark affine_qmm against F.linear, int8/int4 packs and MLX; JSON + plot"),
    "convert": ("torch_qmm.interop.cli_convert", "quantize a transformers folder or GGUF file (transformers or MLX output)"),
    "inspect": ("torch_qmm.interop.cli_inspect", "list a checkpoint's layers, formats and bytes (GGUF, safetensors, MLX)"),
}


_DEBUG_HELP = "on an error, print the full traceback instead of one line"


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
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # one line per error; the traceback only when asked
        if args.debug:
            traceback.print_exc()
        else:
            print(f"{parsers[args.command].prog}: error: {one_line(e)}", file=sys.stderr)
            if exit_code(e) == EXIT_FAILURE and not isinstance(e, (ValueError, OSError)):
                print("  (an unexpected error: re-run with --debug for the traceback and report it)", file=sys.stderr)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
