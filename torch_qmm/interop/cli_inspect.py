"""`python -m torch_qmm inspect FILE`: the layers of a checkpoint, their formats and bytes."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from ..cli_errors import UsageError
from .json_files import read_json_object
from .mlx import parse_quantization

DESCRIPTION = """\
List a checkpoint's layers (in natural order: 0, 1, 2, ..., 10), their formats, shapes and bytes,
and totals per format.

FILE: a .gguf file, a .safetensors file, or a model folder (MLX, torch_qmm/transformers, float).
Nothing is loaded beyond headers (GGUF tensor infos, safetensors headers, config.json), and each
is checked first: a corrupt file is an error naming it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help=".gguf file, .safetensors file or model folder")
    parser.add_argument("--json", action="store_true", help="print the table as JSON instead of text")


def natural_key(name: str) -> tuple:
    """Sort key putting blk.2 before blk.10: digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def _join(layer: str, leaf: str) -> str:
    return f"{layer}.{leaf}" if layer else leaf


def _rows_gguf(path: Path) -> tuple[list[dict], dict]:
    from .gguf import GGUFFile

    f = GGUFFile(path)
    rows = [{"layer": t.name, "format": t.type_name, "shape": list(t.shape), "bytes": t.nbytes}
            for t in sorted(f.tensors.values(), key=lambda t: natural_key(t.name))]
    return rows, {"container": "gguf", "architecture": f.architecture}


def _rows_safetensors(path: Path) -> tuple[list[dict], dict]:
    from .safetensors_io import Checkpoint

    ckpt = Checkpoint(path)
    folder = path if path.is_dir() else path.parent
    config = {}
    if (folder / "config.json").is_file():
        config = read_json_object(folder / "config.json")
    qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    info = {"container": "safetensors", "files": len(ckpt.headers)}
    if qc.get("quant_method") == "torch_qmm":
        info["quantization"] = "torch_qmm (transformers)"
        default, overrides = parse_quantization({"quantization": {k: qc.get(k) for k in ("bits", "group_size")}},
                                                str(folder / "config.json"))
        weight_key = "qweight"
    else:
        default, overrides = parse_quantization(config, str(folder / "config.json"))
        weight_key = "weight"
        if default is not None or overrides:
            info["quantization"] = "mlx"
    layers: dict[str, list[str]] = defaultdict(list)
    for key in ckpt.keys():
        layers[key.rpartition(".")[0]].append(key.rpartition(".")[2])
    rows = []
    for layer, leaves in sorted(layers.items(), key=lambda kv: natural_key(kv[0])):
        nbytes = sum(ckpt.nbytes(_join(layer, leaf)) for leaf in leaves)
        if "scales" in leaves and weight_key in leaves:
            spec = overrides.get(layer, default)
            words = ckpt.shape(_join(layer, weight_key))
            groups = ckpt.shape(_join(layer, "scales"))
            if spec and len(words) == 2 and len(groups) == 2:
                fmt = f"affine b{spec.bits} gs{spec.group_size} ({ckpt.dtype_name(_join(layer, 'scales'))})"
                shape = [words[0], groups[-1] * spec.group_size]
            else:
                fmt, shape = "affine (no config)", list(words)
            rows.append({"layer": layer, "format": fmt, "shape": shape, "bytes": nbytes})
        else:
            for leaf in sorted(leaves, key=natural_key):
                key = _join(layer, leaf)
                rows.append({"layer": key, "format": ckpt.dtype_name(key), "shape": list(ckpt.shape(key)),
                             "bytes": ckpt.nbytes(key)})
    return rows, info


def run(args: argparse.Namespace) -> int:
    path: Path = args.file
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        rows, info = _rows_gguf(path)
    else:
        rows, info = _rows_safetensors(path)
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        kind = r["format"].split(" (")[0]
        totals[kind][0] += 1
        totals[kind][1] += r["bytes"]
    if args.json:
        print(json.dumps({"info": info, "layers": rows, "totals": {k: {"count": c, "bytes": b} for k, (c, b) in totals.items()}}, indent=1))
        return 0
    print(f"{path}: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    width = max([len(r["layer"]) for r in rows] + [5])
    print(f"{'layer':<{width}}  {'format':<28} {'shape':<18} {'bytes':>12}")
    for r in rows:
        print(f"{r['layer']:<{width}}  {r['format']:<28} {str(r['shape']):<18} {r['bytes']:>12,}")
    print("totals:")
    for kind, (count, nbytes) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:<28} {count:>6} tensors/layers {nbytes / 2**20:>10.2f} MiB")
    print(f"  {'all':<28} {len(rows):>6}                {sum(r['bytes'] for r in rows) / 2**20:>10.2f} MiB")
    return 0
