"""Hostile and corrupt files: refused with a ValueError naming the file, fast, in bounded memory.

Field positions of the valid files are found with the `gguf` package's own reader and Python's
json, not with torch_qmm's parser, and the structural mutations are the ones llama.cpp's loader
refuses (ggml/src/gguf.cpp): wrong offsets, sizes, types, dims, counts, alignment.
The fuzz test runs a few hundred mutants in a fresh process (tests/hostile_worker.py) and checks
per case: the time, the memory (peak RSS and the peak of traced Python/numpy allocations), and
the outcome (accepted, or refused naming the file; never another exception).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType as T

from torch_qmm.__main__ import main
from torch_qmm.interop import load_mlx, save_mlx
from torch_qmm.interop.gguf import GGUFFile, dequantize
from torch_qmm.interop.gguf_header import GGUFFormatError
from torch_qmm.interop.gguf_llama import check_llama_metadata

transformers = pytest.importorskip("transformers")
from test_interop_gguf_llama import hf_model, write_llama_gguf  # noqa: E402

TESTS = Path(__file__).parent
U64_MAX = 2**64 - 1

# ---------------------------------------------------------------------------------------------
# A small valid llama GGUF with every kind of field the parser meets, and its field positions.


def _rewrite_with_extras(src: Path, dst: Path) -> None:
    """src's tensors and metadata plus: an odd-sized tensor first (so every later offset depends
    on the padding), a numeric and a string array."""
    r = GGUFReader(src)
    w = GGUFWriter(str(dst), "llama")
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if isinstance(value, float):
            w.add_float32(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_string(name, value)
    w.add_uint32("general.alignment", 32)  # the default, written out so that mutants can change it
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "bc"])
    w.add_tensor("rope_freqs.weight", np.arange(5, dtype=np.float32))  # 20 bytes: padded to 32
    for t in r.tensors:
        if t.tensor_type == T.F32:
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile_gguf")
    write_llama_gguf(hf_model(tied=False), folder / "plain.gguf",
                     {"q_proj": T.Q4_K, "k_proj": T.Q8_0, "v_proj": T.Q6_K, "o_proj": T.Q4_0, "gate_proj": T.Q5_1,
                      "up_proj": T.Q8_0, "down_proj": T.Q4_1, "embed": T.Q4_0, "lm_head": T.Q8_0},
                     np.random.default_rng(3))
    _rewrite_with_extras(folder / "plain.gguf", folder / "m.gguf")
    return folder / "m.gguf"


def _positions(path: Path) -> dict:
    """Byte positions of header fields, from gguf's reader: per tensor its n_dims, dims, type and
    offset; per metadata key its value (or array length); the counts."""
    r = GGUFReader(path)

    def part_offsets(field):
        out, pos = [], field.offset
        for part in field.parts:
            out.append(pos)
            pos += part.nbytes
        return out

    tensors = {}
    for t in r.tensors:
        p = part_offsets(t.field)  # name length, name, n_dims, dims, type, offset
        tensors[t.name] = {"name_len": p[0], "name": p[1], "n_dims": p[2], "dims": p[3], "type": p[4], "offset": p[5],
                           "data_offset": int(t.data_offset - r.data_offset), "ne": [int(d) for d in t.shape]}
    fields = {}
    for name, f in r.fields.items():
        p = part_offsets(f)
        fields[name] = {"key_len": p[0], "value": p[3] if len(p) > 3 else None, "array_len": p[4] if len(p) > 4 else None}
    return {"tensors": tensors, "fields": fields, "data_start": int(r.data_offset), "size": path.stat().st_size}


def _u32(v: int) -> str:
    return struct.pack("<I", v).hex()


def _u64(v: int) -> str:
    return struct.pack("<Q", v).hex()


def structural_gguf_mutants(path: Path) -> dict[str, dict]:
    """name -> {"patches": [[offset, hex]], "truncate": n}: each one a file llama.cpp refuses."""
    pos = _positions(path)
    tensors = pos["tensors"]
    names = list(tensors)
    first, second, last = tensors[names[0]], tensors[names[1]], tensors[names[-1]]
    q8 = next(t for n, t in tensors.items() if n == "blk.0.attn_k.weight")
    fields = pos["fields"]
    m: dict[str, dict] = {
        "49 bytes declaring a 2^40-element array": {
            "truncate": 0, "patches": [[0, (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
                                            + struct.pack("<IIQ", 9, 0, 2**40)).hex()]]},
        "version 1": {"patches": [[4, _u32(1)]]},
        "version 4": {"patches": [[4, _u32(4)]]},
        "tensor count + 1": {"patches": [[8, _u64(len(names) + 1)]]},
        "tensor count 2^40": {"patches": [[8, _u64(2**40)]]},
        "kv count + 1": {"patches": [[16, _u64(len(fields) - 3 + 1)]]},  # GGUF.* pseudo-fields are not kvs
        "kv count 2^63": {"patches": [[16, _u64(2**63)]]},
        "key length 2^40": {"patches": [[fields["general.architecture"]["key_len"], _u64(2**40)]]},
        "string array length 2^40": {"patches": [[fields["tokenizer.ggml.tokens"]["array_len"], _u64(2**40)]]},
        "float array length 2^62": {"patches": [[fields["tokenizer.ggml.scores"]["array_len"], _u64(2**62)]]},
        "alignment 1": {"patches": [[fields["general.alignment"]["value"], _u32(1)]]},
        "alignment 3": {"patches": [[fields["general.alignment"]["value"], _u32(3)]]},
        "alignment 0": {"patches": [[fields["general.alignment"]["value"], _u32(0)]]},
        "alignment as a float": {"patches": [[fields["general.alignment"]["value"] - 4, _u32(6)]]},
        "misaligned offset": {"patches": [[second["offset"], _u64(second["data_offset"] + 4)]]},
        "gap before a tensor": {"patches": [[second["offset"], _u64(second["data_offset"] + 32)]]},
        "overlapping offset": {"patches": [[second["offset"], _u64(first["data_offset"])]]},
        "offset 2^64-1": {"patches": [[last["offset"], _u64(U64_MAX)]]},
        "offset 2^63": {"patches": [[second["offset"], _u64(2**63)]]},
        "retyped Q8_0 -> Q4_0": {"patches": [[q8["type"], _u32(int(T.Q4_0))]]},
        "retyped Q8_0 -> F32": {"patches": [[q8["type"], _u32(int(T.F32))]]},
        "last tensor retyped Q8_0 -> Q4_0": {"patches": [[last["type"], _u32(int(T.Q4_0))]]},
        "unknown type 99": {"patches": [[q8["type"], _u32(99)]]},
        "row not a multiple of the block": {"patches": [[q8["dims"], _u64(q8["ne"][0] - 32 + 16)]]},
        "rows + 1": {"patches": [[q8["dims"] + 8, _u64(q8["ne"][1] + 1)]]},
        "last tensor rows - 1": {"patches": [[last["dims"] + 8, _u64(last["ne"][1] - 1)]]},
        "rows 2^40": {"patches": [[q8["dims"] + 8, _u64(2**40)]]},
        "dim 2^63 (negative)": {"patches": [[q8["dims"] + 8, _u64(2**63)]]},
        "5 dims": {"patches": [[q8["n_dims"], _u32(5)]]},
        "duplicate tensor name": {"patches": [[tensors["blk.0.attn_k.weight"]["name"], b"blk.0.attn_q.weight".hex()]]},
        "truncated in the header": {"truncate": first["offset"] + 3},
        "truncated in the data": {"truncate": pos["size"] - 1000},
        "trailing bytes": {"patches": [[pos["size"], (b"\0" * 4096).hex()]]},
        "NaN block scale (Q8_0)": {"patches": [[pos["data_start"] + q8["data_offset"], "007e"]]},
        "Inf block scale (Q4_K)": {"patches": [[pos["data_start"] + tensors["blk.1.attn_q.weight"]["data_offset"],
                                                "007c"]]},
    }
    return m


def _mutated(path: Path, mutant: dict, out: Path) -> Path:
    data = bytearray(path.read_bytes())
    if mutant.get("truncate") is not None:
        del data[mutant["truncate"]:]
    for offset, hexbytes in mutant.get("patches", []):
        patch = bytes.fromhex(hexbytes)
        data[offset:offset + len(patch)] = patch
    out.write_bytes(bytes(data))
    return out


def _read_everything(path: Path) -> None:
    f = GGUFFile(path)
    f.metadata
    for t in f.tensors.values():
        dequantize(t)
    check_llama_metadata(f)


def test_the_valid_file_reads_and_its_fields_are_where_the_mutants_expect(llama_gguf):
    _read_everything(llama_gguf)
    f = GGUFFile(llama_gguf)
    assert f.get_metadata("tokenizer.ggml.tokens") == ["<s>", "a", "bc"]
    assert f.get_metadata("tokenizer.ggml.scores") == [0.5, -1.0, 2.0]
    assert f.metadata["llama.block_count"] == 2
    # the same bytes gguf's reader sees
    r = GGUFReader(llama_gguf)
    for t in r.tensors:
        assert np.array_equal(f.tensors[t.name].raw.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name", [
    "49 bytes declaring a 2^40-element array", "version 1", "version 4", "tensor count + 1", "tensor count 2^40",
    "kv count + 1", "kv count 2^63", "key length 2^40", "string array length 2^40", "float array length 2^62",
    "alignment 1", "alignment 3", "alignment 0", "alignment as a float", "misaligned offset", "gap before a tensor",
    "overlapping offset", "offset 2^64-1", "offset 2^63", "retyped Q8_0 -> Q4_0", "retyped Q8_0 -> F32",
    "last tensor retyped Q8_0 -> Q4_0", "unknown type 99", "row not a multiple of the block", "rows + 1",
    "last tensor rows - 1", "rows 2^40", "dim 2^63 (negative)", "5 dims", "duplicate tensor name",
    "truncated in the header", "truncated in the data", "trailing bytes", "NaN block scale (Q8_0)",
    "Inf block scale (Q4_K)"])
def test_structurally_corrupt_gguf_is_refused_naming_the_file(llama_gguf, tmp_path, name):
    bad = _mutated(llama_gguf, structural_gguf_mutants(llama_gguf)[name], tmp_path / "bad.gguf")
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        _read_everything(bad)
    assert time.perf_counter() - t0 < 5
    assert str(bad) in str(e.value)
    if "scale" in name:
        assert "corrupt" in str(e.value) and "float32" not in str(e.value)  # no dtype advice for a bad file


@pytest.mark.parametrize("name", ["NaN block scale (Q8_0)", "Inf block scale (Q4_K)"])
def test_a_bad_scale_in_a_row_permuted_tensor_names_the_file(llama_gguf, tmp_path, capsys, name):
    """attn_k / attn_q: loading reorders their rows (llama.cpp's permutation undone) before the
    check, and the reordered tensor must still name the file."""
    bad = _mutated(llama_gguf, structural_gguf_mutants(llama_gguf)[name], tmp_path / "bad.gguf")
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: tensor 'blk." in err and "corrupt" in err and "<memory>" not in err, err
    assert not (tmp_path / "out").exists()


def test_gguf_with_another_power_of_two_alignment_is_read(llama_gguf, tmp_path):
    """llama.cpp accepts any power of two; a file written with alignment 64 reads the same tensors."""
    r = GGUFReader(llama_gguf)
    w = GGUFWriter(str(tmp_path / "a64.gguf"), "llama")
    w.data_alignment = 64
    w.add_uint32("general.alignment", 64)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=None if t.tensor_type == T.F32 else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "a64.gguf")
    assert f.header.alignment == 64
    for t in r.tensors:
        assert np.array_equal(f.tensors[t.name].raw.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_a_49_byte_file_declaring_a_huge_array_fails_fast_in_the_cli(tmp_path, capsys):
    path = tmp_path / "a.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
                     + struct.pack("<IIQ", 9, 0, 2**40))
    assert path.stat().st_size == 49
    t0 = time.perf_counter()
    assert main(["inspect", str(path)]) == 1
    assert main(["convert", str(path), str(tmp_path / "out"), "--format", "mlx"]) == 1
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(str(path) in line and "metadata 'a'" in line for line in err)
    assert not (tmp_path / "out").exists()


def _gguf_of_tensors(path: Path, tensors: list[tuple[str, list[int], int]]) -> Path:
    """A GGUF file (version 3, no metadata, alignment 32) of tensors given as (name, ggml dims
    ne, ggml type), each holding no bytes: every one has a dim of 0."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 0)
    for name, ne, ggml_type in tensors:
        out += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(ne))
        out += b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", ggml_type, 0)
    path.write_bytes(out + b"\0" * (-len(out) % 32))
    return path


_ZERO_DIM_SCRIPT = """
import sys, time
from torch_qmm.__main__ import main
from torch_qmm.interop.gguf import GGUFFile, check_finite, dequantize
from torch_qmm.interop.safetensors_io import Checkpoint
t0 = time.perf_counter()
f = GGUFFile(sys.argv[1])
for t in f.tensors.values():
    assert dequantize(t).shape == t.shape, t.name
    assert check_finite(t, 1 << 20) is True, t.name
ckpt = Checkpoint(sys.argv[2])
assert ckpt.check_finite("a", 1 << 20) is True
assert main(["inspect", sys.argv[1], "--verify"]) == 0
assert main(["inspect", sys.argv[2], "--verify"]) == 0
print("seconds", time.perf_counter() - t0)
"""


def test_tensors_with_a_dim_of_zero_hold_no_values_and_are_verified_at_once(tmp_path):
    """A dim of 0 (the header allows it, as llama.cpp's does) makes a tensor of no values, however
    large its other dims: dequantize gives the empty tensor (it divided by the row length: a
    ZeroDivisionError, or a numpy "array is too big") and --verify checks nothing (it walked
    2^62 empty rows, a step at a time: no end). In a child process, so that a hang fails the test."""
    from safetensors.torch import save_file  # noqa: F401  (the safetensors file is written by hand)

    gguf = _gguf_of_tensors(tmp_path / "z.gguf", [("q8.weight", [0, 1000], int(T.Q8_0)),
                                                  ("q4k.weight", [0, 7], int(T.Q4_K)),
                                                  ("f32.weight", [0, 2**62], int(T.F32)),
                                                  ("f16.weight", [2**40, 0], int(T.F16))])
    header = json.dumps({"a": {"dtype": "F32", "shape": [2**62, 0], "data_offsets": [0, 0]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    st = tmp_path / "z.safetensors"
    st.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, "-c", _ZERO_DIM_SCRIPT, str(gguf), str(st)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("ne", [[0, 1000], [32, 0], [32, 4, 2]])
def test_a_gguf_tensor_that_is_no_matrix_is_refused_as_a_layer_naming_the_file(tmp_path, ne):
    from torch_qmm.interop.gguf import embedding_from_gguf, linear_from_gguf

    path = _gguf_of_tensors(tmp_path / "z.gguf", [("w.weight", ne, int(T.Q8_0))])
    if 0 not in ne:  # 256 values of Q8_0: 8 blocks of 34 bytes
        path.write_bytes(path.read_bytes() + b"\0" * (8 * 34))
    t = GGUFFile(path).tensors["w.weight"]
    for fn, what in ((linear_from_gguf, "a linear weight"), (embedding_from_gguf, "an embedding table")):
        with pytest.raises(ValueError, match=rf"tensor 'w.weight': {what} must be \[") as e:
            fn(t)
        assert str(path) in str(e.value)


# ---------------------------------------------------------------------------------------------
# Metadata that disagrees with the tensors: refused before the model is built.


def _with_metadata(src: Path, dst: Path, key: str, value: int) -> Path:
    pos = _positions(src)["fields"][key]["value"]
    return _mutated(src, {"patches": [[pos, _u32(value)]]}, dst)


@pytest.mark.parametrize("key, value, message", [
    ("llama.feed_forward_length", 2**18, r"'blk.0.ffn_gate.weight' has shape \[512, 256\], but the metadata"),
    ("llama.block_count", 2**31 - 1, r"'llama.block_count' = 2147483647 but the file holds tensors for blocks 0..1"),
    ("llama.attention.head_count", 0, r"'llama.attention.head_count' must be a positive integer, got 0"),
    ("llama.embedding_length", 0, r"'llama.embedding_length' must be a positive integer"),
    ("llama.attention.head_count_kv", 3, r"head_count' = 4 is not a multiple of 'llama.attention.head_count_kv' = 3"),
    ("llama.rope.dimension_count", 0, r"'llama.rope.dimension_count' must be a positive integer"),
])
def test_metadata_disagreeing_with_the_tensors_is_refused_before_building(llama_gguf, tmp_path, key, value, message,
                                                                            capsys):
    bad = _with_metadata(llama_gguf, tmp_path / "bad.gguf", key, value)
    with pytest.raises(ValueError, match=message):
        check_llama_metadata(GGUFFile(bad))
    # the CLI too: one line, exit 1, within seconds and without building the model
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["convert", str(bad), str(tmp_path / "out"), "--format", "mlx"]) == 1
    assert time.perf_counter() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: far below 1.97 GB
    assert str(bad) in capsys.readouterr().err


def test_rope_freq_base_zero_is_refused(llama_gguf, tmp_path):
    pos = _positions(llama_gguf)["fields"]["llama.rope.freq_base"]["value"]
    bad = _mutated(llama_gguf, {"patches": [[pos, struct.pack("<f", 0.0).hex()]]}, tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match=r"'llama.rope.freq_base' must be a positive finite number, got 0.0"):
        check_llama_metadata(GGUFFile(bad))


def _llama_gguf_with(src: Path, dst: Path, metadata: dict | None = None, tensors: dict | None = None) -> Path:
    """src rewritten with `metadata` (key -> (value, GGUFValueType)) replacing or adding entries and
    `tensors` (name -> float32 array) added."""
    from gguf.constants import GGUFValueType

    r = GGUFReader(src)
    w = GGUFWriter(str(dst), "llama")
    metadata = dict(metadata or {})
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in metadata:
            continue
        value = field.contents()
        if isinstance(value, list):
            w.add_array(name, value)
            continue
        kind = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32 if isinstance(
            value, int) else GGUFValueType.STRING
        w.add_key_value(name, value, kind)
    for name, (value, kind) in metadata.items():
        w.add_key_value(name, value, kind)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=None if t.tensor_type == T.F32 else t.tensor_type)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, np.asarray(array, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("key, value", [("llama.attention.layer_norm_rms_epsilon", 1),
                                        ("llama.rope.freq_base", 10000)])
def test_float_metadata_stored_as_an_integer_builds_the_config(llama_gguf, tmp_path, key, value):
    """llama.cpp reads a float field stored with an integer type; LlamaConfig refuses an int for a
    float field (a StrictDataclassFieldValidationError), so the value is converted."""
    from gguf.constants import GGUFValueType

    from torch_qmm.interop.gguf_llama import llama_config_from_gguf

    path = _llama_gguf_with(llama_gguf, tmp_path / "int.gguf", {key: (value, GGUFValueType.UINT32)})
    assert GGUFFile(path).get_metadata(key) == value
    config = llama_config_from_gguf(GGUFFile(path))
    field = "rms_norm_eps" if "epsilon" in key else "rope_theta"
    got = getattr(config, field, None)
    if got is None:  # transformers 5 keeps rope_theta in rope_parameters
        got = config.rope_parameters["rope_theta"]
    assert got == float(value) and type(got) is float


@pytest.mark.parametrize("name, rows", [
    ("blk.1.attn_q.bias", 7),  # block 0 has no biases: the model built has none (an IndexError in the permutation)
    ("blk.1.attn_q.bias", 256),  # of the right size: a bias on one layer of a model whose config says none
    ("blk.1.ffn_up.bias", 512),
    ("output_norm.bias", 256),  # no layer reads it: it was dropped without a word
    ("blk.0.attn_norm.bias", 256),
])
def test_a_bias_the_model_has_no_place_for_is_refused(llama_gguf, tmp_path, name, rows, capsys):
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama

    path = _llama_gguf_with(llama_gguf, tmp_path / "bias.gguf", tensors={name: np.ones(rows)})
    f = GGUFFile(path)
    message = rf"tensor '{re.escape(name)}' is a bias the llama model has no place for"
    with pytest.raises(ValueError, match=message):
        check_llama_metadata(f)
    with pytest.raises(ValueError, match=message):
        model = transformers.LlamaForCausalLM(llama_config_from_gguf(f))
        load_gguf_llama(model, f, progress=False)
    assert main(["convert", str(path), str(tmp_path / "out"), "--format", "mlx"]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "no place for" in err and "unexpected" not in err


def test_biases_of_every_block_load(llama_gguf, tmp_path):
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama

    rows = {"attn_q": 256, "attn_k": 128, "attn_v": 128, "attn_output": 256}
    path = _llama_gguf_with(llama_gguf, tmp_path / "bias.gguf", tensors={
        f"blk.{i}.{p}.bias": np.full(n, i + 1.0) for i in range(2) for p, n in rows.items()})
    f = GGUFFile(path)
    model = transformers.LlamaForCausalLM(llama_config_from_gguf(f))
    load_gguf_llama(model, f, progress=False)
    assert model.config.attention_bias and not model.config.mlp_bias
    assert torch.equal(model.model.layers[1].self_attn.o_proj.bias, torch.full((256,), 2.0))


# ---------------------------------------------------------------------------------------------
# MLX folders and config.json.


@pytest.fixture(scope="module")
def mlx_folder(tmp_path_factory) -> Path:
    """A sharded MLX folder (index + 3 shards) of the small llama, 4-bit group size 64."""
    from torch_qmm.convert import quantize_model

    folder = tmp_path_factory.mktemp("hostile_mlx") / "mlx"
    model = hf_model(tied=False)
    quantize_model(model, bits=4, group_size=64)
    save_mlx(model, folder, config=model.config.to_dict(), max_shard_bytes=300_000)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _fresh_model(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    for k in ("quantization", "quantization_config", "architectures", "transformers_version", "model_type"):
        config.pop(k, None)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8:8 + n])


def _rewrite_header(path: Path, header: dict) -> None:
    """Replaces a shard's header keeping its length (safetensors pads headers with spaces)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text.ljust(n, b" ") + data[8 + n:])


def _shard_of(folder: Path, key: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][key]


@pytest.mark.parametrize("value, message", [
    (4.7, "field 'bits' must be a JSON integer or null, got 4.7"),
    ("4", "field 'bits' must be a JSON integer or null, got '4'"),
    (True, "field 'bits' must be a JSON integer or null, got True"),
])
def test_mlx_config_bits_must_be_an_integer(mlx_folder, tmp_path, value, message):
    folder = _copy(mlx_folder, tmp_path / "m")

    def edit(c):
        c["quantization"]["bits"] = c["quantization_config"]["bits"] = value

    _edit_config(folder, edit)
    with pytest.raises(ValueError, match=message) as e:
        load_mlx(_fresh_model(mlx_folder), folder)
    assert str(folder / "config.json") in str(e.value)


def test_mlx_scales_stored_as_integers_are_refused(mlx_folder, tmp_path):
    folder = _copy(mlx_folder, tmp_path / "m")
    key = "model.layers.0.mlp.up_proj.scales"
    shard = _shard_of(folder, key)
    _, header = _header(shard)
    assert header[key]["dtype"] == "F32"
    header[key]["dtype"] = "I32"  # same size: the byte ranges still tile the file
    _rewrite_header(shard, header)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj': scales of mode 'affine' must be a float dtype .* got I32"):
        load_mlx(_fresh_model(mlx_folder), folder)


def test_mlx_float_tensor_stored_as_integers_is_refused(mlx_folder, tmp_path):
    folder = _copy(mlx_folder, tmp_path / "m")
    key = "model.norm.weight"
    shard = _shard_of(folder, key)
    _, header = _header(shard)
    header[key]["dtype"] = "I32"
    _rewrite_header(shard, header)
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' is I32, but the model's tensor is torch.float32"):
        load_mlx(_fresh_model(mlx_folder), folder)


def test_safetensors_metadata_that_is_not_strings_is_refused(mlx_folder, tmp_path):
    folder = _copy(mlx_folder, tmp_path / "m")
    shard = _shard_of(folder, "model.norm.weight")
    _, header = _header(shard)
    header["__metadata__"] = {"format": 1}
    _rewrite_header(shard, header)
    with pytest.raises(ValueError, match=r"'__metadata__' must map names to strings") as e:
        load_mlx(_fresh_model(mlx_folder), folder)
    assert str(shard) in str(e.value)


def test_index_shard_outside_the_folder_is_refused(mlx_folder, tmp_path):
    folder = _copy(mlx_folder, tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copyfile(folder / first, tmp_path / first)  # a readable file outside the folder
    index["weight_map"] = {k: (f"../{v}" if v == first else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"-> '\.\./{first}': a shard must be a \*\.safetensors file name"):
        load_mlx(_fresh_model(mlx_folder), folder)


_SHARDED_SCRIPT = """
import json, sys
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan

folder, store = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
config = json.loads(open(folder + "/config.json").read())
for k in ("quantization", "quantization_config", "architectures", "transformers_version", "model_type"):
    config.pop(k, None)
with empty_parameters():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
try:
    load_mlx_sharded(model, folder, mesh, tp_plan(model))
except ValueError as e:
    print("refused:", e)
"""


def _sharded_load(folder: Path, tmp_path: Path) -> str:
    """What _SHARDED_SCRIPT prints loading `folder` with load_mlx_sharded on one rank in a child
    process (it starts a process group)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT, str(folder), str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("part", ["weight", "biases"])
def test_quantized_layer_without_its_weight_or_biases_is_refused_by_every_mlx_loader(mlx_folder, tmp_path, part):
    """A layer stored with scales but without its packed weight or biases: load_mlx_sharded (one
    rank, in a child process: it starts a process group) raised a KeyError naming only the tensor."""
    from safetensors.torch import load_file, save_file

    folder = _copy(mlx_folder, tmp_path / "m")
    key = f"model.layers.1.mlp.down_proj.{part}"
    shard = _shard_of(folder, key)
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "mlx"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = f"quantized layer 'model.layers.1.mlp.down_proj' has scales but no {key}"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_mlx(_fresh_model(mlx_folder), folder)
    stdout = _sharded_load(folder, tmp_path)
    assert f"refused: {folder}: {message}" in stdout, stdout[-2000:]


@pytest.mark.parametrize("leaf, value", [("scales", float("nan")), ("biases", float("inf"))])
def test_scales_or_biases_that_are_not_finite_are_refused_by_load_mlx_and_load_mlx_sharded(mlx_folder, tmp_path,
                                                                                        leaf, value):
    """One NaN scale (or Inf bias) of a quantized layer made every output of its rows NaN, loaded
    without a word by load_mlx and by each rank of load_mlx_sharded that reads it."""
    from safetensors.torch import load_file, save_file

    folder = _copy(mlx_folder, tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = f"model.layers.1.mlp.down_proj.{leaf}"
    shard = folder / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key][5, 1] = value
    save_file(tensors, str(shard), metadata={"format": "mlx"})
    message = f"{shard}: tensor '{key}' (F32) holds NaN or Inf: the file is corrupt"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_mlx(_fresh_model(mlx_folder), folder)
    stdout = _sharded_load(folder, tmp_path)
    assert f"refused: {message}" in stdout, stdout[-2000:]


def test_model_type_that_is_not_a_string_is_refused_by_load_mlx_sharded(mlx_folder, tmp_path):
    """A list where config.json names the model type: load_mlx refused it, load_mlx_sharded raised
    "unhashable type: 'list'" looking it up in the MoE naming table."""
    folder = _copy(mlx_folder, tmp_path / "m")
    _edit_config(folder, lambda c: c.update(model_type=["llama"]))
    stdout = _sharded_load(folder, tmp_path)
    assert f"refused: {folder / 'config.json'}: field 'model_type' must be a string, got ['llama']" in stdout, \
        stdout[-2000:]


def test_quantized_layer_the_model_lacks_is_refused_by_load_mlx_sharded(mlx_folder, tmp_path):
    """A checkpoint storing the quantized layers of a block the model does not have (config.json
    says one block fewer than the checkpoint holds): load_mlx_sharded names the checkpoint and the
    layer, as load_mlx does, not get_submodule's AttributeError. One rank, in a child process (it
    starts a process group)."""
    folder = _copy(mlx_folder, tmp_path / "m")
    blocks = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{blocks - 1}.mlp.down_proj.scales" in json.loads(
        (folder / "model.safetensors.index.json").read_text())["weight_map"]
    _edit_config(folder, lambda c: c.update(num_hidden_layers=blocks - 1))
    stdout = _sharded_load(folder, tmp_path)
    assert re.search(rf"^refused: {re.escape(str(folder))}: quantized layer 'model\.layers\.{blocks - 1}\.[a-z_.]+' "
                     r"does not exist in the model$", stdout, re.M), stdout[-2000:]


_PRETRAINED_SHARDED_SCRIPT = """
import json, sys
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch_qmm.distributed import empty_parameters, load_pretrained_sharded, tp_plan

store, folders = sys.argv[1], sys.argv[2:]
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
for folder in folders:
    with empty_parameters():
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    try:
        load_pretrained_sharded(model, folder, mesh, tp_plan(model))
        print("accepted", folder)
    except ValueError as e:
        print("refused:", e)
"""


def test_torch_qmm_quantization_config_of_other_json_types_is_refused_by_load_pretrained_sharded(tmp_path):
    """config.json's bits / group_size of another JSON type in a transformers save of a torch_qmm
    model: load_pretrained_sharded raised AttributeError ('str' object has no attribute 'get') or
    the format's error without naming config.json. One child process (it starts a process group)."""
    from torch_qmm.interop.transformers import TorchQmmConfig

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "float")
    transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=TorchQmmConfig(bits=4, group_size=64)).save_pretrained(tmp_path / "ok")
    edits = {"bits-str": {"bits": "4"}, "bits-list": {"bits": [4]}, "group-size-0": {"group_size": 0},
             "mode-list": {"mode": ["affine"]}}
    for name, edit in edits.items():
        _copy(tmp_path / "ok", tmp_path / name)
        _edit_config(tmp_path / name, lambda c, edit=edit: c["quantization_config"].update(edit))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, "-c", _PRETRAINED_SHARDED_SCRIPT, str(tmp_path / "store"),
                           *(str(tmp_path / n) for n in ("ok", *edits))], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"accepted {tmp_path / 'ok'}"
    expected = {"bits-str": "quantization_config 'bits' must be an integer, a mapping layer -> bits or null, got '4'",
                "bits-list": "quantization_config 'bits' must be an integer, a mapping layer -> bits or null, got [4]",
                "group-size-0": "quantization_config of layer 'model.layers.0.self_attn.q_proj': argument 'group_size' "
                                "must be one of (32, 64, 128), got 0",
                "mode-list": "argument 'mode' must be one of"}
    for line, (name, message) in zip(lines[1:], expected.items()):
        assert line.startswith(f"refused: {tmp_path / name / 'config.json'}: ") and message in line, line
    assert len(lines) == 1 + len(edits)


_PRETRAINED_BITS_SCRIPT = """
import sys
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch_qmm.distributed import empty_parameters, load_pretrained_sharded, tp_plan
from torch_qmm.nn import QuantLinear

store, folder = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
with empty_parameters():
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
load_pretrained_sharded(model, folder, mesh, tp_plan(model))
for name, module in model.named_modules():
    if isinstance(module, QuantLinear):
        print(name, module.bits)
"""


def test_per_layer_bits_with_a_default_are_read_by_load_pretrained_sharded(tmp_path):
    """config.json's quantization_config bits as a mapping layer -> bits with a '*' default (a
    config written by hand; save_pretrained names every layer): the layers the mapping names take
    their bits, every other quantized layer the default's. One rank, in a child process (it starts
    a process group)."""
    from torch_qmm.interop.transformers import TorchQmmConfig

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "float")
    bits = {"*": 8, "model.layers.0.mlp.up_proj": 4}
    transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=TorchQmmConfig(bits=bits, group_size=64)).save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["bits"]
    assert saved["model.layers.0.mlp.up_proj"] == 4 and len(saved) > 2  # the save names every layer
    _edit_config(tmp_path / "q", lambda c: c["quantization_config"].update(bits=bits))  # as written by hand
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, "-c", _PRETRAINED_BITS_SCRIPT, str(tmp_path / "store"), str(tmp_path / "q")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = dict(line.split() for line in proc.stdout.splitlines())
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"} <= set(loaded)
    assert loaded == {name: "4" if name == "model.layers.0.mlp.up_proj" else "8" for name in loaded}


def test_index_listing_a_tensor_in_another_shard_than_it_is_stored_in_is_refused(mlx_folder, tmp_path):
    folder = _copy(mlx_folder, tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][name] = shards[1]  # the tensor is stored in shards[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is listed in {shards[1]} but not stored there"):
        load_mlx(_fresh_model(mlx_folder), folder)


@pytest.mark.parametrize("text, message", [
    ("{", "config.json: not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "config.json: JSON nested too deeply"),
    ("[1, 2]", "config.json: must hold a JSON object, got list"),
])
def test_config_json_that_is_not_a_json_object_is_refused(mlx_folder, tmp_path, text, message, capsys):
    folder = _copy(mlx_folder, tmp_path / "m")
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_mlx(_fresh_model(mlx_folder), folder)
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["quantization"].update(mode=[1]), r"'quantization': quantization mode \[1\] is not supported"),
    (lambda c: c["quantization"].update(mode={"a": 1}), r"'quantization': quantization mode \{'a': 1\} is not supported"),
    (lambda c: c["quantization"].update({"model.layers.0.mlp.up_proj": {"bits": 4, "group_size": 64, "mode": [1]}}),
     r"'quantization.model.layers.0.mlp.up_proj': quantization mode \[1\] is not supported"),
    (lambda c: c.update(model_type=["llama"]), r"field 'model_type' must be a string, got \['llama'\]"),
])
def test_config_json_fields_of_a_json_type_that_cannot_be_hashed_are_refused(mlx_folder, tmp_path, edit, message,
                                                                            capsys):
    """A list or dict where config.json has a name (a mode, the model type): a ValueError naming
    config.json, not a TypeError from looking it up in a table."""
    folder = _copy(mlx_folder, tmp_path / "m")

    def both(c):
        c.pop("quantization_config")
        edit(c)

    _edit_config(folder, both)
    with pytest.raises(ValueError, match=message) as e:
        load_mlx(_fresh_model(mlx_folder), folder)
    assert str(folder / "config.json") in str(e.value)
    if "model_type" not in message:  # inspect reads the quantization entries, not the model type
        assert main(["inspect", str(folder)]) == 1
        err = capsys.readouterr().err
        assert str(folder / "config.json") in err and "unexpected" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_with_an_integer_of_too_many_digits_names_the_file(mlx_folder, tmp_path, name, capsys):
    """Python's json refuses integers of more than 4300 digits with a bare ValueError: it names the file."""
    folder = _copy(mlx_folder, tmp_path / "m")
    text = (folder / name).read_text()
    (folder / name).write_text(text[:-1].rstrip() + ', "n": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match="integer string conversion") as e:
        load_mlx(_fresh_model(mlx_folder), folder)
    assert str(folder / name) in str(e.value)
    assert main(["inspect", str(folder)]) == 1
    assert str(folder / name) in capsys.readouterr().err


def test_safetensors_header_with_an_integer_of_too_many_digits_names_the_file(tmp_path):
    from torch_qmm.interop.safetensors_io import read_header

    text = b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}'
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    with pytest.raises(ValueError, match="integer string conversion") as e:
        read_header(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("claimed", [100 * 2**20 + 1, 2**62])
def test_safetensors_header_longer_than_100_mb_is_refused_unread(tmp_path, claimed, monkeypatch):
    # A sparse file of 300 MB whose length field claims a header of over 100 MB (that it holds,
    # for the first case): refused before any of it is read, as safetensors' own reader does.
    from torch_qmm.interop import safetensors_io

    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", claimed))
        f.truncate(300 * 2**20)
    reads = []
    real_open = open
    monkeypatch.setattr(safetensors_io, "open", lambda *a, **k: _Counting(real_open(*a, **k), reads), raising=False)
    with pytest.raises(ValueError, match=rf"huge.safetensors: not a safetensors file: its first 8 bytes give a header "
                                         rf"of {claimed} bytes, more than the 104857600"):
        safetensors_io.read_header(path)
    assert sum(reads) <= 8


def test_a_text_file_given_as_safetensors_is_named_as_text(tmp_path, capsys):
    # config.json passed where a checkpoint is expected: its first 8 bytes read as a length of
    # over 10^18; the message says what the bytes are (a binary file's are not shown).
    from torch_qmm.__main__ import main
    from torch_qmm.interop import safetensors_io

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama"}\n')
    assert main(["inspect", str(path)]) == 1
    assert "(it begins with the text '{\"model_': a JSON or other text file)" in capsys.readouterr().err
    binary = tmp_path / "b.safetensors"
    binary.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"a safetensors header may have$"):
        safetensors_io.read_header(binary)


class _Counting:
    """A file whose reads are counted (bytes returned) into `reads`."""

    def __init__(self, f, reads):
        self._f, self._reads = f, reads

    def read(self, n=-1):
        data = self._f.read(n)
        self._reads.append(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_fifo_or_folder_named_like_a_model_file_is_refused_without_waiting(mlx_folder, llama_gguf, tmp_path, capsys):
    """open() of a FIFO waits for a writer forever: a shard, config or GGUF path that is not a
    regular file is refused by name (run in a child process, so that a hang fails the test)."""
    folder = _copy(mlx_folder, tmp_path / "m")
    (folder / "model.safetensors.index.json").unlink()  # every *.safetensors file of the folder is a shard
    os.mkfifo(folder / "extra.safetensors")
    (tmp_path / "x.gguf").mkdir()
    os.mkfifo(tmp_path / "y.gguf")
    os.mkfifo(tmp_path / "config.json")
    script = f"""
import sys
from pathlib import Path
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.json_files import read_json_object
from torch_qmm.interop.safetensors_io import Checkpoint
for fn, path, kind in [(Checkpoint, {str(folder)!r}, "a FIFO"), (GGUFFile, {str(tmp_path / "x.gguf")!r}, "a directory"),
                       (GGUFFile, {str(tmp_path / "y.gguf")!r}, "a FIFO"),
                       (read_json_object, {str(tmp_path / "config.json")!r}, "a FIFO")]:
    try:
        fn(path)
    except ValueError as e:
        assert kind + ", expected a regular file" in str(e), e
        print("refused", e)
    else:
        sys.exit("accepted " + path)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("refused") == 4
    assert str(folder / "extra.safetensors") in proc.stdout


def test_inspect_refuses_a_quantized_weight_its_scales_do_not_fit(mlx_folder, tmp_path, capsys):
    """A packed weight one word short per row (scales and biases unchanged): inspect printed the
    shape the scales give and exit 0, where load_mlx refuses the folder."""
    from safetensors.torch import load_file, save_file

    folder = _copy(mlx_folder, tmp_path / "m")
    key = "model.layers.1.mlp.up_proj.weight"
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "mlx"})
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert f"{shard}: layer 'model.layers.1.mlp.up_proj': weight [512, 31] does not fit its scales [512, 4]" in err, err
    assert len(err.splitlines()) == 1


def test_inspect_reads_a_tensor_name_without_a_dot(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 3), "layer.0.bias": torch.zeros(3)}, str(tmp_path / "x.safetensors"))
    assert main(["inspect", str(tmp_path / "x.safetensors"), "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert rows["w"]["shape"] == [2, 3] and rows["layer.0.bias"]["format"] == "F32"


def test_inspect_sorts_layers_naturally(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({f"blk.{i}.w": torch.zeros(1) for i in (10, 2, 0, 1, 11)}, str(tmp_path / "x.safetensors"))
    assert main(["inspect", str(tmp_path / "x.safetensors"), "--json"]) == 0
    assert [r["layer"] for r in json.loads(capsys.readouterr().out)["layers"]] == \
        [f"blk.{i}.w" for i in (0, 1, 2, 10, 11)]


def _verify_gguf(tmp_path, name: str, poison) -> Path:
    """A GGUF of one tensor of each family (Q8_0, Q4_K, Q6_K, F16, F32) with `poison(name, blocks)`
    applied to the raw array of tensor `name` (None: all valid)."""
    from gguf_helpers import random_k_blocks, write_gguf

    rng = np.random.default_rng(5)
    arrays = {
        "q8.weight": (quants_q8_0(rng.standard_normal((8, 64)).astype(np.float32)), T.Q8_0),
        "q4k.weight": (random_k_blocks(T.Q4_K, 6, 512, rng), T.Q4_K),
        "q6k.weight": (random_k_blocks(T.Q6_K, 6, 256, rng), T.Q6_K),
        "f16.weight": (rng.standard_normal((4, 32)).astype(np.float16).view(np.uint8), T.F16),
        "norm.weight": (rng.standard_normal(32).astype(np.float32), None),
    }
    if name is not None:
        poison(name, arrays[name][0])
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, arrays)
    return path


def quants_q8_0(w: np.ndarray) -> np.ndarray:
    from gguf import quants

    return quants.quantize(w, T.Q8_0)


NAN_F16 = np.array([np.nan], "<f2").view(np.uint8)
INF_F16 = np.array([np.inf], "<f2").view(np.uint8)


@pytest.mark.parametrize("name, poison, what", [
    ("q8.weight", lambda n, a: a.__setitem__((7, slice(34 + 0, 34 + 2)), NAN_F16), "block scales"),  # row 7, block 1 d
    ("q4k.weight", lambda n, a: a.__setitem__((5, slice(144 + 2, 144 + 4)), NAN_F16), "block scales"),  # dmin
    ("q4k.weight", lambda n, a: a.__setitem__((5, slice(0, 2)), INF_F16), "block scales"),  # d: Inf * 0 in the decode
    ("q6k.weight", lambda n, a: a.__setitem__((3, slice(208, 210)), NAN_F16), "block scales"),
    ("f16.weight", lambda n, a: a.__setitem__((3, slice(62, 64)), np.array([np.inf], "<f2").view(np.uint8)), "values"),
    ("norm.weight", lambda n, a: a.__setitem__(31, np.nan), "values"),
])
def test_inspect_verify_finds_gguf_values_that_are_not_finite(tmp_path, capsys, name, poison, what):
    """Headers alone cannot see a NaN scale; --verify decodes every tensor (the last row poisoned,
    so a check that stops early or skips a slice passes it) and names the tensor."""
    path = _verify_gguf(tmp_path, name, poison)
    assert main(["inspect", str(path)]) == 0  # the header is valid
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:  # the error says it all: no numpy warning beside it
        warnings.simplefilter("always")
        assert main(["inspect", str(path), "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"tensor {name!r}" in err and f"NaN or Inf {what}" in err and str(path) in err, err
    assert len(err.splitlines()) == 1
    assert not caught, [str(w.message) for w in caught]


def test_inspect_verify_passes_a_valid_gguf_and_bounds_each_slice(tmp_path, capsys, monkeypatch):
    from torch_qmm.interop import gguf as gguf_module

    path = _verify_gguf(tmp_path, None, None)
    assert main(["inspect", str(path), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["info"]["verified"] == 5
    # one row per slice: a NaN in the last row of each tensor is still found
    seen = []
    real = gguf_module.gguf_quants.dequantize
    monkeypatch.setattr(gguf_module.gguf_quants, "dequantize", lambda a, t: seen.append(a.shape[0]) or real(a, t))
    poisoned = _verify_gguf(tmp_path, "q4k.weight", lambda n, a: a.__setitem__((5, slice(0, 2)), NAN_F16))
    with pytest.raises(GGUFFormatError, match="'q4k.weight'"):
        gguf_module.check_finite(GGUFFile(poisoned).tensors["q4k.weight"], 1)
    assert seen == [1] * 6


def test_inspect_verify_says_which_tensors_it_could_not_decode(tmp_path, capsys, monkeypatch):
    """A type the gguf package has no decoder for is reported as not verified, never as verified."""
    from torch_qmm.interop import gguf as gguf_module

    real = gguf_module.gguf_quants.dequantize

    def no_k_quants(a, t):
        if t in (T.Q4_K, T.Q6_K):
            raise NotImplementedError(f"Dequantization for {t.name} is not yet implemented")
        return real(a, t)

    monkeypatch.setattr(gguf_module.gguf_quants, "dequantize", no_k_quants)
    assert main(["inspect", str(_verify_gguf(tmp_path, None, None)), "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["info"]
    assert info["verified"] == 3 and info["not verified"] == "1 Q4_K, 1 Q6_K"


def test_inspect_verify_finds_safetensors_values_that_are_not_finite(tmp_path, capsys):
    from safetensors.torch import save_file

    scales = torch.ones(300, 4, dtype=torch.bfloat16)
    good = {"l.weight": torch.zeros(300, 2, dtype=torch.int32), "l.scales": scales, "l.biases": scales.clone()}
    save_file(good, str(tmp_path / "good.safetensors"))
    assert main(["inspect", str(tmp_path / "good.safetensors"), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["info"]["verified"] == 2  # the codes are not float
    scales[299, 3] = float("nan")
    save_file({**good, "l.scales": scales}, str(tmp_path / "bad.safetensors"))
    assert main(["inspect", str(tmp_path / "bad.safetensors")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "bad.safetensors"), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "bad.safetensors: tensor 'l.scales' (BF16) holds NaN or Inf" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_inspect_verify_reads_float8_tensors(tmp_path, capsys, dtype):
    # FP8 checkpoints (F8_E4M3 / F8_E5M2 weights): torch has no isfinite for float8, the scan
    # widens them; a NaN in one is found.
    from safetensors.torch import save_file

    weight = torch.ones(64, 32).to(dtype)
    save_file({"w": weight}, str(tmp_path / "good.safetensors"))
    assert main(["inspect", str(tmp_path / "good.safetensors"), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["info"]["verified"] == 1
    weight[40, 7] = float("nan")
    save_file({"w": weight}, str(tmp_path / "bad.safetensors"))
    assert main(["inspect", str(tmp_path / "bad.safetensors"), "--verify"]) == 1
    assert "bad.safetensors: tensor 'w' (F8_E" in capsys.readouterr().err


@pytest.mark.parametrize("row", [0, 1, 5, 6, 299])
def test_safetensors_finite_scan_reads_every_slice_of_rows(tmp_path, row):
    """Checkpoint.check_finite reads a few rows at a time: a NaN in any row, in the first slice, at
    a slice's start or end or in the last one, is found (slices of 2 rows of 4 bfloat16 here)."""
    from safetensors.torch import save_file

    from torch_qmm.interop.safetensors_io import Checkpoint

    scales = torch.ones(300, 4, dtype=torch.bfloat16)
    save_file({"l.scales": scales}, str(tmp_path / "good.safetensors"))
    assert Checkpoint(tmp_path / "good.safetensors").check_finite("l.scales", 16) is True
    scales[row, 3] = float("inf")
    save_file({"l.scales": scales}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="tensor 'l.scales' \\(BF16\\) holds NaN or Inf"):
        Checkpoint(tmp_path / "bad.safetensors").check_finite("l.scales", 16)


# ---------------------------------------------------------------------------------------------
# The fuzz: a few hundred mutants in a fresh process, bounded in time and memory.

FUZZ_TIME_LIMIT_S = 10  # per case (SIGALRM in the worker); a normal case takes well under 1 s
FUZZ_RSS_GROWTH_MB = 400  # peak RSS above the worker's baseline (torch + transformers imported)
FUZZ_MAX_CONVERTS = 8  # accepted GGUF mutants also run through `convert` (0.4 s each): the first 8
FUZZ_TRACED_FACTOR = 32  # traced Python/numpy allocations per case <= 32 x the file + 16 MiB


def _random_gguf_mutants(path: Path, rng: np.random.Generator, n: int) -> list[dict]:
    pos = _positions(path)
    header_end = pos["data_start"]
    extremes = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**63, U64_MAX]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # flip 1-3 random header bytes
            patches = [[int(o), bytes([int(rng.integers(0, 256))]).hex()]
                       for o in rng.integers(0, header_end, size=int(rng.integers(1, 4)))]
        elif kind == 1:  # an extreme u64 at a random header position
            patches = [[int(rng.integers(4, header_end - 8)), _u64(extremes[int(rng.integers(len(extremes)))])]]
        elif kind == 2:  # an extreme u32 at a random header position
            patches = [[int(rng.integers(4, header_end - 4)), _u32(extremes[int(rng.integers(5))] % 2**32)]]
        else:  # a random data byte (a valid file, different weights; some scales become NaN/Inf)
            patches = [[int(rng.integers(header_end, pos["size"])), bytes([int(rng.integers(0, 256))]).hex()]]
        out.append({"patches": patches, "truncate": None})
    for cut in rng.integers(1, pos["size"], size=8):
        out.append({"patches": [], "truncate": int(cut)})
    return out


def _random_mlx_mutants(folder: Path, rng: np.random.Generator, n: int) -> list[dict]:
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    config_text = (folder / "config.json").read_text()
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:  # bytes of a shard's header (length field and JSON)
            shard = shards[int(rng.integers(0, len(shards)))]
            n_header, _ = _header(folder / shard)
            patches = [[int(o), bytes([int(rng.choice(list(b'0123456789"[]{},:FIU ') + [0, 255]))]).hex()]
                       for o in rng.integers(0, 8 + n_header, size=int(rng.integers(1, 3)))]
            out.append({"file": shard, "patches": patches})
        elif kind == 1:  # config.json text
            chars = list(config_text)
            for o in rng.integers(0, len(chars), size=int(rng.integers(1, 3))):
                chars[int(o)] = str(rng.choice(list('0123456789."{}[],:x-e ')))
            out.append({"file": "config.json", "text": "".join(chars)})
        else:  # the index
            text = (folder / "model.safetensors.index.json").read_text()
            chars = list(text)
            for o in rng.integers(0, len(chars), size=int(rng.integers(1, 3))):
                chars[int(o)] = str(rng.choice(list('0123456789./"{}[],:x ')))
            out.append({"file": "model.safetensors.index.json", "text": "".join(chars)})
    return out


def _structural_mlx_mutants(folder: Path) -> dict[str, dict]:
    key = "model.layers.0.mlp.up_proj.scales"
    shard = _shard_of(folder, key)
    n, header = _header(shard)
    raw = shard.read_bytes()

    def header_patch(edit) -> dict:
        h = json.loads(json.dumps(header))
        edit(h)
        text = json.dumps(h, separators=(",", ":")).encode()
        if len(text) > n:  # make room: the metadata entry is optional
            h.pop("__metadata__")
            text = json.dumps(h, separators=(",", ":")).encode()
        assert len(text) <= n
        return {"file": shard.name, "patches": [[8, text.ljust(n, b" ").hex()]]}

    def config_with(edit) -> dict:
        c = json.loads((folder / "config.json").read_text())
        edit(c)
        return {"file": "config.json", "text": json.dumps(c)}

    def set_q(field, value):
        def edit(c):
            c["quantization"][field] = c["quantization_config"][field] = value
        return edit

    begin, end = header[key]["data_offsets"]
    return {
        "scales I32": header_patch(lambda h: h[key].update(dtype="I32")),
        "metadata value not a string": header_patch(lambda h: h.update({"__metadata__": {"format": 1}})),
        "scales shape": header_patch(lambda h: h[key].update(shape=[h[key]["shape"][0] // 2, h[key]["shape"][1]])),
        "scales offsets shifted": header_patch(lambda h: h[key].update(data_offsets=[begin + 4, end + 4])),
        "scales end 2^64-1": header_patch(lambda h: h[key].update(data_offsets=[begin, U64_MAX])),
        "header length 2^63": {"file": shard.name, "patches": [[0, _u64(2**63)]]},
        "header length + 1": {"file": shard.name, "patches": [[0, _u64(n + 1)]]},
        "shard truncated": {"file": shard.name, "patches": [], "truncate": len(raw) - 7},
        "bits 4.7": config_with(set_q("bits", 4.7)),
        "bits '4'": config_with(set_q("bits", "4")),
        "bits 8 (shapes disagree)": config_with(set_q("bits", 8)),
        "group_size 0": config_with(set_q("group_size", 0)),
        "config not JSON": {"file": "config.json", "text": "{\"quantization\": "},
        "config nested 10^5": {"file": "config.json", "text": "[" * 100_000 + "]" * 100_000},
        "index shard ../": {"file": "model.safetensors.index.json", "text": (folder / "model.safetensors.index.json")
                            .read_text().replace('"model-00001', '"../model-00001')},
    }


def test_fuzz_hostile_files_end_fast_in_bounded_memory_and_are_refused_cleanly(llama_gguf, mlx_folder, tmp_path):
    rng = np.random.default_rng(20261201)
    cases = []
    for name, m in structural_gguf_mutants(llama_gguf).items():
        cases.append({"id": f"gguf structural: {name}", "kind": "gguf", "file": "", "structural": True, **m})
    for i, m in enumerate(_random_gguf_mutants(llama_gguf, rng, 140)):
        cases.append({"id": f"gguf random #{i}", "kind": "gguf", "file": "", "structural": False, **m})
    for name, m in _structural_mlx_mutants(mlx_folder).items():
        cases.append({"id": f"mlx structural: {name}", "kind": "mlx", "structural": True, "patches": [], **m})
    for i, m in enumerate(_random_mlx_mutants(mlx_folder, rng, 66)):
        cases.append({"id": f"mlx random #{i}", "kind": "mlx", "structural": False, "patches": [], **m})
    spec = {"base": {"gguf": str(llama_gguf), "mlx": str(mlx_folder)}, "time_limit": FUZZ_TIME_LIMIT_S,
            "max_converts": FUZZ_MAX_CONVERTS, "cases": cases}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, str(TESTS / "hostile_worker.py"), str(tmp_path / "cases.json"),
                           str(tmp_path / "results.json")], env=env, capture_output=True, text=True, timeout=240,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30)))
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["intact"] == {"gguf": ["accepted"] * 3, "mlx": ["accepted"] * 2}
    by_id = {c["id"]: c for c in cases}
    bad, not_refused = [], []
    for r in results["cases"]:
        if any(o.startswith("bad") for o in r["outcomes"]):
            bad.append((r["id"], r["outcomes"]))
        if by_id[r["id"]]["structural"] and r["outcomes"][0] != "refused":
            not_refused.append((r["id"], r["outcomes"]))
    assert not bad, bad[:10]
    assert not not_refused, not_refused
    max_s = max(r["seconds"] for r in results["cases"])
    max_rss = max(r["rss_mb"] for r in results["cases"])
    assert max_s < FUZZ_TIME_LIMIT_S
    assert max_rss - results["baseline_rss_mb"] < FUZZ_RSS_GROWTH_MB
    for r in results["cases"]:
        assert r["traced_peak_bytes"] <= FUZZ_TRACED_FACTOR * r["file_bytes"] + 16 * 2**20, r
    refused = sum(r["outcomes"][0] == "refused" for r in results["cases"])
    print(f"\nfuzz: {len(cases)} cases, {refused} refused cleanly, {len(cases) - refused} accepted, 0 bad; "
          f"max {max_s:.2f} s per case, peak RSS {max_rss:.0f} MB (baseline {results['baseline_rss_mb']:.0f} MB), "
          f"max traced {max(r['traced_peak_bytes'] for r in results['cases']) / 2**20:.1f} MiB; wall {wall:.1f} s")


_TRUNCATED_AFTER_OPEN = r"""
import os, sys, transformers
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
f = GGUFFile(sys.argv[1])
model = transformers.LlamaForCausalLM(llama_config_from_gguf(f))
os.truncate(sys.argv[1], int(sys.argv[2]))  # another process cuts the file short while it is open
try:
    load_gguf_llama(model, f)
except ValueError as e:
    print(type(e).__name__, e)
"""


_TENSOR_READ_AFTER_CUT = r"""
import os, sys
from torch_qmm.interop import gguf
f = gguf.GGUFFile(sys.argv[1])
# the last Q4_K / Q6_K matrix (NATIVE_TYPES: every function below takes it); the file is cut a page
# before its bytes, so that reading them would touch no mapped page of the file
t = max((t for t in f.tensors.values() if t.type_name in ("Q4_K", "Q6_K")), key=lambda t: t.data.ctypes.data)
start = t.data.ctypes.data - f._map.ctypes.data
read = {"raw": lambda: t.raw.sum(), "dequantize": lambda: gguf.dequantize(t),
        "linear_from_gguf": lambda: gguf.linear_from_gguf(t), "check_finite": lambda: gguf.check_finite(t, 2**20),
        "to_blocks": lambda: gguf.to_blocks(t)}[sys.argv[2]]
os.truncate(sys.argv[1], start // 4096 * 4096 - 4096)  # another process cuts the file short
try:
    read()
except ValueError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("read", ["raw", "dequantize", "linear_from_gguf", "check_finite", "to_blocks"])
def test_a_tensor_of_a_file_cut_short_is_an_error_not_a_crash(llama_gguf, tmp_path, read):
    """Each way a tensor's bytes are read (the public per-tensor functions, and `raw` itself) checks
    the file first (in a child process: a SIGBUS shows as its exit code)."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(llama_gguf, path)
    size = path.stat().st_size
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.run([sys.executable, "-c", _TENSOR_READ_AFTER_CUT, str(path), read],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    now = path.stat().st_size
    assert 0 < now < size
    assert p.stdout.strip() == (f"GGUFFormatError {path}: the file is now {now} bytes, shorter than the {size} it "
                                "had when opened (truncated or rewritten since): open it again once it is complete")


def test_a_file_cut_short_after_it_was_opened_is_an_error_not_a_crash(llama_gguf, tmp_path):
    """Its tensors are views of the memory-mapped file: a read past the new end would kill the
    process (SIGBUS); the loader checks the file's size before each tensor (in a child process, so
    that a failure shows as its exit code)."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(llama_gguf, path)
    size = path.stat().st_size
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.run([sys.executable, "-c", _TRUNCATED_AFTER_OPEN, str(path), str(size // 2)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.strip() == (f"GGUFFormatError {path}: the file is now {size // 2} bytes, shorter than the {size} it "
                                "had when opened (truncated or rewritten since): open it again once it is complete")
