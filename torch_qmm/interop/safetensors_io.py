"""Safetensors files and sharded folders, read with the header checked first (no pickle, ever).

The `safetensors` package rejects bad files with terse messages; we check the header ourselves
(length, JSON, dtypes, shapes against byte ranges, ranges inside the file) so that a truncated or
malformed file fails with a ValueError naming the file, the tensor and what disagrees.
Layout (safetensors spec): u64 little-endian header length n, n bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .json_files import check_regular_file, read_json_object
from .output_folder import current_umask

INDEX_NAME = "model.safetensors.index.json"
_OWN_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")

# safetensors dtype names -> bytes per element (the dtypes a torch checkpoint can hold).
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_FLOAT_DTYPES = {name: size for name, size in _ITEMSIZE.items() if name.startswith(("F", "BF"))}
# Refuse absurd headers before reading them (the reference implementation caps at 100 MB too).
_MAX_HEADER_BYTES = 100 * 2**20


def read_header(path: str | os.PathLike) -> dict[str, dict]:
    """Returns {tensor name: {"dtype", "shape", "data_offsets"}} after checking the whole header.

    Raises ValueError naming the file and the first inconsistency found.
    """
    path = Path(path)
    check_regular_file(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES:
            text = all(32 <= c < 127 or c in b"\t\r\n" for c in head)
            raise ValueError(f"{path}: not a safetensors file: its first 8 bytes give a header of {n} bytes, more than "
                             f"the {_MAX_HEADER_BYTES} a safetensors header may have"
                             + (f" (it begins with the text {head.decode('ascii')!r}: a JSON or other text file)"
                                if text else ""))
        if 8 + n > size:
            raise ValueError(
                f"{path}: safetensors header claims {n} bytes but the file has {size - 8} after the length "
                "field (truncated or not a safetensors file)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: safetensors header JSON is nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: safetensors '__metadata__' must map names to strings, got {str(metadata)[:200]}")
    data_bytes = size - 8 - n
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{path}: tensor {name!r}: header entry must have dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise ValueError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r} (expected one of {sorted(_ITEMSIZE)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ValueError(f"{path}: tensor {name!r}: bad shape {shape!r} (expected a list of integers >= 0)")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise ValueError(
                f"{path}: tensor {name!r}: bad data_offsets {offsets!r} (expected [begin, end], integers >= 0)"
            )
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not (0 <= begin <= end) or end - begin != numel * _ITEMSIZE[dtype]:
            raise ValueError(
                f"{path}: tensor {name!r}: shape {shape} of {dtype} needs {numel * _ITEMSIZE[dtype]} bytes, "
                f"header gives data_offsets [{begin}, {end}]"
            )
        if end > data_bytes:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {end} of the data section but the file holds only "
                f"{data_bytes} data bytes (truncated file)"
            )
    # The spec's layout: the byte ranges tile the data section, without holes or overlaps.
    covered = 0
    for name, info in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if begin != covered:
            what = "overlaps the previous tensor" if begin < covered else f"leaves bytes [{covered}, {begin}) unused"
            raise ValueError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] {what} (corrupt header)")
        covered = end
    if covered != data_bytes:
        raise ValueError(
            f"{path}: the tensors cover {covered} of the {data_bytes} data bytes (corrupt header or trailing data)"
        )
    return header


def _check_shard_name(index: Path, tensor: str, file) -> None:
    """A shard named by an index must be a plain *.safetensors file name: in the index's folder,
    never a path that leaves it (../x.safetensors, /abs/x.safetensors, sub/x.safetensors)."""
    if not isinstance(file, str) or not file.endswith(".safetensors") or Path(file).name != file or file in (".", ".."):
        raise ValueError(f"{index}: 'weight_map' entry {tensor!r} -> {file!r}: a shard must be a *.safetensors file "
                         "name in the index's own folder")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class Checkpoint:
    """The tensors of a safetensors file or of a folder of shards (with or without an index).

    Tensors are read lazily, one at a time, with their stored dtype.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.path = path
        self.where: dict[str, Path] = {}  # tensor name -> file
        self.headers: dict[Path, dict[str, dict]] = {}
        if path.is_file():
            files = [path]
        elif (path / INDEX_NAME).is_file():
            index = read_json_object(path / INDEX_NAME)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{path / INDEX_NAME}: missing 'weight_map'")
            for name, file in weight_map.items():
                _check_shard_name(path / INDEX_NAME, name, file)
            files = sorted({path / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"{path / INDEX_NAME} names shards that do not exist: {missing}")
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{path}: no *.safetensors files (and no {INDEX_NAME})")
        for f in files:
            header = read_header(f)
            self.headers[f] = header
            for name in header:
                if name in self.where:
                    raise ValueError(f"{path}: tensor {name!r} appears in both {self.where[name]} and {f}")
                self.where[name] = f
        if path.is_dir() and (path / INDEX_NAME).is_file():
            for name, file in weight_map.items():
                if self.where.get(name) != path / file:
                    raise ValueError(f"{path / INDEX_NAME}: tensor {name!r} is listed in {file} but not stored there")

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.where[name]][name]["shape"])

    def dtype_name(self, name: str) -> str:
        return self.headers[self.where[name]][name]["dtype"]

    def nbytes(self, name: str) -> int:
        begin, end = self.headers[self.where[name]][name]["data_offsets"]
        return end - begin

    def get(self, name: str) -> torch.Tensor:
        file = self.where[name]
        try:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name)
        except SafetensorError as e:  # what our header checks do not cover (file changed since?)
            raise ValueError(f"{file}: tensor {name!r}: {e}") from None

    def _non_finite(self, name: str) -> str:
        return (f"{self.where[name]}: tensor {name!r} ({self.dtype_name(name)}) holds NaN or Inf: the file is corrupt "
                "(a model's weights, scales and biases are finite)")

    def finite_scales(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t, read from tensor `name` (whole or a slice), after checking that the scales or biases
        of a quantized layer (float `.scales` / `.biases`) are finite: NaN or Inf there would make
        every output of the layer's rows NaN. ValueError naming the file and tensor."""
        if name.endswith((".scales", ".biases")) and t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(self._non_finite(name))
        return t

    def check_finite(self, name: str, slice_bytes: int) -> bool:
        """Reads a floating tensor a slice of rows at a time (at most about `slice_bytes` each)
        and raises ValueError naming the file and tensor at the first value that is not finite.
        Returns False, reading nothing, for an integer or bool tensor."""
        file, shape = self.where[name], self.shape(name)
        if self.dtype_name(name) not in _FLOAT_DTYPES:
            return False
        if math.prod(shape) == 0:  # a dim of 0: no values, however many rows the other dims give
            return True
        per_row = max(1, math.prod(shape[1:])) * _FLOAT_DTYPES[self.dtype_name(name)]
        step = max(1, slice_bytes // per_row)
        try:
            with safe_open(file, framework="pt") as f:
                view = f.get_slice(name)
                for r in range(0, shape[0] if shape else 1, step):
                    part = view[r:r + step] if shape else view[:]
                    if not torch.isfinite(part.float() if part.element_size() == 1 else part).all():
                        raise ValueError(self._non_finite(name))
        except SafetensorError as e:
            raise ValueError(f"{file}: tensor {name!r}: {e}") from None
        return True

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.headers:
            for name in self.headers[file]:
                yield name, self.get(name)


def model_files(folder: Path) -> list[str]:
    """The names of the model files in `folder` (config.json, safetensors weights and their index),
    sorted; none where it is not a folder."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if p.name == "config.json" or p.name.endswith((".safetensors", ".safetensors.index.json")))


def save_sharded(
    tensors: dict[str, torch.Tensor],
    folder: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Writes model.safetensors, or model-0000i-of-0000n.safetensors + the index when larger.

    Weight files of this naming left in `folder` by an earlier save and not rewritten now (another
    shard count, the index of a sharded save, model.safetensors) are removed, as transformers'
    save_pretrained removes stale shards: readers take the index or every model*.safetensors file,
    so a stale one would be loaded in place of (or mixed with) the new weights.
    Returns the file names written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    # safetensors >= 0.8 writes 0600 (it renames a private temporary file into place): give the
    # shards the mode of any new file, as the config and index get.
    mode = 0o666 & ~current_umask()
    for shard, name in zip(shards, names):
        save_file(shard, str(folder / name), metadata=metadata)
        (folder / name).chmod(mode)
        weight_map.update({k: name for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    written = set(names) | ({INDEX_NAME} if len(shards) > 1 else set())
    for f in folder.iterdir():
        if f.name not in written and _OWN_WEIGHT_FILE.fullmatch(f.name) and f.is_file():
            f.unlink()
    return names
