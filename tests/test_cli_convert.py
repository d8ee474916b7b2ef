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
from torch_qmm.interop import parse_quantization

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
    """The transformers format keeps the embedding float even under --requantize all; the report
    says so instead of suggesting --requantize rest (refused for that format)."""
    assert main(["convert", str(gguf_path), str(tmp_path / "hf"), "--requantize", "all", "--bits", "8",
                 "--group-size", "32"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.layers.0.self_attn.q_proj"] == "re-quantized Q8_0 -> affine b8 gs32"
    assert report["model.embed_tokens"] == (
        "decoded Q4_0 -> float float32 (as gguf decodes it; the transformers format keeps the embedding and the "
        "output head float; --format mlx keeps them quantized)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_q4_k_layers_are_reported_lossless_only_when_biases_survive_the_dtype_too(dtype):
    """Blocks whose scales d*sc are exact in the dtype (d = 1, sc = 1) but whose biases -dmin*m are
    not (dmin = 1 + 2^-10 has 11 significant bits, m = 63): the layer is not lossless."""
    from torch_qmm.interop.cli_convert import _q4_k_affine

    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype="<f2").view(np.uint8)  # d
    block[2:4] = np.array([1 + 2**-10], dtype="<f2").view(np.uint8)  # dmin
    block[4:8] = 0x01  # sc of sub-blocks 0-3
    block[8:12] = 0x3F  # m of sub-blocks 0-3
    block[12:16] = 0xF1  # sc (low nibble) and m (high nibble) of sub-blocks 4-7
    block[16:] = np.arange(128, dtype=np.uint8)
    blocks = torch.from_numpy(np.tile(block, (2, 1)))
    _, scales, biases, exact = _q4_k_affine(blocks, 2, 256, dtype, "layer")
    assert torch.equal(scales.float(), torch.ones(2, 8))
    assert biases.float()[0, 0] != -(1 + 2**-10) * 63  # rounded: the premise of the test
    assert exact is False
    assert _q4_k_affine(blocks, 2, 256, torch.float32, "layer")[3] is True


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


@pytest.mark.parametrize("argv, message", [
    (["--format", "mlx", "--bits", "3", "--group-size", "128"],
     "--bits and --group-size apply only to re-quantization"),
    (["--format", "mlx", "--bits", "3"], "--bits applies only to re-quantization"),
    ([], "GGUF -> transformers re-quantizes every layer"),
    (["--format", "transformers", "--requantize", "rest"], "GGUF -> transformers re-quantizes every layer"),
])
def test_gguf_flags_that_do_not_apply_are_usage_errors(gguf_path, tmp_path, argv, message, capsys):
    assert main(["convert", str(gguf_path), str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_requantize_on_a_float_folder_is_a_usage_error(hf_folder, tmp_path, capsys):
    assert main(["convert", str(hf_folder), str(tmp_path / "out"), "--requantize", "all"]) == 2
    assert "--requantize applies to GGUF sources only" in capsys.readouterr().err


def test_float_folder_report_names_the_format_used(hf_folder, tmp_path, capsys):
    assert main(["convert", str(hf_folder), str(tmp_path / "out"), "--bits", "8", "--group-size", "32"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["model.layers.0.mlp.up_proj"] == "quantized float -> affine b8 gs32"
    assert report["lm_head"].startswith("kept float")


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
    for dst in ("out", "link"):
        assert main(["convert", str(hf_folder), str(tmp_path / dst), "--overwrite"]) == 2
        assert f"destination {tmp_path / dst} exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "out").read_text() == "mine" and not (tmp_path / "elsewhere").exists()
