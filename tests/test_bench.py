"""Smoke tests of `python -m torch_qmm bench`: it runs, checks outputs, and writes sound JSON.

Performance is never asserted; only structure and finiteness.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from torch_qmm.__main__ import main


def test_bench_writes_json_with_finite_peer_ratios(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--shapes", "96x256", "--m", "1,17", "--bits", "4", "--dtype",
               "float32", "--repeats", "1", "--output", str(out), "--no-plot"])
    assert rc == 0
    doc = json.loads(out.read_text())
    for key in ("device", "os", "torch", "commit", "copy_gbps"):
        assert key in doc["machine"], key
    assert doc["machine"]["copy_gbps"] > 0
    assert [r["m"] for r in doc["results"]] == [1, 17]
    for r in doc["results"]:
        assert (r["n"], r["k"], r["bits"], r["dtype"]) == (96, 256, 4, "float32")
        assert r["times_ms"]["torch_qmm"] > 0 and math.isfinite(r["gbps"])
        assert {"linear_float32", "linear_bfloat16", "linear_float16"} <= set(r["speedup_vs"])
        assert all(math.isfinite(v) and v > 0 for v in r["speedup_vs"].values())
        # > 1: torch_qmm is faster (peer time / ours); the JSON rounds times to 1e-4 ms, ratios to 1e-3
        for peer, ratio in r["speedup_vs"].items():
            want = r["times_ms"][peer] / r["times_ms"]["torch_qmm"]
            assert math.isclose(ratio, want, rel_tol=0.02, abs_tol=1e-3), (peer, ratio, want)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1.0])
def test_bench_refuses_to_time_a_kernel_whose_output_is_wrong(monkeypatch, bad):
    """The output check before timing: NaN (which compares false with any bound), Inf and an
    offset output all stop the config."""
    from torch_qmm.bench import kernels

    real = kernels.quantized_matmul
    monkeypatch.setattr(kernels, "quantized_matmul",
                        lambda *a, **kw: real(*a, **kw) + bad if bad == 1.0 else torch.full_like(real(*a, **kw), bad))
    with pytest.raises(AssertionError, match="torch_qmm output differs from the reference"):
        kernels.run_config(kernels.Config(64, 256, 1, 4, "float32"), repeats=1, cache_bytes=0,
                           peer_filter=lambda p: False)


def test_bench_float32_precision_is_set_for_the_run_and_recorded(tmp_path):
    """--float32-precision high: set for the whole run (a CLI process; the test restores it),
    torch_qmm checked against the reference with that precision's tolerance, and recorded."""
    out = tmp_path / "bench.json"
    before = torch.get_float32_matmul_precision()
    try:
        rc = main(["bench", "--device", "cpu", "--shapes", "64x512", "--m", "1", "--bits", "4", "--dtype", "float32",
                   "--repeats", "1", "--peers", "linear_float32", "--float32-precision", "high", "--output", str(out),
                   "--no-plot"])
    finally:
        torch.set_float32_matmul_precision(before)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["float32_matmul_precision"] == "high"
    assert doc["results"][0]["times_ms"]["torch_qmm"] > 0


def test_bench_gguf_times_gguf_qmm_against_linear(tmp_path):
    """--gguf: random valid blocks of every native type, output checked against gguf.quants.dequantize,
    rows labelled by type (no affine bits / group size), only the F.linear peers."""
    out = tmp_path / "bench.json"
    types = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ2_XXS": 66, "IQ2_XS": 74, "IQ3_XXS": 98,
             "IQ1_S": 50, "IQ3_S": 110, "IQ2_S": 82, "IQ4_XS": 136, "IQ1_M": 56}
    rc = main(["bench", "--device", "cpu", "--shapes", "64x512", "--m", "1,3", "--gguf", ",".join(types), "--dtype",
               "float32", "--repeats", "1", "--output", str(out), "--no-plot"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(r["fmt"], r["m"]) for r in doc["results"]] == [(t, m) for t in types for m in (1, 3)]
    for r in doc["results"]:
        assert r["weight_bytes"]["torch_qmm"] == 64 * 512 // 256 * types[r["fmt"]]
        assert set(r["speedup_vs"]) == {"linear_float32", "linear_bfloat16", "linear_float16"}
        assert r["bits"] is None and r["group_size"] is None


def test_bench_saves_a_png_plot_next_to_the_json(tmp_path):
    # matplotlib is a test dependency, so the plot is always drawn here.
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--shapes", "64x128", "--m", "1,2", "--bits", "4", "--dtype", "float32",
               "--repeats", "1", "--peers", "linear_float32", "--output", str(out)])
    assert rc == 0
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_model_reports_time_memory_and_error(tmp_path):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"dim": 128, "hidden": 256, "layers": 1, "heads": 4, "vocab": 256}))
    out = tmp_path / "model_result.json"
    rc = main(["bench", "--device", "cpu", "--model", str(cfg), "--repeats", "2", "--output", str(out)])
    assert rc == 0
    (result,) = json.loads(out.read_text())["models"]
    assert result["bytes_after"] < result["bytes_before"]
    for t in result["by_tokens"].values():
        assert t["quantized_ms"] > 0 and 0 <= t["rel_error"] < 0.5


def test_bench_metalsim_reports_traffic_per_buffer_and_bounds(tmp_path):
    from metal_helpers import require_clang

    require_clang()
    out = tmp_path / "traffic.json"
    rc = main(["bench", "--device", "metalsim", "--shapes", "40x256", "--m", "1,3,33", "--output", str(out)])
    assert rc == 0  # non-zero when a bound does not hold
    doc = json.loads(out.read_text())
    assert doc["machine"]["device"] == "metalsim" and doc["machine"]["copy_gbps"] is None
    assert doc["kind"] == "metalsim_traffic"
    assert [r["m"] for r in doc["results"]] == [1, 3, 33]
    for r in doc["results"]:
        assert (r["n"], r["k"], r["bits"], r["dtype"], r["scale"]) == (40, 256, 4, "float16", 1)
        assert "times_ms" not in r  # traffic, not time
        bufs = r["buffers"]
        assert set(bufs) == {"wq", "scales", "biases", "x", "y"}
        assert bufs["wq"]["compulsory"] == 40 * 256 * 4 // 8 and bufs["x"]["compulsory"] == r["m"] * 256 * 2
        assert bufs["y"]["stored"] == bufs["y"]["compulsory"] == r["m"] * 40 * 2
        for b in bufs.values():
            assert b["tg_footprint"] >= b["compulsory"] or b["compulsory"] == 0
            assert b["tg_ratio"] == round(b["tg_footprint"] / b["compulsory"], 4)
        bounded = {k for k, b in bufs.items() if b["bound"] is not None}
        assert bounded == ({"wq", "scales", "biases"} if r["m"] == 1 else {"wq", "x"})
        assert r["bounds_hold"] and all(b["holds"] for b in bufs.values() if b["bound"] is not None)


def test_bench_metalsim_scales_the_seed_shapes_down_by_default(tmp_path):
    from metal_helpers import require_clang

    require_clang()
    out = tmp_path / "traffic.json"
    rc = main(["bench", "--device", "metalsim", "--quick", "--m", "1", "--output", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert (r["n"], r["k"], r["scale"], r["shape_named"]) == (512, 512, 8, "4096x4096")


def test_bench_model_accepts_a_transformers_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    out = tmp_path / "model_result.json"
    rc = main(["bench", "--device", "cpu", "--model", str(tmp_path / "llama"), "--repeats", "1", "--output", str(out)])
    assert rc == 0
    (result,) = json.loads(out.read_text())["models"]
    assert result["config"]["type"] == "llama"
    # 4 attention + 3 MLP projections + lm_head (its in_features 128 is a multiple of 64).
    assert result["layers_quantized"] == 8 and result["bytes_after"] < result["bytes_before"]
    for t in result["by_tokens"].values():
        assert t["quantized_ms"] > 0 and 0 <= t["rel_error"] < 0.5


def test_bench_model_refuses_a_folder_torch_qmm_quantized(tmp_path, capsys):
    """Such a folder has no float model to compare with: a usage error naming the folder, its
    format and what --model expects, before any model is loaded or quantized."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "float")
    assert main(["convert", str(tmp_path / "float"), str(tmp_path / "q"), "--bits", "8", "--group-size", "32"]) == 0
    capsys.readouterr()
    out = tmp_path / "model_result.json"
    argv = ["bench", "--device", "cpu", "--model", str(tmp_path / "q"), "--repeats", "1", "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument --model: {tmp_path / 'q'} is a transformers folder quantized by torch_qmm (affine b8 gs32)" in err
    assert "expects a float transformers folder" in err and "JSON file of ModelConfig fields" in err
    assert not out.exists()


def test_bench_model_refuses_an_mlx_folder(tmp_path, capsys):
    """An MLX folder (config.json "quantization", as save_mlx and mlx_lm write it) has no float
    model either: a usage error saying so, not transformers' message about a quant_method."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_qmm.convert import quantize_model
    from torch_qmm.interop import save_mlx

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(config)
    quantize_model(model, bits=4, group_size=32)
    save_mlx(model, tmp_path / "mlx")
    argv = ["bench", "--device", "cpu", "--model", str(tmp_path / "mlx"), "--repeats", "1", "--output",
            str(tmp_path / "r.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument --model: {tmp_path / 'mlx'} is an MLX folder quantized by mlx_lm" in err
    assert "expects a float transformers folder" in err and "quant_method" not in err


def test_bench_times_mlx_in_its_own_process_and_records_how(tmp_path):
    """MLX's worker threads keep spinning after a call: it is timed in a child process after the
    in-process peers, and the JSON says so; the parent never imports mlx."""
    import sys

    pytest = __import__("pytest")
    pytest.importorskip("mlx.core")
    had_mlx = "mlx.core" in sys.modules
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--shapes", "64x256", "--m", "1,32", "--bits", "4", "--dtype", "float32",
               "--repeats", "2", "--peers", "linear_float32,mlx", "--mlx-max-m", "16", "--output", str(out)])
    assert rc == 0
    assert had_mlx or "mlx.core" not in sys.modules
    doc = json.loads(out.read_text())
    assert "separate child process" in doc["isolation"]["mlx"]
    m1, m32 = doc["results"]
    assert m1["times_ms"]["mlx"] > 0 and math.isfinite(m1["speedup_vs"]["mlx"])
    assert "mlx" not in m32["times_ms"] and "--mlx-max-m" in m32["skipped"]["mlx"]
    assert all(isinstance(r["load_average"], float) for r in doc["results"])
    assert "load_average_end" in doc["machine"]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_bench_model_draws_its_plot_and_explains_the_error(tmp_path, capsys):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"dim": 128, "hidden": 256, "layers": 1, "heads": 4, "vocab": 256}))
    out = tmp_path / "model_result.json"
    assert main(["bench", "--device", "cpu", "--model", str(cfg), "--repeats", "2", "--output", str(out)]) == 0
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "against the same model unquantized" in capsys.readouterr().out


def test_bench_bad_values_are_usage_errors(tmp_path, capsys):
    import pytest

    for argv, message in [(["--shapes", "12x"], "expected N x K shapes"), (["--m", "0"], "positive integers"),
                          (["--bits", "7"], "expected bit widths"), (["--peers", "foo"], "comma-separated list of"),
                          (["--repeats", "0"], "positive integers")]:
        with pytest.raises(SystemExit) as e:
            main(["bench", "--device", "cpu", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_model_config_file_is_checked(tmp_path, capsys):
    for fields, message in [({"dim": 0}, "field 'dim' must be a positive integer, got 0"),
                            ({"heads": 3}, "must be a multiple of 'heads' = 3"), ({"depth": 2}, "unknown ModelConfig")]:
        cfg = tmp_path / "model.json"
        cfg.write_text(json.dumps(fields))
        assert main(["bench", "--device", "cpu", "--model", str(cfg), "--output", str(tmp_path / "o.json")]) == 1
        err = capsys.readouterr().err
        assert message in err and str(cfg) in err


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_give_every_implementation_every_predecessor_equally_often(n):
    """kernels.balanced_orders: each order is a permutation, each implementation takes each position
    equally often, and within rounds every ordered pair (a right before b, a != b) occurs equally
    often (a Williams square), so no implementation always inherits the same predecessor."""
    from collections import Counter

    from torch_qmm.bench import kernels

    orders = kernels.balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    positions = Counter((i, pos) for o in orders for pos, i in enumerate(o))
    assert set(positions.values()) == {len(orders) // n}
    pairs = Counter(p for o in orders for p in zip(o, o[1:]))
    if n > 1:
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


def test_bench_output_that_cannot_be_written_is_a_usage_error_before_the_run(tmp_path, capsys, monkeypatch):
    """A bad --output is refused up front (exit 2, naming the argument), not after the whole run
    as an OSError."""
    import pytest

    import torch_qmm.bench as bench

    def started(*args, **kwargs):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(bench, "copy_bandwidth_gbps", started)
    (tmp_path / "file").write_text("")
    for output, message in [(str(tmp_path / "file" / "out.json"), "is not a folder"),
                            (str(tmp_path), "(a folder)"), ("", "expected a file path")]:
        with pytest.raises(SystemExit) as e:
            main(["bench", "--device", "cpu", "--shapes", "64x128", "--m", "1", "--output", output])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --output" in err and message in err, err


def test_merge_rounds_takes_each_cell_from_every_round_and_keeps_every_skip():
    """--rounds: a cell is the median of its rounds' medians (not the fastest round), min_ms the
    fastest call, samples the sum; an implementation skipped in a later round only is skipped in
    the merged result with that round's reason, never silently dropped."""
    from torch_qmm.bench.kernels import Config, Result, merge_rounds

    cfg = Config(n=64, k=64, m=1, bits=4, group_size=64, dtype="float32")

    def result(times, skipped=None, load=None):
        return Result(cfg, dict(times), {k: v / 2 for k, v in times.items()}, {k: 10 for k in times},
                      {k: 100 for k in times}, dict(skipped or {}), load)

    merged = merge_rounds([result({"torch_qmm": 3.0, "mlx": 4.0}, load=1.0),
                           result({"torch_qmm": 1.0}, {"mlx": "out of memory"}, load=2.5),
                           result({"torch_qmm": 2.0, "mlx": 6.0})])
    assert merged.times_ms == {"torch_qmm": 2.0}
    assert merged.min_ms == {"torch_qmm": 0.5} and merged.samples == {"torch_qmm": 30}
    assert merged.skipped == {"mlx": "out of memory"}
    assert merged.load_average == 2.5
    assert merged.round_times_ms == [{"torch_qmm": 3.0}, {"torch_qmm": 1.0}, {"torch_qmm": 2.0}]


def test_bench_argument_errors_of_the_run_come_before_any_timing(tmp_path, capsys, monkeypatch):
    """K that is no whole number of the format's groups or blocks, and a GGUF file as --model, are
    usage errors naming the argument (exit 2), raised before the copy-bandwidth measurement."""
    import torch_qmm.bench as bench

    monkeypatch.setattr(bench, "copy_bandwidth_gbps", lambda device: pytest.fail("timed before the argument error"))
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF" + bytes(60))
    out = str(tmp_path / "o.json")
    for argv, message in [
        (["--shapes", "256x255", "--m", "1"], "argument --shapes: K = 255 of 256x255 is not a multiple of --group-size (64)"),
        (["--shapes", "64x96", "--group-size", "64"], "K = 96 of 64x96 is not a multiple of --group-size (64)"),
        (["--shapes", "64x288", "--gguf", "Q4_K"], "K = 288 of 64x288 is not a multiple of Q4_K's block size (256)"),
        (["--shapes", "64x40", "--mode", "nvfp4"], "K = 40 of 64x40 is not a multiple of nvfp4's group size (16)"),
    ]:
        assert main(["bench", "--device", "cpu", *argv, "--output", out]) == 2, argv
        assert message in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(bench, "copy_bandwidth_gbps", lambda device: 1.0)
    assert main(["bench", "--device", "cpu", "--model", str(gguf_file), "--output", out]) == 2
    assert f"argument --model: {gguf_file} is a GGUF file" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_a_device_this_torch_lacks_is_a_usage_error(command, tmp_path, capsys):
    """A CPU-only torch raises AssertionError for 'cuda' tensors: still an argument error (exit 2)."""
    assert main([command, "--device", "cuda", *(["--output", str(tmp_path / "o.json")] if command == "bench" else [])]) == 2
    assert "argument --device: 'cuda' is not a usable device here" in capsys.readouterr().err


def test_busy_cpu_warning_above_half_the_cpus_on_cpu_only(monkeypatch):
    from torch_qmm import devices

    monkeypatch.setattr(devices.os, "cpu_count", lambda: 4)
    assert devices.busy_cpu_warning("cpu", 2.0) is None and devices.busy_cpu_warning("cpu", None) is None
    assert devices.busy_cpu_warning("mps", 9.0) is None
    assert devices.busy_cpu_warning("cpu", 2.5) == ("warning: load average 2.5 on 4 CPUs: other processes share the "
                                                    "cores and times will be noisy")


def test_demo_says_when_its_cpu_times_are_noisy(monkeypatch, capsys):
    """Its float / quantized ratio on a shared CPU is not the kernels' (a 'quantized slower' result
    seen under load): a busy machine gets the bench's warning."""
    import torch_qmm.demo as demo

    monkeypatch.setattr(demo, "load_average", lambda: 1e6)
    assert main(["demo", "--device", "cpu", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward:" in out and out.rstrip().splitlines()[-1].startswith("warning: load average 1000000.0 on ")
