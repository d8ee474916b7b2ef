"""A GGUF file's header, parsed with every declared size checked against the file first.

The `gguf` package's reader trusts the counts it reads (a 49-byte file declaring a 2^40-element
array makes it allocate without end), so torch_qmm parses the header itself. The checks follow
llama.cpp's GGUF loader (gguf_init_from_file_impl) and its model loader:
  * version 2 or 3; counts, string lengths and array lengths fit in the bytes that remain;
  * no duplicate keys or tensor names, no arrays of arrays, tensor names shorter than 64 bytes;
  * general.alignment, when present, a UINT32 power of two (default 32);
  * at most 4 dims, each in [0, 2^63), their product below 2^63, a known ggml type whose block
    size divides the row length;
  * the data section starts at the end of the tensor infos padded to the alignment, and each
    tensor's offset equals the running sum of the previous tensors' sizes padded to the
    alignment (so offsets are aligned, never overlap, leave no gaps and cannot wrap).
On top of llama.cpp (which only checks that each tensor lies inside the file): the file must end
where the data section ends, at most one alignment unit later, so that a tensor retyped or
resized to fewer bytes is refused rather than read as other bytes.

Every failure is a GGUFFormatError (a ValueError) naming the file and the field.
Layout (GGUF spec, little-endian): "GGUF", u32 version, u64 tensor count, u64 kv count,
kv pairs (string key, u32 type, value), tensor infos (string name, u32 n_dims, u64 ne[n_dims],
u32 ggml type, u64 offset), padding, data. A string is u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from pathlib import Path

from .gguf_types import GGML_TYPES, type_name
from .json_files import check_regular_file

DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating zero
SUPPORTED_VERSIONS = (2, 3)

# GGUF value types: id -> (name, struct format of one item; None for string / array).
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
STRING, ARRAY, UINT32 = 8, 9, 4
_INT64_MAX = 2**63 - 1


class GGUFFormatError(ValueError):
    """A GGUF file that is truncated, corrupt or not GGUF; the message names the file."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One metadata entry: where its value lies in the file (decoded on demand by value())."""

    key: str
    value_type: int  # for an array: ARRAY
    item_type: int  # the scalar type (for an array: its items' type)
    offset: int  # first byte of the value (for an array: of its first item)
    count: int  # 1 for a scalar


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    offset: int  # absolute file offset of the data
    nbytes: int


@dataclasses.dataclass
class Header:
    path: Path
    size: int
    version: int
    alignment: int
    data_offset: int
    kv: dict[str, KeyValue]
    tensors: list[TensorInfo]


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class _Cursor:
    """Bounded little-endian reads of a memory-mapped file; every overrun is a GGUFFormatError."""

    def __init__(self, path: Path, buf) -> None:
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos} but the file has {self.size} bytes "
                            "(truncated or corrupt header)")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8: {raw[:40]!r}") from None

    def skip_string(self, what: str) -> None:
        n = self.unpack("<Q", f"length of {what}")
        self.need(n, what)
        self.pos += n


def read_header(path: str | os.PathLike) -> Header:
    """Parses and checks the header of the GGUF file `path` (see the module docstring)."""
    path = Path(path)
    try:
        check_regular_file(path)  # open() of a FIFO would wait for a writer
    except ValueError as e:
        raise GGUFFormatError(str(e)) from None
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GGUFFormatError(f"{path}: empty file, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, size)


def _parse(path: Path, buf, size: int) -> Header:
    c = _Cursor(path, buf)
    magic = bytes(buf[:4])
    if magic != b"GGUF":
        raise c.fail(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    c.pos = 4
    version = c.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise c.fail(f"GGUF version {version} is not supported (expected one of {SUPPORTED_VERSIONS}"
                     + ("; a big-endian file?" if version & 0xFFFF == 0 else "") + ")")
    n_tensors = c.unpack("<Q", "tensor count")
    n_kv = c.unpack("<Q", "metadata count")
    # Lower bounds on the bytes each entry takes: a kv pair 8 + 4 + 1, a tensor info 8 + 4 + 4 + 8.
    if n_kv * 13 + n_tensors * 24 > size - c.pos:
        raise c.fail(f"header declares {n_kv} metadata entries and {n_tensors} tensors, more than the "
                     f"{size} bytes of the file can hold (corrupt header)")
    kv: dict[str, KeyValue] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}")
        if key in kv:
            raise c.fail(f"duplicate metadata key {key!r}")
        kv[key] = _read_value(c, key)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        entry = kv["general.alignment"]
        if entry.value_type != UINT32:
            raise c.fail(f"metadata 'general.alignment' must be a UINT32, got {_type_label(entry)}")
        alignment = value(buf, entry)
        if alignment == 0 or alignment & (alignment - 1):
            raise c.fail(f"metadata 'general.alignment' = {alignment} is not a power of two")
    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = c.string(f"name of tensor #{i}")
        if len(name.encode()) > MAX_NAME_BYTES:
            raise c.fail(f"tensor #{i} name {name[:80]!r} is longer than {MAX_NAME_BYTES} bytes")
        if name in names:
            raise c.fail(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = c.unpack("<I", f"tensor {name!r} n_dims")
        if n_dims > MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dims, at most {MAX_DIMS} are allowed")
        ne = tuple(c.unpack("<Q", f"tensor {name!r} dim {j}") for j in range(n_dims))
        numel, extent = 1, 1  # extent ignores zero dims, so that no view of it overflows either
        for j, d in enumerate(ne):
            if d > _INT64_MAX:
                raise c.fail(f"tensor {name!r} dim {j} = {d} is negative as int64")
            numel *= d
            extent *= max(d, 1)
        if extent > _INT64_MAX:
            raise c.fail(f"tensor {name!r} has {numel} elements (dims {list(ne)}), more than 2^63 - 1")
        ggml_type = c.unpack("<I", f"tensor {name!r} type")
        if ggml_type not in GGML_TYPES:
            raise c.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
        _, per_block, block_bytes = GGML_TYPES[ggml_type]
        row = ne[0] if ne else 1
        if row % per_block:
            raise c.fail(f"tensor {name!r} of type {type_name(ggml_type)} has rows of {row} values, not a "
                         f"multiple of its block size {per_block}")
        offset = c.unpack("<Q", f"tensor {name!r} offset")
        infos.append((name, ggml_type, ne, offset, numel // per_block * block_bytes))
    data_offset = _pad(c.pos, alignment)
    tensors = []
    expected = 0
    for name, ggml_type, ne, offset, nbytes in infos:
        if offset != expected:
            why = ("is not a multiple of the alignment" if offset % alignment else
                   "overlaps the previous tensor" if offset < expected else "leaves a gap after the previous tensor")
            raise c.fail(f"tensor {name!r} has data offset {offset}, expected {expected} (the previous tensors' "
                         f"sizes padded to alignment {alignment}): it {why}")
        end = data_offset + offset + nbytes
        if end > size:
            raise c.fail(f"tensor {name!r} ({type_name(ggml_type)}, dims {list(ne)}) needs {nbytes} bytes at file "
                         f"offset {data_offset + offset}, but the file has {size} bytes (truncated file or corrupt "
                         "header)")
        tensors.append(TensorInfo(name, ggml_type, ne, data_offset + offset, nbytes))
        expected += _pad(nbytes, alignment)
    data_end = data_offset + expected
    if size > data_end + alignment:
        raise c.fail(f"the tensors' data ends at byte {data_end} but the file has {size} bytes: tensor types, "
                     "dims or counts in the header do not describe the data (corrupt header)")
    return Header(path, size, version, alignment, data_offset, kv, tensors)


def _type_label(entry: KeyValue) -> str:
    item = VALUE_TYPES[entry.item_type][0]
    return f"ARRAY of {item}" if entry.value_type == ARRAY else item


def _read_value(c: _Cursor, key: str) -> KeyValue:
    value_type = c.unpack("<I", f"type of metadata {key!r}")
    if value_type not in VALUE_TYPES:
        raise c.fail(f"metadata {key!r} has unknown value type {value_type}")
    item_type, count = value_type, 1
    if value_type == ARRAY:
        item_type = c.unpack("<I", f"item type of metadata {key!r}")
        if item_type not in VALUE_TYPES or item_type == ARRAY:
            raise c.fail(f"metadata {key!r} is an array of "
                         + ("arrays (not allowed)" if item_type == ARRAY else f"unknown value type {item_type}"))
        count = c.unpack("<Q", f"length of metadata {key!r}")
    offset = c.pos
    fmt = VALUE_TYPES[item_type][1]
    if fmt is None:  # strings: at least 8 length bytes each, checked before walking them
        c.need(count * 8, f"{count} strings of metadata {key!r}")
        for _ in range(count):
            c.skip_string(f"a string of metadata {key!r}")
    else:
        n = count * struct.calcsize(fmt)
        c.need(n, f"{count} {VALUE_TYPES[item_type][0]} values of metadata {key!r}")
        c.pos += n
    return KeyValue(key, value_type, item_type, offset, count)


def value(buf, entry: KeyValue, path: Path | None = None):
    """The Python value of `entry` (int/float/bool/str; a list for an array) read from `buf`."""
    fmt = VALUE_TYPES[entry.item_type][1]
    if fmt is None:
        out, pos = [], entry.offset
        for _ in range(entry.count):
            (n,) = struct.unpack_from("<Q", buf, pos)
            raw = bytes(buf[pos + 8:pos + 8 + n])
            pos += 8 + n
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise GGUFFormatError(f"{path}: metadata {entry.key!r} holds a string that is not valid UTF-8: "
                                      f"{raw[:40]!r}") from None
    else:
        width = struct.calcsize(fmt)
        out = [v for (v,) in struct.iter_unpack(fmt, buf[entry.offset:entry.offset + entry.count * width])]
    return out if entry.value_type == ARRAY else out[0]
