"""Command line: python -m torch_qmm {selftest,demo,bench,convert,inspect} ...

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "selftest": ("torch_qmm.selftest", "run every kernel route against the float64 reference; table + JSON report"),
    "demo": ("torch_qmm.demo", "quantize a small built-in model: error, memory saved, speed"),
    "bench": ("torch_qmm.bench", "benchmark affine_qmm against F.linear, int8/int4 packs and MLX; JSON + plot"),
    "convert": ("torch_qmm.interop.cli_convert", "quantize a transformers folder or GGUF file (transformers or MLX output)"),
    "inspect": ("torch_qmm.interop.cli_inspect", "list a checkpoint's layers, formats and bytes (GGUF, safetensors, MLX)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_qmm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
