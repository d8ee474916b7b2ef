"""`python -m torch_qmm inspect FILE`: the layers of a checkpoint, their formats and bytes."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from ..cli_errors import UsageError
from ..format_state import FORMAT_STATE_KEY, QUANT_STATE_LENGTHS, parse_quant_state
from ..formats import packed_words
from ..nn import resolve_format
from .gguf_types import NATIVE_TYPES, block_info, type_name
from .json_files import read_json_object
from .mlx import parse_quantization

DESCRIPTION = """\
List a checkpoint's layers (in natural order: 0, 1, 2, ..., 10), their formats, shapes and bytes,
and totals per format.

FILE: a .gguf file, a .safetensors file, or a model folder (MLX, torch_qmm/transformers, float).
A layer saved from torch_qmm's modules (save_pretrained, or a state_dict written with safetensors)
shows the format its `_extra_state` tensor holds (noting where config.json says otherwise).
Nothing is loaded beyond headers (GGUF tensor infos, safetensors headers, config.json) and those
few-byte format tensors, and each is checked first: a corrupt file is an error naming it.
--verify also reads every tensor's data, a slice of rows at a time, and fails (exit code 1) naming
the first tensor whose values or block scales are not finite."""

_INTEGER_DTYPES = ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64")
VERIFY_SLICE_BYTES = 64 << 20  # --verify: at most this much float32 decoded at a time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help=".gguf file, .safetensors file or model folder")
    parser.add_argument("--json", action="store_true", help="print the table as JSON instead of text")
    parser.add_argument("--verify", action="store_true",
                        help="also read every tensor and check that its values / block scales are finite")


def natural_key(name: str) -> tuple:
    """Sort key putting blk.2 before blk.10: digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def _join(layer: str, leaf: str) -> str:
    return f"{layer}.{leaf}" if layer else leaf


def _rows_gguf(path: Path, verify: bool) -> tuple[list[dict], dict]:
    from .gguf import GGUFFile, check_finite

    f = GGUFFile(path)
    tensors = sorted(f.tensors.values(), key=lambda t: natural_key(t.name))
    rows = [{"layer": t.name, "format": t.type_name, "shape": list(t.shape), "bytes": t.nbytes} for t in tensors]
    info = {"container": "gguf", "architecture": f.architecture}
    if verify:  # a tensor that is not finite raises; one the gguf package cannot decode is counted
        skipped = defaultdict(int)
        for t in tensors:
            if not check_finite(t, VERIFY_SLICE_BYTES):
                skipped[t.type_name] += 1
        info["verified"] = len(tensors) - sum(skipped.values())
        if skipped:
            info["not verified"] = ", ".join(f"{count} {kind}" for kind, count in sorted(skipped.items()))
    return rows, info


def _saved_format(ckpt, key: str) -> tuple:
    """A module's format tensor (FormatState): (bits, group_size, mode) of a QuantLinear /
    QuantEmbedding ([2] or [10], format_state.py), (GGML type,) of a GGUFLinear ([1]). Its header
    is checked before it is read."""
    shape, dtype = ckpt.shape(key), ckpt.dtype_name(key)
    lengths = (1, *QUANT_STATE_LENGTHS)
    if dtype not in _INTEGER_DTYPES or len(shape) != 1 or shape[0] not in lengths:
        raise ValueError(f"{ckpt.where[key]}: tensor {key!r} must be an integer tensor [2] (bits, group_size), "
                         f"[{QUANT_STATE_LENGTHS[1]}] (bits, group_size, mode name) or [1] (GGUF type), got "
                         f"{dtype} {list(shape)}")
    values = tuple(int(v) for v in ckpt.get(key).tolist())
    if len(values) == 1:
        return values
    bits, group_size, mode = parse_quant_state(values)
    try:
        if mode is None:
            raise ValueError(f"the mode codes {list(values[2:])} spell no mode name")
        resolve_format(mode, bits, group_size)
    except ValueError as e:
        raise ValueError(f"{ckpt.where[key]}: tensor {key!r} holds an unsupported format: {e}") from None
    return bits, group_size, mode


def _gguf_row(ckpt, layer: str, ggml_type: int) -> tuple[str, list[int]]:
    key = _join(layer, "blocks")
    shape = ckpt.shape(key)
    if ggml_type not in NATIVE_TYPES:
        raise ValueError(f"{ckpt.where[key]}: tensor {_join(layer, FORMAT_STATE_KEY)!r} holds GGUF type {ggml_type} "
                         f"({type_name(ggml_type)}); GGUFLinear holds {', '.join(type_name(t) for t in NATIVE_TYPES)}")
    per_block, block_bytes = block_info(ggml_type)
    if len(shape) != 2 or shape[1] % block_bytes != 0:
        raise ValueError(f"{ckpt.where[key]}: tensor {key!r} of {type_name(ggml_type)} blocks must be "
                         f"[rows, a multiple of {block_bytes}], got {list(shape)}")
    return f"GGUF {type_name(ggml_type)}", [shape[0], shape[1] // block_bytes * per_block]


def _torch_qmm_quantization(qc: dict, where: str):
    """(default spec or None, {layer: spec}) of a torch_qmm quantization_config (TorchQmmConfig):
    bits an int, or a mapping layer -> bits ("*": the others)."""
    bits, mode = qc.get("bits"), qc.get("mode", "affine")
    entry = {"group_size": qc.get("group_size"), "mode": mode}
    if not isinstance(bits, dict):
        return parse_quantization({"quantization": {**entry, "bits": bits}}, where)
    layers = {name: {**entry, "bits": b} for name, b in bits.items() if name != "*"}
    top = {**entry, "bits": bits["*"]} if "*" in bits else {}
    return parse_quantization({"quantization": {**top, **layers}}, where)


def _rows_safetensors(path: Path, verify: bool) -> tuple[list[dict], dict]:
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
        default, overrides = _torch_qmm_quantization(qc, str(folder / "config.json"))
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
        saved = _saved_format(ckpt, _join(layer, FORMAT_STATE_KEY)) if FORMAT_STATE_KEY in leaves else None
        words_key = "qweight" if "qweight" in leaves else weight_key
        if "scales" in leaves and words_key in leaves and (saved is None or len(saved) == 3):
            spec = overrides.get(layer, default)
            configured = (spec.bits, spec.group_size, spec.mode) if spec else None
            known = saved or configured
            words = ckpt.shape(_join(layer, words_key))
            groups = ckpt.shape(_join(layer, "scales"))
            # a weight [N, K*bits/32] with scales [N, K/group_size], or a stack of them (MoE
            # experts: [E, N, K*bits/32] and [E, N, K/group_size]); biases as the scales
            fits = len(words) in (2, 3) and len(groups) == len(words) and words[:-1] == groups[:-1]
            biases = ckpt.shape(_join(layer, "biases")) if "biases" in leaves else groups
            if known and not fits:
                k = words[-1] * 32 // known[0] if words else 0  # the row the codes hold
                raise ValueError(f"{ckpt.where[_join(layer, 'scales')]}: layer {layer!r}: scales {list(groups)} do not "
                                 f"fit {words_key} {list(words)}: {known[2]} b{known[0]} gs{known[1]} needs scales "
                                 f"{[*words[:-1], k // known[1]]}, one per group of {known[1]} of each row of {k}")
            if known and biases != groups:
                raise ValueError(f"{ckpt.where[_join(layer, 'biases')]}: layer {layer!r}: biases {list(biases)} do not "
                                 f"fit scales {list(groups)}: one bias per scale")
            if known:
                note = (f"; config.json says {configured[2]} b{configured[0]} gs{configured[1]}"
                        if configured not in (None, known) else "")
                fmt = f"{known[2]} b{known[0]} gs{known[1]} ({ckpt.dtype_name(_join(layer, 'scales'))}{note})"
                shape = [*words[:-1], groups[-1] * known[1]]
                if words[-1] != packed_words(shape[-1], known[0]):  # the row the scales give, packed
                    raise ValueError(f"{ckpt.where[_join(layer, words_key)]}: layer {layer!r}: {words_key} "
                                     f"{list(words)} does not fit its scales {list(groups)}: {known[2]} b{known[0]} "
                                     f"gs{known[1]} packs {shape[-1]} values per row in "
                                     f"{packed_words(shape[-1], known[0])} words")
            else:
                kind = "affine" if "biases" in leaves else "quantized"
                fmt, shape = f"{kind} (no config)", list(words)
            rows.append({"layer": layer, "format": fmt, "shape": shape, "bytes": nbytes})
        elif "blocks" in leaves and saved is not None and len(saved) == 1:
            fmt, shape = _gguf_row(ckpt, layer, saved[0])
            rows.append({"layer": layer, "format": fmt, "shape": shape, "bytes": nbytes})
        else:
            for leaf in sorted(leaves, key=natural_key):
                key = _join(layer, leaf)
                rows.append({"layer": key, "format": ckpt.dtype_name(key), "shape": list(ckpt.shape(key)),
                             "bytes": ckpt.nbytes(key)})
    if verify:  # the floating tensors (codes of any value are valid); one that is not finite raises
        info["verified"] = sum(ckpt.check_finite(key, VERIFY_SLICE_BYTES) for key in ckpt.keys())
    return rows, info


def run(args: argparse.Namespace) -> int:
    path: Path = args.file
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        rows, info = _rows_gguf(path, args.verify)
    else:
        rows, info = _rows_safetensors(path, args.verify)
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
