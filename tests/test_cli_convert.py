"""`convert`: never destroys user data, converts losslessly unless asked, says what it did per
layer, and reports bad input in one line with exit code 1 (file) or 2 (argument)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from torch_qmm.__main__ import main
from torch_qmm.interop import QuantEmbedding, TiedQuantLinear, parse_quantization

transformers = pytest.importorskip("transformers")
from test_interop_gguf_llama import hf_model, write_llama_gguf  # noqa: E402


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("src") / "hf"
    hf_model(tied=True).save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"tok": 1}')
    return folder


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_llama_gguf(hf_model(tied=False), path, {"q_proj": T.Q8_0, "k_proj": T.Q4_K, "v_proj": T.Q6_K, "embed": T.Q4_0,
                                                  "lm_head": T.Q8_0}, np.random.default_rng(0))
    return path


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _report(text: str) -> dict[str, str]:
    return {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.startswith("  ")}


# --- D: user data ---------------------------------------------------------------------------


def test_a_non_empty_destination_is_refused_without_overwrite(hf_folder, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep me")
    assert main(["convert", str(hf_folder), str(dst)]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert _tree(dst) == {"mine.txt": b"keep me"}


def test_overwrite_replaces_the_destination_only_when_the_new_one_is_complete(hf_folder, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    assert main(["convert", str(hf_folder), str(dst), "--overwrite"]) == 0
    assert not (dst / "old.txt").exists() and (dst / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folders left


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_convert_never_writes_into_its_source(hf_folder, tmp_path, where, capsys):
    src = tmp_path / "hf"
    import shutil

    shutil.copytree(hf_folder, src)
    before = _tree(src)
    dst = {"same": src, "inside": src / "out", "parent": tmp_path}[where]
    assert main(["convert", str(src), str(dst), "--overwrite"]) == 2
    assert "convert never writes into its source" in capsys.readouterr().err
    assert _tree(src) == before


def test_a_failed_conversion_leaves_nothing_behind_and_keeps_the_old_destination(hf_folder, tmp_path, capsys):
    src = tmp_path / "hf"
    import shutil

    shutil.copytree(hf_folder, src)
    (src / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}")  # a header claiming more than is there
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    assert main(["convert", str(src), str(dst), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert str(src / "model.safetensors") in err and len(err.splitlines()) == 1
    assert _tree(dst) == {"old.txt": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
    # and a new nested destination is not created when the run fails
    assert main(["convert", str(src), str(tmp_path / "a" / "b" / "out")]) == 1
    assert not (tmp_path / "a").exists()


def test_gguf_to_transformers_keeps_a_pre_existing_dot_float_folder_of_the_user(gguf_path, tmp_path, capsys):
    dst = tmp_path / "out"
    (dst / ".float").mkdir(parents=True)
    (dst / ".float" / "mine").write_text("mine")
    assert main(["convert", str(gguf_path), str(dst), "--requantize", "all", "--bits", "8", "--group-size", "32"]) == 2
    assert (dst / ".float" / "mine").read_text() == "mine"  # refused: the destination is not empty


def test_symlinks_in_the_source_are_followed_only_inside_it(hf_folder, tmp_path, capsys):
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_folder, src)
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (src / "notes.txt").symlink_to(secret)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{src / 'notes.txt'}: a symbolic link to {secret}" in err and "outside the source folder" in err
    assert not (tmp_path / "out").exists()
    # a link to a file inside the source is copied as that file's contents
    (src / "notes.txt").unlink()
    (src / "notes.txt").symlink_to(src / "tokenizer.json")
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "notes.txt").is_symlink()
    assert (tmp_path / "out" / "notes.txt").read_text() == '{"tok": 1}'


def test_a_link_into_a_sibling_folder_whose_name_extends_the_source_is_refused(hf_folder, tmp_path, capsys):
    """hf-private/ is not inside hf/, though its path starts with hf's: compared by path parts."""
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_folder, src)
    (tmp_path / "hf-private").mkdir()
    secret = tmp_path / "hf-private" / "secret.txt"
    secret.write_text("private")
    (src / "notes.txt").symlink_to(secret)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    assert "outside the source folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_existing_empty_destination_is_used_without_overwrite(hf_folder, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    assert main(["convert", str(hf_folder), str(dst)]) == 0
    assert (dst / "config.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("existing", [False, True])
def test_an_error_while_writing_removes_the_partial_output(tmp_path, existing):
    """The conversion's own failures (after the destination checks) go through staged_output."""
    from torch_qmm.interop.output_folder import staged_output

    dst = tmp_path / "a" / "b" / "out"
    if existing:
        dst.mkdir(parents=True)
        (dst / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="failed half way"):
        with staged_output(dst) as partial:
            (partial / "model.safetensors").write_bytes(b"half")
            (partial / "sub").mkdir()
            raise RuntimeError("failed half way")
    if existing:
        assert _tree(tmp_path) == {"a/b/out/old.txt": b"old"}
        assert [p.name for p in dst.parent.iterdir()] == ["out"]
    else:
        assert list(tmp_path.iterdir()) == []  # the parents this run created are gone too


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_working_directory_as_destination_stays_the_same_folder(hf_folder, tmp_path, monkeypatch, overwrite, capsys):
    """`convert SRC .`: "." has no name or parent of its own; the output lands in the working
    directory itself (the same folder, so a shell standing in it sees the files), with nothing
    hidden left over; with --overwrite its old entries are replaced."""
    dst = tmp_path / "work"
    dst.mkdir()
    if overwrite:
        (dst / "old.txt").write_text("old")
        (dst / "old_dir").mkdir()
    inode = dst.stat().st_ino
    monkeypatch.chdir(dst)
    assert main(["convert", str(hf_folder), "."] + (["--overwrite"] if overwrite else [])) == 0, capsys.readouterr().err
    assert dst.stat().st_ino == inode and os.path.samefile(os.getcwd(), dst)
    assert (dst / "config.json").is_file() and (Path(".") / "config.json").is_file()
    assert not (dst / "old.txt").exists() and not (dst / "old_dir").exists()
    assert _hidden(dst) == [] and [p.name for p in tmp_path.iterdir()] == ["work"]


def test_a_destination_spelled_with_dot_dot_is_the_folder_it_names(hf_folder, tmp_path, monkeypatch, capsys):
    """`convert SRC out/sub/..` means out (not empty: it holds sub, so refused without --overwrite);
    `out/.` means out too, and so does `out/new/..` where out/new does not exist."""
    (tmp_path / "out" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(hf_folder), "out/sub/.."]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    (tmp_path / "out" / "sub").rmdir()
    assert main(["convert", str(hf_folder), "out/."]) == 0
    assert (tmp_path / "out" / "config.json").is_file() and _hidden(tmp_path / "out") == []
    # a missing folder before ".." is dropped with it, as the destination checks read the path
    (tmp_path / "out2").mkdir()
    assert main(["convert", str(hf_folder), "out2/new/.."]) == 0, capsys.readouterr().err
    assert (tmp_path / "out2" / "config.json").is_file() and not (tmp_path / "out2" / "new").exists()
    assert _hidden(tmp_path / "out2") == []


def test_a_failed_move_into_an_existing_destination_puts_the_old_entries_back(tmp_path, monkeypatch):
    """The last step into an existing folder is several renames; when one fails the new entries go
    back out, the old ones back in, and no hidden folder stays."""
    from torch_qmm.interop import output_folder

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    (dst / "config.json").write_text("old config")
    real_replace = os.replace

    def replace(a, b):
        if Path(b).name == "weights.bin" and Path(b).parent == dst:
            raise OSError(28, "No space left on device")
        return real_replace(a, b)

    monkeypatch.setattr(output_folder.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        with output_folder.staged_output(dst) as partial:
            (partial / "config.json").write_text("new config")
            (partial / "weights.bin").write_bytes(b"new")
    assert _tree(dst) == {"old.txt": b"old", "config.json": b"old config"} and _hidden(dst) == []


def test_saving_keeps_files_that_only_start_like_weight_files(tmp_path):
    """Stale weight files of an earlier save are removed; the user's look-alikes are not."""
    from torch_qmm.interop.safetensors_io import save_sharded

    mine = ["model.safetensors.bak", "model-00001-of-00002.safetensors.orig", "model.safetensors.index.json.old",
            "model.safetensorsx"]
    for name in mine:
        (tmp_path / name).write_text("mine")
    (tmp_path / "model-00001-of-00002.safetensors").write_text("stale shard")
    save_sharded({"w": torch.zeros(4)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(mine + ["model.safetensors"])


def test_saved_shards_hold_at_most_the_size_asked_for(tmp_path):
    """save_sharded fills each shard in order up to max_shard_bytes (exactly up to it where the
    tensors add up to it); a tensor larger than the limit gets a shard of its own, and no shard is
    empty. The shards are read back with safetensors and the index checked against them."""
    import json

    from safetensors import safe_open

    from torch_qmm.interop.safetensors_io import save_sharded

    limit = 1000
    numels = {"big": 300, "a": 100, "b": 100, "c": 50, "full": 250, "last": 1}  # float32: 4 bytes each
    tensors = {name: torch.arange(n, dtype=torch.float32) + i for i, (name, n) in enumerate(numels.items())}
    names = save_sharded(tensors, tmp_path, max_shard_bytes=limit)
    held = []
    for name in names:
        with safe_open(str(tmp_path / name), framework="pt") as f:
            held.append({k: f.get_tensor(k) for k in f.keys()})
    sizes = [sum(t.numel() * t.element_size() for t in shard.values()) for shard in held]
    for keys, size in zip(held, sizes):
        assert size <= limit or len(keys) == 1, (sorted(keys), size)
    # big (1200 bytes) alone; a + b + c = 1000 bytes, the limit; full (1000) alone, as no other fits beside it
    assert [list(shard) for shard in held] == [["big"], ["a", "b", "c"], ["full"], ["last"]]
    assert sizes == [1200, 1000, 1000, 4]
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    for shard in held:
        for k, t in shard.items():
            assert torch.equal(t, tensors[k]), k
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes)
    assert index["weight_map"] == {k: name for name, shard in zip(names, held) for k in shard}


def test_a_hugging_face_cache_snapshot_converts_with_its_links_into_blobs(hf_folder, tmp_path, capsys):
    """<repo>/snapshots/<rev>/* are links into <repo>/blobs: followed, and copied as files."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in hf_folder.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    assert main(["convert", str(snap), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_text() == '{"tok": 1}' and not (out / "tokenizer.json").is_symlink()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # a normal folder, not mkdtemp's private 0700


def test_written_files_get_the_umask_modes_of_new_files(gguf_path, tmp_path, capsys):
    """The weights too: safetensors' own writer would leave model.safetensors 0600 (owner only)."""
    old = os.umask(0o022)
    try:
        for fmt in ("mlx", "transformers"):
            out = tmp_path / fmt
            extra = [] if fmt == "mlx" else ["--requantize", "all", "--bits", "8", "--group-size", "32"]
            assert main(["convert", str(gguf_path), str(out), "--format", fmt, *extra]) == 0
            modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
            assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    finally:
        os.umask(old)


# --- B8: lossless by default, flags only where they apply, a per-layer report ----------------


def test_gguf_to_mlx_is_lossless_by_default_and_reports_each_layer(gguf_path, tmp_path, capsys):
    out = tmp_path / "mlx"
    assert main(["convert", str(gguf_path), str(out), "--format", "mlx"]) == 0
    text = capsys.readouterr().out
    report = _report(text)
    assert report["model.layers.0.self_attn.q_proj"] == "lossless Q8_0 -> affine b8 gs32"
    assert report["model.layers.0.self_attn.k_proj"] == "lossless Q4_K -> affine b4 gs32"
    assert report["model.embed_tokens"] == "lossless Q4_0 -> affine b4 gs32"
    assert report["model.layers.0.self_attn.v_proj"].startswith("decoded Q6_K -> float float32 (as gguf decodes it")
    assert report["model.layers.0.mlp.up_proj"] == "kept F32 -> float float32"
    assert "group_size=64" not in text and "bits=4," not in text  # no format this run did not use
    _, overrides = parse_quantization(json.loads((out / "config.json").read_text()))
    assert overrides["model.layers.0.self_attn.v_proj"] is False  # stored float, as reported


def test_gguf_requantize_rest_uses_the_flags_for_layers_without_an_exact_form(gguf_path, tmp_path, capsys):
    out = tmp_path / "mlx"
    assert main(["convert", str(gguf_path), str(out), "--format", "mlx", "--requantize", "rest", "--bits", "3",
                 "--group-size", "128"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.layers.0.self_attn.v_proj"] == "re-quantized Q6_K -> affine b3 gs128"
    assert report["model.layers.0.mlp.up_proj"] == "re-quantized F32 -> affine b3 gs128"
    assert report["model.layers.0.self_attn.q_proj"] == "lossless Q8_0 -> affine b8 gs32"
    default, overrides = parse_quantization(json.loads((out / "config.json").read_text()))
    spec = overrides.get("model.layers.0.self_attn.v_proj", default)
    assert (spec.bits, spec.group_size) == (3, 128)


def test_gguf_to_transformers_reports_why_the_embedding_is_float(gguf_path, tmp_path, capsys):
    """Under --requantize all the transformers format leaves the embedding and the output head
    float; the report says why and that without --requantize they stay exact, instead of
    suggesting --requantize rest (which would not quantize them either)."""
    assert main(["convert", str(gguf_path), str(tmp_path / "hf"), "--requantize", "all", "--bits", "8",
                 "--group-size", "32"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.layers.0.self_attn.q_proj"] == "re-quantized Q8_0 -> affine b8 gs32"
    assert report["model.embed_tokens"] == (
        "decoded Q4_0 -> float float32 (as gguf decodes it; --requantize all leaves the embedding float in the "
        "transformers format; without --requantize it stays Q4_0, exact)")
    assert report["lm_head"] == (
        "decoded Q8_0 -> float float32 (as gguf decodes it; --requantize all leaves the output head float in the "
        "transformers format; without --requantize it stays Q8_0, exact)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_q4_k_layers_are_reported_lossless_only_when_biases_survive_the_dtype_too(dtype):
    """Blocks whose scales d*sc are exact in the dtype (d = 1, sc = 1) but whose biases -dmin*m are
    not (dmin = 1 + 2^-10 has 11 significant bits, m = 63): the layer is not lossless."""
    from torch_qmm.interop.cli_convert import _k_affine

    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype="<f2").view(np.uint8)  # d
    block[2:4] = np.array([1 + 2**-10], dtype="<f2").view(np.uint8)  # dmin
    block[4:8] = 0x01  # sc of sub-blocks 0-3
    block[8:12] = 0x3F  # m of sub-blocks 0-3
    block[12:16] = 0xF1  # sc (low nibble) and m (high nibble) of sub-blocks 4-7
    block[16:] = np.arange(128, dtype=np.uint8)
    blocks = torch.from_numpy(np.tile(block, (2, 1)))
    _, scales, biases, exact = _k_affine(blocks, 2, 256, 12, dtype, "layer")
    assert torch.equal(scales.float(), torch.ones(2, 8))
    assert biases.float()[0, 0] != -(1 + 2**-10) * 63  # rounded: the premise of the test
    assert exact is False
    assert _k_affine(blocks, 2, 256, 12, torch.float32, "layer")[3] is True


def test_convert_reports_the_k_quants_without_an_affine_form_as_float_naming_how_to_quantize(tmp_path, capsys):
    """Q2_K / Q3_K layers and a Q3_K embedding have no exact affine form: both formats write them
    float (as gguf decodes them) and say that --requantize rest quantizes them; Q4_K / Q5_K are
    written exactly."""
    from test_interop_gguf_llama import MIXES

    path = tmp_path / "m.gguf"
    write_llama_gguf(hf_model(False), path, MIXES["q3_k_m"], np.random.default_rng(4))
    assert main(["convert", str(path), str(tmp_path / "hf")]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.embed_tokens"] == (
        "decoded Q3_K -> float float32 (as gguf decodes it; no exact affine form, and the transformers format "
        "quantizes no float embedding: --format mlx --requantize rest quantizes it)")
    assert report["model.layers.0.mlp.down_proj"] == (
        "decoded Q2_K -> float float32 (as gguf decodes it; no exact affine form: --requantize rest quantizes it)")
    assert report["model.layers.0.self_attn.v_proj"] == "lossless Q5_K -> affine b5 gs32"
    assert report["model.layers.0.self_attn.o_proj"] == "lossless Q4_K -> affine b4 gs32"
    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.embed_tokens"] == (
        "decoded Q3_K -> float float32 (as gguf decodes it; no exact affine form: --requantize rest quantizes it)")


def test_convert_of_lattice_i_quants_writes_them_float_or_requantized(tmp_path, capsys):
    """The lattice i-quants (IQ1_S .. IQ3_S) have no exact affine form: --format mlx writes them float,
    as gguf decodes them (the saved weights equal gguf's decode), naming --requantize rest, which
    quantizes them."""
    from safetensors.torch import load_file
    from test_interop_gguf_llama import MIXES

    path = tmp_path / "m.gguf"
    held = write_llama_gguf(hf_model(False), path, MIXES["iq_lattice"], np.random.default_rng(5))
    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    report = _report(capsys.readouterr().out)
    for name, qtype in (("self_attn.o_proj", "IQ2_XXS"), ("mlp.gate_proj", "IQ1_S"), ("mlp.down_proj", "IQ3_XXS")):
        assert report[f"model.layers.0.{name}"] == (
            f"decoded {qtype} -> float float32 (as gguf decodes it; no exact affine form: --requantize rest quantizes it)")
    saved = load_file(str(tmp_path / "mlx" / "model.safetensors"))
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"], held["model.layers.0.mlp.up_proj.weight"])  # IQ2_S
    assert main(["convert", str(path), str(tmp_path / "mlx4"), "--format", "mlx", "--requantize", "rest", "--bits", "4"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.layers.0.mlp.up_proj"].startswith("re-quantized IQ2_S -> affine b4")


def test_gguf_to_transformers_of_a_tied_model_keeps_the_head_tied_to_the_file_embedding(tmp_path, capsys):
    import transformers

    import torch_qmm.interop.transformers  # noqa: F401  (registers the quantizer for from_pretrained)
    from torch_qmm.interop.gguf import GGUFFile, dequantize

    path = tmp_path / "tied.gguf"
    write_llama_gguf(hf_model(tied=True), path, {"proj": T.Q8_0, "embed": T.Q8_0}, np.random.default_rng(1))
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out), "--requantize", "all", "--bits", "8", "--group-size", "32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    embedding = dequantize(GGUFFile(path).tensors["token_embd.weight"])  # gguf's decoder, float32
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert torch.equal(model.lm_head.weight, embedding)
    ids = torch.tensor([[1, 5, 9, 2]])
    hidden = model.model(ids).last_hidden_state
    torch.testing.assert_close(model(ids).logits, hidden @ embedding.T)


# --- GGUF -> transformers keeps the exact layers -------------------------------------------------

# One layer of every kind: exact affine forms (Q8_0, Q4_0, Q4_K, Q5_1), none (Q6_K) and float (F16, F32).
_HF_MIX = {"q_proj": T.Q8_0, "k_proj": T.Q4_K, "v_proj": T.Q6_K, "o_proj": T.Q4_0, "gate_proj": T.Q5_1,
           "up_proj": T.F16, "embed": T.Q4_0, "lm_head": T.Q6_K}
_EXACT = {"q_proj": (8, "Q8_0"), "k_proj": (4, "Q4_K"), "o_proj": (4, "Q4_0"), "gate_proj": (5, "Q5_1")}
_FLOAT = {"v_proj": "Q6_K", "up_proj": "F16", "down_proj": "F32"}


def _module(model, key: str):
    return model.get_submodule(key.removesuffix(".weight"))


def _gguf_reference(path, tied: bool, dtype=torch.float32):
    """The GGUF model as load_gguf_llama builds it (GGUFLinear / QuantLinear / QuantEmbedding)."""
    from torch_qmm.interop.gguf import GGUFFile
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama

    f = GGUFFile(path)
    model = transformers.LlamaForCausalLM(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f, dtype=dtype)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_mix_gguf(request, tmp_path_factory):
    """(path, held, tied): a llama GGUF of _HF_MIX; held: hf name -> gguf.quants.dequantize of the
    file's tensor (float32, the Q/K permutation undone)."""
    tied = request.param
    path = tmp_path_factory.mktemp("hfmix") / "m.gguf"
    held = write_llama_gguf(hf_model(tied=tied), path, _HF_MIX, np.random.default_rng(11))
    return path, held, tied


def test_gguf_to_transformers_is_lossless_by_default(hf_mix_gguf, tmp_path, capsys):
    """No flag: the folder from_pretrained reloads holds the file's weights. Compared with gguf's
    own decoder (held), in float64: Q8_0 / Q4_0 / Q5_1 decode as d*q (+ m), exact in float32 too,
    so they are equal in float64; Q4_K decodes as d*sc*q - dmin*m, exact products but a float32
    subtraction in gguf, so our exact float64 value rounds to gguf's float32 one (within half a
    float32 ulp, and bit for bit once rounded)."""
    import torch_qmm.interop.transformers  # noqa: F401  (registers the quantizer for from_pretrained)
    from torch_qmm import reference
    from torch_qmm.nn import QuantLinear

    path, held, tied = hf_mix_gguf
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out)]) == 0
    report = _report(capsys.readouterr().out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for key, want in held.items():
        module = _module(model, key)
        proj = key.split(".")[-2]
        if key.endswith("_proj.weight") and proj in _EXACT:
            bits, kind = _EXACT[proj]
            assert isinstance(module, QuantLinear), key
            assert (module.bits, module.group_size, module.mode, module.scales.dtype) == (
                bits, 32, "affine", torch.float32), key
            w = reference.dequantize(module.qweight, module.scales, module.biases, bits, 32)
            if kind == "Q4_K":
                ulp = torch.finfo(torch.float32).eps * want.double().abs().clamp_min(torch.finfo(torch.float32).tiny)
                assert ((w - want.double()).abs() <= ulp / 2).all(), key
                assert torch.equal(w.float(), want), key
            else:
                assert torch.equal(w, want.double()), key
            assert report[key.removesuffix(".weight")] == f"lossless {kind} -> affine b{bits} gs32"
        elif key == "model.embed_tokens.weight":  # Q4_0: the affine embedding, bit for bit
            assert isinstance(module, QuantEmbedding), key
            assert (module.bits, module.group_size, module.mode) == (4, 32, "affine"), key
            w = reference.dequantize(module.qweight, module.scales, module.biases, 4, 32)
            assert torch.equal(w, want.double()), key
        elif key.endswith(".weight") and want.dim() == 2:  # the float layers: Q6_K, F16, F32, head
            assert type(module) is torch.nn.Linear, key
            assert torch.equal(module.weight.detach(), want), key
        else:  # norms
            assert torch.equal(model.get_parameter(key).detach(), want), key
    assert report["model.layers.1.self_attn.v_proj"].startswith("decoded Q6_K -> float float32 (as gguf decodes it;")
    assert report["model.layers.1.mlp.up_proj"] == "kept F16 -> float float32"
    assert report["model.embed_tokens"] == "lossless Q4_0 -> affine b4 gs32"
    if tied:
        assert isinstance(model.lm_head, TiedQuantLinear) and model.lm_head.embedding is model.model.embed_tokens
        assert report["lm_head"] == "tied to the embedding (affine b4 gs32)"
    else:
        assert report["lm_head"].startswith("decoded Q6_K -> float float32 (as gguf decodes it; no exact affine "
                                             "form, and the transformers format quantizes no output head")
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "torch_qmm" and (saved["group_size"], saved["mode"]) == (32, "affine")
    # the four exact projections of both layers and the embedding, each with its bits
    assert len(saved["bits"]) == 4 * 2 + 1 and saved["embeddings"] == ["model.embed_tokens"]

    # The logits of the GGUF model as load_gguf_llama builds it. Both hold the same weights exactly;
    # they differ only in their float32 kernels' summation order (gguf_qmm for Q4_K / Q6_K, the
    # affine kernel, F.linear), a few float32 ulps of sums over 256 or 512 terms per layer: 1e-4 of
    # the largest logit is a hundred times that, and far below the effect of one rounded weight.
    ids = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2]])
    with torch.no_grad():
        got, want = model(ids).logits, _gguf_reference(path, tied)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_gguf_requantize_rest_to_transformers_quantizes_the_rest_and_keeps_the_exact_layers(
        hf_mix_gguf, tmp_path, capsys):
    """--requantize rest --bits 6: the Q6_K / F16 / F32 linear layers become 6-bit layers of group
    size 32 (rtn of gguf's decoded weights, MLX's quantizer); the exact layers keep the file's
    values (the Q4_0 embedding too), the Q6_K output head stays float."""
    import torch_qmm.interop.transformers  # noqa: F401
    from torch_qmm import reference
    from torch_qmm.nn import QuantLinear
    from torch_qmm.ops import quantize

    path, held, tied = hf_mix_gguf
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out), "--requantize", "rest", "--bits", "6"]) == 0
    report = _report(capsys.readouterr().out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    for layer in range(2):
        for proj, kind in _FLOAT.items():
            key = f"model.layers.{layer}.{'self_attn' if proj == 'v_proj' else 'mlp'}.{proj}"
            m = model.get_submodule(key)
            assert isinstance(m, QuantLinear) and (m.bits, m.group_size) == (6, 32), key
            wq, scales, biases = quantize(held[f"{key}.weight"], group_size=32, bits=6)
            assert torch.equal(m.qweight, wq) and torch.equal(m.scales, scales) and torch.equal(m.biases, biases), key
            assert report[key] == f"re-quantized {kind} -> affine b6 gs32"
        for proj, (bits, kind) in _EXACT.items():
            key = f"model.layers.{layer}.{'mlp' if proj == 'gate_proj' else 'self_attn'}.{proj}"
            m = model.get_submodule(key)
            assert isinstance(m, QuantLinear) and (m.bits, m.group_size) == (bits, 32), key
            w = reference.dequantize(m.qweight, m.scales, m.biases, bits, 32).float()
            assert torch.equal(w, held[f"{key}.weight"]), key
            assert report[key] == f"lossless {kind} -> affine b{bits} gs32"
    emb = model.model.embed_tokens  # Q4_0: exact, as without --requantize
    assert isinstance(emb, QuantEmbedding) and (emb.bits, emb.group_size) == (4, 32)
    assert torch.equal(reference.dequantize(emb.qweight, emb.scales, emb.biases, 4, 32).float(),
                       held["model.embed_tokens.weight"])
    if tied:
        assert isinstance(model.lm_head, TiedQuantLinear) and model.lm_head.embedding is emb
    else:  # Q6_K: no exact form, and the transformers format quantizes no head
        assert type(model.lm_head) is torch.nn.Linear
        assert torch.equal(model.lm_head.weight.detach(), held["lm_head.weight"])


def test_gguf_requantize_rest_to_transformers_takes_any_group_size_without_exact_layers(tmp_path, capsys):
    """A float GGUF has no exact layer for the rest to join: --group-size 64 is used as asked."""
    import torch_qmm.interop.transformers  # noqa: F401
    from torch_qmm.nn import QuantLinear

    path = tmp_path / "f.gguf"
    write_llama_gguf(hf_model(tied=False), path, {"proj": T.F16}, np.random.default_rng(2))
    assert main(["convert", str(path), str(tmp_path / "hf"), "--requantize", "rest", "--group-size", "64"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    q = model.model.layers[0].mlp.down_proj
    assert isinstance(q, QuantLinear) and (q.bits, q.group_size) == (4, 64)


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_gguf_float_layers_are_reported_rounded_exactly_when_the_dtype_rounds_them(tmp_path, capsys, dtype):
    """BF16 and F16 tensors of a GGUF kept float: float32 holds both exactly, float16 holds F16
    and rounds BF16, bfloat16 holds BF16 and rounds F16; the report says "rounded" for exactly
    those casts."""
    path = tmp_path / "f.gguf"
    write_llama_gguf(hf_model(tied=False), path, {"up_proj": T.BF16, "down_proj": T.F16}, np.random.default_rng(3))
    assert main(["convert", str(path), str(tmp_path / "hf"), *(["--dtype", dtype] if dtype else [])]) == 0
    report = _report(capsys.readouterr().out)
    dtype = dtype or "float32"
    for src, exact_in in (("BF16", {"float32", "bfloat16"}), ("F16", {"float32", "float16"})):
        proj = "up_proj" if src == "BF16" else "down_proj"
        rounded = "" if dtype in exact_in else f" (rounded to {dtype})"
        assert report[f"model.layers.0.mlp.{proj}"] == f"kept {src} -> float {dtype}{rounded}", report


def test_gguf_to_transformers_refuses_to_write_a_folder_its_config_cannot_describe(hf_mix_gguf, tmp_path, capsys,
                                                                                   monkeypatch):
    """Should layers of two group sizes reach the writer, the run fails naming why and leaves no
    folder (from_pretrained would rebuild some of them wrong)."""
    from torch_qmm.interop import cli_convert

    monkeypatch.setattr(cli_convert, "_rest_group_size", lambda args, f, group_size: group_size)
    path, _, _ = hf_mix_gguf
    assert main(["convert", str(path), str(tmp_path / "hf"), "--requantize", "rest", "--group-size", "64"]) == 1
    err = capsys.readouterr().err
    assert "a transformers quantization_config cannot describe the converted layers" in err
    assert "more than one group size" in err and "--format mlx" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gguf_to_transformers_with_a_16_bit_dtype_names_the_layers_no_longer_exact(hf_mix_gguf, tmp_path, capsys,
                                                                                   dtype):
    """Q4_K scales d*sc and biases dmin*m have up to 17 significant bits: rounded in float16 and
    bfloat16. The other types' float16 d (and m) are exact in float16 but rounded in bfloat16. The
    report names exactly those layers, and the folder holds the rounded scales."""
    import torch_qmm.interop.transformers  # noqa: F401
    from torch_qmm.interop.gguf import GGUFFile, q4_k_to_affine, to_blocks
    from torch_qmm.interop.gguf_llama import unpermute_rows
    from torch_qmm.nn import QuantLinear

    path, _, tied = hf_mix_gguf
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out), "--dtype", dtype]) == 0
    text = capsys.readouterr().out
    report = _report(text)
    rounded_types = {"Q4_K"} if dtype == "float16" else {"Q4_K", "Q8_0", "Q4_0", "Q5_1"}
    for layer in range(2):
        for proj, (bits, kind) in _EXACT.items():
            key = f"model.layers.{layer}.{'mlp' if proj == 'gate_proj' else 'self_attn'}.{proj}"
            how = f"{kind} scales rounded to {dtype}" if kind in rounded_types else f"lossless {kind}"
            assert report[key] == f"{how} -> affine b{bits} gs32", key
    names = ", ".join(sorted(rounded_types))
    assert f"({names} scales/biases rounded to the --dtype: use --dtype float32 for exact {names} layers)" in text
    assert report["model.layers.0.mlp.down_proj"] == f"kept F32 -> float {dtype} (rounded to {dtype})"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    k = model.model.layers[0].self_attn.k_proj
    assert isinstance(k, QuantLinear) and k.scales.dtype == getattr(torch, dtype)
    _, s32, _ = q4_k_to_affine(to_blocks(GGUFFile(path).tensors["blk.0.attn_k.weight"]), 128, 256)
    assert torch.equal(k.scales, s32[unpermute_rows(128, 2)].to(k.scales.dtype))  # K's rows in transformers' order

    # Logits: 16-bit arithmetic rounds every activation (float16 keeps 11 significant bits, bfloat16
    # 8), so neither model gives the float32 logits. The GGUF model in the same dtype (Q4_K blocks
    # exact) measures that arithmetic's error; the folder's model, whose rounded scales add a
    # smaller one, stays within twice it of the float32 logits of the file.
    ids = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2]])
    with torch.no_grad():
        exact = _gguf_reference(path, tied)(ids).logits
        same_dtype = _gguf_reference(path, tied, getattr(torch, dtype))(ids).logits.float()
        got = model.eval()(ids).logits.float()
    assert (got - exact).abs().max() <= 2 * (same_dtype - exact).abs().max()


def test_affine_exact_checks_every_float16_field_of_the_blocks():
    """d (and Q4_1's m) must survive the cast: d = 1 + 2^-10 needs 11 significant bits (float16
    has them, bfloat16 has 8); d = 0.5 is exact in every dtype."""
    from gguf.constants import GGML_QUANT_SIZES

    from torch_qmm.interop.gguf import GGUFTensor, affine_exact

    def blocks(ggml_type, d, m=0.0):
        b = np.zeros((2, GGML_QUANT_SIZES[ggml_type][1]), np.uint8)
        b[1, 0:2] = np.array([d], "<f2").view(np.uint8)
        b[1, 2:4] = np.array([m], "<f2").view(np.uint8)  # Q4_1's m; Q8_0 / Q4_0 codes
        return GGUFTensor("w", int(ggml_type), (1, 64), b.reshape(1, -1))

    assert affine_exact(blocks(T.Q8_0, 1 + 2**-10), torch.float16)
    assert not affine_exact(blocks(T.Q8_0, 1 + 2**-10), torch.bfloat16)
    assert affine_exact(blocks(T.Q8_0, 0.5, m=1 + 2**-10), torch.bfloat16)  # those bytes are codes there
    assert not affine_exact(blocks(T.Q4_1, 0.5, m=1 + 2**-10), torch.bfloat16)
    assert affine_exact(blocks(T.Q4_1, 0.5, m=0.25), torch.bfloat16)
    assert affine_exact(blocks(T.Q4_0, 1 + 2**-10), torch.float32)


@pytest.mark.parametrize("argv, message", [
    (["--format", "mlx", "--bits", "3", "--group-size", "128"],
     "--bits and --group-size apply only to re-quantization"),
    (["--format", "mlx", "--bits", "3"], "--bits applies only to re-quantization"),
    (["--bits", "8"], "--bits applies only to re-quantization"),
    (["--method", "mse"], "--method applies only to re-quantization"),
    (["--format", "mlx", "--method", "gptq", "--calibration", __file__],
     "--method and --calibration apply only to re-quantization"),
    (["--requantize", "rest", "--group-size", "64"], "so --group-size 64 cannot join them. Pass --group-size 32"),
    (["--requantize", "rest", "--mode", "mxfp4"], "so --mode mxfp4 cannot join them. Pass --mode affine"),
])
def test_gguf_flags_that_do_not_apply_are_usage_errors(gguf_path, tmp_path, argv, message, capsys):
    assert main(["convert", str(gguf_path), str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_gguf_whose_only_exact_layer_is_the_embedding_requantizes_the_rest_at_its_group_size(tmp_path, capsys):
    """The transformers format keeps an exact embedding (Q8_0: affine, group size 32), so
    --requantize rest of a file whose only exact layer is the embedding joins it at group size 32
    (one quantization_config holds one group size): another --group-size is the usage error that
    names the exact layer, and the default writes a folder whose layers from_pretrained rebuilds at
    group size 32."""
    from torch_qmm.nn import QuantLinear

    write_llama_gguf(hf_model(tied=False), tmp_path / "m.gguf", {"embed": T.Q8_0}, np.random.default_rng(0))
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "gs64"), "--requantize", "rest",
                 "--group-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "--requantize rest keeps 1 layers exact (Q8_0: affine, group size 32)" in err, err
    assert "so --group-size 64 cannot join them" in err and not (tmp_path / "gs64").exists()
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--requantize", "rest"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(reloaded.model.embed_tokens, QuantEmbedding) and reloaded.model.embed_tokens.bits == 8
    assert {m.group_size for m in reloaded.modules() if isinstance(m, (QuantLinear, QuantEmbedding))} == {32}


def test_requantize_on_a_float_folder_is_a_usage_error(hf_folder, tmp_path, capsys):
    assert main(["convert", str(hf_folder), str(tmp_path / "out"), "--requantize", "all"]) == 2
    assert "--requantize applies to GGUF sources only" in capsys.readouterr().err


def test_float_folder_report_names_the_format_used(hf_folder, tmp_path, capsys):
    assert main(["convert", str(hf_folder), str(tmp_path / "out"), "--bits", "8", "--group-size", "32"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.layers.0.mlp.up_proj"] == "quantized float -> affine b8 gs32"
    assert report["lm_head"] == "tied to the embedding (float float32)"  # hf_folder's model is tied


def test_float_folder_report_summary_lists_each_format_once_without_the_reasons(hf_folder, tmp_path, capsys):
    """The closing line's formats are the rows' formats, each once, without the reason a row gives
    in parentheses: the embedding's "kept float float32 (the transformers format quantizes no float
    embedding; ...)" counts as "kept float float32" (the tied head's format is its whole row)."""
    assert main(["convert", str(hf_folder), str(tmp_path / "out"), "--bits", "8", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    report = _report(out)
    assert report["model.embed_tokens"].startswith("kept float float32 (the transformers format quantizes no float "
                                                   "embedding")
    summary = next(line for line in out.splitlines() if line.startswith(f"wrote {tmp_path / 'out'} "))
    assert summary.endswith(": 16 layers; formats: affine b8 gs32; kept float float32; tied to the embedding "
                            "(float float32)"), summary


def test_moe_folder_report_lists_the_experts_as_quantized(tmp_path, capsys):
    from moe_helpers import LAYERS, tiny_moe
    from torch_qmm.nn_moe import QuantFusedExperts

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--group-size", "32"]) == 0
    report = _report(capsys.readouterr().out)
    experts = [f"model.layers.{layer}.mlp.experts" for layer in range(LAYERS)]
    assert [report.get(name) for name in experts] == ["quantized float -> affine b4 gs32"] * LAYERS
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(isinstance(again.get_submodule(name), QuantFusedExperts) for name in experts)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_moe_folder_torch_qmm_quantized_converts_to_both_formats_keeping_its_experts(tmp_path, capsys, family):
    # save_pretrained stores a Mixtral block under its checkpoint name (block_sparse_moe, where the
    # model says mlp): the report looked the experts' scales up under the model's name (KeyError).
    from moe_helpers import LAYERS, tiny_moe
    from torch_qmm.convert import quantize_model

    model = tiny_moe(family)
    quantize_model(model, bits=4, group_size=64)
    model.save_pretrained(tmp_path / "q")
    for fmt in ("mlx", "transformers"):
        capsys.readouterr()
        assert main(["convert", str(tmp_path / "q"), str(tmp_path / fmt), "--format", fmt]) == 0
        report = _report(capsys.readouterr().out)
        experts = [f"model.layers.{layer}.mlp.experts" for layer in range(LAYERS)]
        assert [report.get(name) for name in experts] == ["lossless affine b4 gs64 -> affine b4 gs64"] * LAYERS


@pytest.fixture(scope="module")
def quantized_folder(hf_folder, tmp_path_factory):
    """hf_folder converted by torch_qmm with a format other than the defaults: affine b8 gs32."""
    folder = tmp_path_factory.mktemp("q") / "q8"
    assert main(["convert", str(hf_folder), str(folder), "--bits", "8", "--group-size", "32"]) == 0
    return folder


@pytest.mark.parametrize("argv, asked", [
    (["--bits", "4"], "--bits 4"),
    (["--format", "mlx", "--bits", "4"], "--bits 4"),
    (["--group-size", "64"], "--group-size 64"),
    (["--format", "mlx", "--mode", "mxfp4"], "--mode mxfp4"),
    (["--method", "mse"], "--method mse quantizes float weights"),
])
def test_a_folder_torch_qmm_quantized_is_not_re_quantized_to_another_format(quantized_folder, tmp_path, argv, asked,
                                                                             capsys):
    assert main(["convert", str(quantized_folder), str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert f"{quantized_folder} is already quantized by torch_qmm (affine b8 gs32)" in err and asked in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [[], ["--bits", "8", "--group-size", "32"]], ids=["defaults", "same-format"])
def test_a_folder_torch_qmm_quantized_is_re_saved_losslessly(quantized_folder, tmp_path, argv, capsys):
    from safetensors.torch import load_file

    assert main(["convert", str(quantized_folder), str(tmp_path / "out"), *argv]) == 0
    report = _report(capsys.readouterr().out)
    source, written = load_file(quantized_folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert source.keys() == written.keys() and all(torch.equal(source[k], written[k]) for k in source)
    layers = {k.rpartition(".")[0] for k in source if k.endswith(".qweight")}
    assert layers and {report[n] for n in layers} == {"lossless affine b8 gs32 -> affine b8 gs32"}


_LOAD_SCRIPT = r"""
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from torch_qmm.interop.cli_convert import from_pretrained
folder = Path(sys.argv[1])
state = from_pretrained(folder).state_dict()
stored = {k: t for k, t in load_file(folder / "model.safetensors").items() if not k.endswith("._extra_state")}
assert any(k.endswith(".qweight") for k in stored)
print("differ:", sorted(k for k, t in stored.items() if k not in state or not torch.equal(state[k], t)))
"""


def test_from_pretrained_loads_a_folder_torch_qmm_quantized_without_importing_the_quantizer(quantized_folder):
    """cli_convert.from_pretrained (the bench's loader too) registers quant_method "torch_qmm"
    itself: in a fresh interpreter that never imported torch_qmm.interop.transformers, every stored
    tensor is loaded (none initialised at random). The registration is per process, hence the child."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(quantized_folder)], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "differ: []" in p.stdout.splitlines()


def test_a_folder_torch_qmm_quantized_to_mlx_keeps_its_layers_and_format(quantized_folder, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert main(["convert", str(quantized_folder), str(out), "--format", "mlx"]) == 0
    report = _report(capsys.readouterr().out)
    source, written = load_file(quantized_folder / "model.safetensors"), load_file(out / "model.safetensors")
    layers = {k.rpartition(".")[0] for k in source if k.endswith(".qweight")}
    assert layers and {report[n] for n in layers} == {"lossless affine b8 gs32 -> affine b8 gs32"}
    for n in layers:
        assert all(torch.equal(source[f"{n}.{a}"], written[f"{n}.{b}"])
                   for a, b in (("qweight", "weight"), ("scales", "scales"), ("biases", "biases")))
    # the embedding, float in the source, takes the source's format: one format in the folder
    assert report["model.embed_tokens"] == "quantized float -> affine b8 gs32"
    assert written["model.embed_tokens.weight"].dtype == torch.uint32
    default, overrides = parse_quantization(json.loads((out / "config.json").read_text()))
    assert (default.bits, default.group_size, default.mode, overrides) == (8, 32, "affine", {})


def test_a_folder_of_per_layer_bits_names_its_format_when_another_is_asked(hf_folder, tmp_path, capsys):
    from torch_qmm.interop.transformers import TorchQmmConfig

    transformers.AutoModelForCausalLM.from_pretrained(hf_folder, quantization_config=TorchQmmConfig(
        bits={"*": 4, "model.layers.0.mlp.down_proj": 8}, group_size=32)).save_pretrained(tmp_path / "q")
    assert main(["convert", str(tmp_path / "q"), str(tmp_path / "out"), "--bits", "8"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'q'} is already quantized by torch_qmm (affine bits [4, 8] per layer gs32)" in err, err


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_quantized_embedding_of_a_torch_qmm_folder_is_reported_as_it_was_kept(hf_folder, tmp_path, capsys, dtype):
    """A folder whose embedding torch_qmm quantized (TorchQmmConfig(embeddings=...)) converted to
    MLX: the embedding keeps its format, and a --dtype that rounds its float32 scales says so."""
    from safetensors.torch import load_file
    from torch_qmm.interop.transformers import TorchQmmConfig

    transformers.AutoModelForCausalLM.from_pretrained(hf_folder, quantization_config=TorchQmmConfig(
        bits=8, group_size=32, embeddings=["model.embed_tokens"])).save_pretrained(tmp_path / "q")
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "q"), str(out), "--format", "mlx",
                 *(["--dtype", dtype] if dtype else [])]) == 0
    report = _report(capsys.readouterr().out)
    source, written = load_file(tmp_path / "q" / "model.safetensors"), load_file(out / "model.safetensors")
    assert torch.equal(source["model.embed_tokens.qweight"], written["model.embed_tokens.weight"])
    if dtype is None:
        assert report["model.embed_tokens"] == "lossless affine b8 gs32 -> affine b8 gs32"
        assert torch.equal(source["model.embed_tokens.scales"], written["model.embed_tokens.scales"])
    else:
        assert report["model.embed_tokens"] == "affine b8 gs32 scales rounded to bfloat16 -> affine b8 gs32"
        assert written["model.embed_tokens.scales"].dtype == torch.bfloat16


# --- E20: one line, exit codes, no traceback ---------------------------------------------------


@pytest.mark.parametrize("config, message", [
    ("{not json", "config.json: not valid JSON"),
    ('{"model_type": 3}', "config.json: field 'model_type' must be a string"),
    ("[" * 50_000 + "]" * 50_000, "config.json: JSON nested too deeply"),
])
def test_a_corrupt_config_json_is_one_line_naming_the_file(hf_folder, tmp_path, config, message, capsys):
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_folder, src)
    (src / "config.json").write_text(config)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert message in err and str(src) in err and len(err.splitlines()) == 1


def test_transformers_config_errors_name_the_folder(hf_folder, tmp_path, capsys):
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_folder, src)
    config = json.loads((src / "config.json").read_text())
    config["num_attention_heads"] = 0
    (src / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{src}: transformers could not build the model" in err and len(err.splitlines()) == 1


def test_the_cli_prints_no_traceback_unless_debug(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(40))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "torch_qmm", *a], capture_output=True, text=True, env=env)
    p = run("inspect", str(bad))
    assert p.returncode == 1 and "Traceback" not in p.stderr and str(bad) in p.stderr
    p = run("inspect", str(bad), "--debug")
    assert p.returncode == 1 and "Traceback" in p.stderr and "GGUFFormatError" in p.stderr


_SIGNAL_SCRIPT = r"""
import os, signal, sys
from torch_qmm.interop import output_folder
from torch_qmm.__main__ import main
sig = getattr(signal, sys.argv[1])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a test runner's worker may ignore it)
output_folder._umask_modes = lambda folder, umask: os.kill(os.getpid(), sig)  # once every file is written
sys.exit(main(["convert", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("sig, code, word", [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")])
def test_a_signal_while_writing_leaves_nothing_behind(hf_folder, tmp_path, sig, code, word):
    """kill / timeout (SIGTERM) and Ctrl-C (SIGINT) in the middle of writing: the partial output is
    removed, the destination is not created, and the exit code says which signal."""
    dst = tmp_path / "parent" / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT, sig, str(hf_folder), str(dst), "--bits", "4"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == code, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].endswith(word) and "Traceback" not in p.stderr
    assert not (tmp_path / "parent").exists(), list((tmp_path / "parent").iterdir())


_MEMORY_SCRIPT = r"""
import contextlib, io, json, os, sys, threading, time
import torch_qmm.interop.cli_convert  # noqa: F401  (imports done before the baseline)
from torch_qmm.__main__ import main

def rss():  # resident bytes now (Linux)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

small, big, out = sys.argv[1:4]
quiet = lambda: (contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()))
a, b = quiet()
with a, b:
    assert main(["convert", small, out + "-warm", "--format", "mlx"]) == 0  # first-use costs
before, peak, done = rss(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

t = threading.Thread(target=sample)
t.start()
a, b = quiet()
with a, b:
    rc = main(["convert", big, out, "--format", "mlx"])
done.set()
t.join()
print(json.dumps({"rc": rc, "growth": peak[0] - before}))
"""


def test_gguf_conversion_needs_a_small_multiple_of_the_file_size(gguf_path, tmp_path):
    """The model skeleton is never initialized in float: resident memory (sampled every 2 ms)
    grows by less than 4x the file during the conversion (a float32 skeleton alone is 7x a Q4_0 file)."""
    from gguf import quants

    from gguf_helpers import write_gguf

    hidden, ffn, vocab, layers, heads = 512, 1408, 8192, 4, 8
    rng = np.random.default_rng(0)

    def q(shape):
        return quants.quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), T.Q4_0), T.Q4_0

    tensors = {"token_embd.weight": q((vocab, hidden)), "output_norm.weight": (np.ones(hidden, np.float32), None)}
    for i in range(layers):
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (hidden, hidden)), ("attn_v", (hidden, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))]:
            tensors[f"blk.{i}.{name}.weight"] = q(shape)
        tensors[f"blk.{i}.attn_norm.weight"] = tensors[f"blk.{i}.ffn_norm.weight"] = (np.ones(hidden, np.float32), None)
    big = tmp_path / "big.gguf"
    write_gguf(big, tensors, metadata={
        "llama.block_count": layers, "llama.context_length": 64, "llama.embedding_length": hidden,
        "llama.feed_forward_length": ffn, "llama.attention.head_count": heads, "llama.attention.head_count_kv": heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0})
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(gguf_path), str(big), str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0
    assert result["growth"] < 4 * big.stat().st_size, (result, big.stat().st_size)


def test_attention_biases_of_a_gguf_reach_both_output_formats(tmp_path, capsys):
    import transformers

    import torch_qmm.interop.transformers  # noqa: F401  (registers the quantizer for from_pretrained)
    from torch_qmm.interop import load_mlx

    path = tmp_path / "b.gguf"
    held = write_llama_gguf(hf_model(tied=False, attention_bias=True), path, {"q_proj": T.Q8_0, "k_proj": T.Q4_K},
                            np.random.default_rng(3))
    assert main(["convert", str(path), str(tmp_path / "hf"), "--requantize", "all", "--bits", "8",
                 "--group-size", "32"]) == 0
    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    for fmt in ("hf", "mlx"):
        config = json.loads((tmp_path / fmt / "config.json").read_text())
        assert (config["attention_bias"], config["mlp_bias"]) == (True, False), fmt
    models = {"hf": transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")}
    models["mlx"] = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(tmp_path / "mlx"))
    load_mlx(models["mlx"], tmp_path / "mlx")
    for fmt, model in models.items():
        for layer in (0, 1):
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                got = getattr(model.model.layers[layer].self_attn, proj).bias
                key = f"model.layers.{layer}.self_attn.{proj}.bias"
                assert got is not None and torch.equal(got.detach(), held[key]), (fmt, key)


def test_a_destination_that_is_a_file_or_a_link_is_refused(hf_folder, tmp_path, capsys):
    (tmp_path / "out").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    for dst, message in (("out", "exists and is not a folder"),
                         ("link", f"is a symbolic link (to {tmp_path / 'elsewhere'}); convert writes only into a real folder")):
        assert main(["convert", str(hf_folder), str(tmp_path / dst), "--overwrite"]) == 2
        assert f"destination {tmp_path / dst} {message}" in capsys.readouterr().err
    assert (tmp_path / "out").read_text() == "mine" and not (tmp_path / "elsewhere").exists()


def test_a_destination_inside_a_file_is_refused_naming_the_file(hf_folder, tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    dst = tmp_path / "a-file" / "deeper" / "out"  # its parent folders cannot exist: one is a file
    assert main(["convert", str(hf_folder), str(dst)]) == 2
    err = capsys.readouterr().err
    assert f"destination {dst}: {tmp_path / 'a-file'} is a file, not a folder" in err, err
    assert len(err.splitlines()) == 1 and (tmp_path / "a-file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_destination_with_a_name_too_long_is_refused(hf_folder, tmp_path, capsys):
    long = tmp_path / ("x" * 300) / "out"  # a name longer than a file system takes (ENAMETOOLONG)
    assert main(["convert", str(hf_folder), str(long)]) == 2
    err = capsys.readouterr().err
    assert f"destination {long}: File name too long; choose another output folder" in err, err
    assert len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc (Linux) stands for a folder mkdir fails in")
def test_a_destination_whose_folder_cannot_be_made_is_named_as_given(hf_folder, capsys):
    dst = Path("/proc/torch-qmm-test/out")  # /proc takes no new folder
    assert main(["convert", str(hf_folder), str(dst)]) == 1
    err = capsys.readouterr().err
    assert f"destination {dst}: cannot create a folder there" in err and ".partial-" not in err, err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("output_format", ["transformers", "mlx"])
def test_layers_left_float_by_the_group_size_say_why(tmp_path, capsys, output_format):
    """Layers whose inputs are not a multiple of --group-size stay float: the report says so for
    each (hidden size 96 against --group-size 64; down_proj's 128 inputs are quantized), and the
    summary line lists the format once."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--format", output_format,
                 "--group-size", "64"]) == 0
    out = capsys.readouterr().out
    report = _report(out)
    why = "kept float float32 (its 96 inputs are not a multiple of --group-size 64)"
    assert report["model.layers.0.self_attn.q_proj"] == why
    assert report["model.layers.0.mlp.up_proj"] == why
    assert report["model.layers.0.mlp.down_proj"] == "quantized float -> affine b4 gs64"
    if output_format == "mlx":  # the embedding and head, which the MLX format quantizes
        assert report["model.embed_tokens"] == why
        assert report["lm_head"] == why
    else:
        assert report["model.embed_tokens"] == ("kept float float32 (the transformers format quantizes no float "
                                                "embedding; --format mlx does)")
    summary = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert "affine b4 gs64; kept float float32" in summary and "(its" not in summary, summary


def test_a_quantizer_error_while_loading_is_not_blamed_on_transformers(hf_folder):
    """An error torch_qmm's quantizer raises inside from_pretrained (here: calibration ids outside
    the vocabulary) says the quantization failed, with the quantizer's own message; transformers'
    own errors keep naming the config/weights (test above)."""
    from torch_qmm.interop.cli_convert import from_pretrained
    from torch_qmm.interop.transformers import TorchQmmConfig

    vocab = transformers.AutoConfig.from_pretrained(hf_folder).vocab_size
    cfg = TorchQmmConfig(bits=4, group_size=32, method="gptq", calibration=[torch.tensor([[1, vocab + 5]])])
    with pytest.raises(ValueError) as e:
        from_pretrained(hf_folder, quantization_config=cfg)
    message = str(e.value)
    assert message.startswith(f"{hf_folder}: quantizing the model while loading it failed: "), message
    assert str(vocab + 5) in message and "transformers could not build" not in message


def test_requantize_rest_with_nothing_to_requantize_says_the_options_went_unused(tmp_path, capsys):
    """Every linear layer of the file has an exact form: --requantize rest re-quantizes none, and
    the --bits given is reported unused rather than silently ignored."""
    path = tmp_path / "exact.gguf"
    layers = {p: T.Q8_0 for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    write_llama_gguf(hf_model(tied=False), path, {**layers, "embed": T.Q4_0, "lm_head": T.Q8_0}, np.random.default_rng(1))
    assert main(["convert", str(path), str(tmp_path / "out"), "--format", "mlx", "--requantize", "rest",
                 "--bits", "6"]) == 0
    assert "--requantize rest re-quantized no layer: --bits went unused" in capsys.readouterr().out
    assert main(["convert", str(path), str(tmp_path / "out2"), "--format", "mlx", "--requantize", "rest"]) == 0
    assert "--requantize rest re-quantized no layer\n" in capsys.readouterr().out


def test_a_folder_of_another_head_than_a_causal_lm_is_refused(tmp_path, capsys):
    # A sequence classifier: built as a causal LM, its trained score head would be dropped and a
    # random lm_head written; refused (a bad input: exit 1) naming the architecture, nothing written.
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    src = tmp_path / "cls"
    transformers.LlamaForSequenceClassification(config).save_pretrained(src)
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert "convert reads causal language models (AutoModelForCausalLM), this folder holds " \
           "LlamaForSequenceClassification" in err
    assert not dst.exists()


def test_architectures_of_the_wrong_type_name_the_field(hf_folder, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for f in hf_folder.iterdir():
        (src / f.name).symlink_to(f)
    config = json.loads((hf_folder / "config.json").read_text())
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps({**config, "architectures": "LlamaForCausalLM"}))
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    assert "field 'architectures' must be a list of class names, got 'LlamaForCausalLM'" in capsys.readouterr().err


@pytest.mark.parametrize("architecture", ["Qwen3_5ForConditionalGeneration", "Gemma3ForConditionalGeneration"])
def test_a_folder_naming_a_conditional_generation_model_converts(hf_folder, tmp_path, architecture):
    # AutoModelForCausalLM builds such a folder's language model with its own head: not refused
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_folder, src)
    config = json.loads((hf_folder / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0


class _OwnForwardEmbedding(torch.nn.Embedding):
    """An embedding whose forward does more than read rows (as some models' do)."""

    def forward(self, ids):
        return super().forward(ids) * 2


@pytest.mark.parametrize("case", ["own-forward", "max-norm"])
def test_an_embedding_the_mlx_format_cannot_quantize_says_why(tmp_path, capsys, monkeypatch, case):
    """--format mlx quantizes the embedding (as mlx.nn.quantize does) unless a quantized embedding
    would not do what it does: the report names the reason for each."""
    hf_model(tied=False).save_pretrained(tmp_path / "src")
    from torch_qmm.interop import cli_convert

    load = cli_convert.from_pretrained

    def with_embedding(*args, **kwargs):
        model = load(*args, **kwargs)
        old = model.model.embed_tokens
        new = (_OwnForwardEmbedding(old.num_embeddings, old.embedding_dim) if case == "own-forward"
               else torch.nn.Embedding(old.num_embeddings, old.embedding_dim, max_norm=1.0))
        new.weight = old.weight
        model.model.embed_tokens = new
        return model

    monkeypatch.setattr(cli_convert, "from_pretrained", with_embedding)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "mlx"]) == 0
    report = _report(capsys.readouterr().out)
    why = ("a _OwnForwardEmbedding, whose forward a quantized embedding would not do" if case == "own-forward"
           else "max_norm=1.0: its rows are renormalized when read")
    assert report["model.embed_tokens"] == f"kept float float32 ({why})"
    assert report["model.layers.0.mlp.down_proj"] == "quantized float -> affine b4 gs64"
