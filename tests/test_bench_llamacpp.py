"""The llama.cpp peer of `python -m torch_qmm bench` (torch_qmm/bench/llamacpp_peer.py).

The parser is tested on real output of ggml's `test-backend-ops perf -o MUL_MAT` saved from a run
on the benchmark machine (tests/fixtures/ggml_test_backend_ops_perf_mul_mat.txt: four types at
4096 x 14336, 1 and 2 rows of x, 2 threads). Building ggml (downloading the llama-cpp-python sdist
and compiling ggml with cmake, minutes) is not run here: the command-line wiring is tested with
the build and the child process replaced by fakes that return the fixture's results.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torch_qmm.__main__ import main
from torch_qmm.bench import llamacpp_peer
from torch_qmm.bench.llamacpp_peer import Case, case_for, parse_perf_output

FIXTURE = Path(__file__).parent / "fixtures" / "ggml_test_backend_ops_perf_mul_mat.txt"


def test_parser_reads_every_mul_mat_line_of_real_output():
    rows = parse_perf_output(FIXTURE.read_text())
    assert [(r["params"].split(",")[0], r["params"].split(",")[3]) for r in rows] == [
        (f"type_a={t}", f"n={n}") for n in (1, 2) for t in ("q4_0", "q8_0", "q4_K", "q6_K")]
    assert all(r["op"] == "MUL_MAT" and r["runs"] > 0 and r["us_per_run"] > 0 for r in rows)
    assert rows[0]["us_per_run"] == 40985.59 and rows[0]["runs"] == 69  # the first line, as printed
    assert "\x1b" not in "".join(r["params"] for r in rows)


def test_parser_marks_unsupported_cases_and_ignores_other_lines():
    text = ("Backend 1/1: CPU\n  MUL_MAT(type_a=q4_0,type_b=f32,m=8,n=1,k=32): not supported\n"
            "  Backend CPU: \x1b[1;32mOK\x1b[0m\n")
    assert parse_perf_output(text) == [{"op": "MUL_MAT", "params": "type_a=q4_0,type_b=f32,m=8,n=1,k=32", "runs": 0,
                                        "us_per_run": None}]


def test_perf_list_regex_selects_exactly_its_case():
    rows = parse_perf_output(FIXTURE.read_text())
    case = Case("q4_K", 4096, 14336, 2)
    assert case.in_perf_list()
    hits = [r for r in rows if re.search(case.params_regex(), r["params"])]
    assert len(hits) == 1 and hits[0]["params"].startswith("type_a=q4_K,type_b=f32,m=4096,n=2,k=14336,")


def test_formats_map_to_their_ggml_types_and_other_shapes_use_a_test_file():
    assert case_for("Q4_K", 4, 4096, 14336, 8) == Case("q4_K", 4096, 14336, 8)
    assert case_for("affine", 8, 4096, 14336, 1).ggml_type == "q8_0"
    assert case_for("affine", 4, 4096, 14336, 1).ggml_type == "q4_0"
    assert case_for("affine", 3, 4096, 14336, 1) is None  # no ggml counterpart
    other = Case("q6_K", 64, 512, 3)
    assert not other.in_perf_list()
    fields = other.test_file_line(mul_mat_op=29).split()
    # op, out f32 [64, 3, 1, 1], no op params, 2 sources: q6_K [512, 64] rows of 2 * 210 bytes, f32 x [512, 3]
    assert fields[:8] == ["29", "0", "64", "3", "1", "1", "0", "2"]
    assert fields[8:17] == ["14", "512", "64", "1", "1", "210", "420", str(420 * 64), str(420 * 64)]
    assert fields[17:26] == ["0", "512", "3", "1", "1", "4", "2048", str(2048 * 3), str(2048 * 3)]
    assert fields[26:] == ["-"]
    assert other.weight_bytes() == 64 * 2 * 210


def test_every_mapped_ggml_type_writes_a_test_file_line():
    """Every ggml type a torch_qmm format maps to has its enum value (ggml.h, as the gguf package lists
    it) and block geometry for --test-file lines."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for (fmt, bits), ggml_type in llamacpp_peer.GGML_TYPES.items():
        case = case_for(fmt, bits, 64, 512, 3)
        assert case is not None and case.ggml_type == ggml_type
        fields = case.test_file_line(mul_mat_op=29).split()
        gguf_type = GGMLQuantizationType[ggml_type.upper()]
        assert int(fields[8]) == int(gguf_type), ggml_type
        assert llamacpp_peer.GGML_BLOCKS[ggml_type] == GGML_QUANT_SIZES[gguf_type], ggml_type


def test_missing_build_tools_are_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(llamacpp_peer.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp_peer.LlamaCppUnavailable, match="needs cmake and a C\\+\\+ compiler"):
        llamacpp_peer.ensure_binary()


def test_bench_peer_llamacpp_reports_ratios_in_table_and_json(monkeypatch, tmp_path, capsys):
    rows = {r["params"].split(",")[0].split("=")[1]: r for r in parse_perf_output(FIXTURE.read_text())[:4]}
    calls = []

    def fake_time_case(binary, case, threads):
        calls.append((case, threads))
        return {**rows[case.ggml_type], "how": "perf-list" if case.in_perf_list() else "test-file"}

    monkeypatch.setattr(llamacpp_peer, "ensure_binary", lambda log=print: tmp_path / "test-backend-ops")
    monkeypatch.setattr(llamacpp_peer, "time_case", fake_time_case)
    out = tmp_path / "r.json"
    rc = main(["bench", "--device", "cpu", "--shapes", "64x512", "--m", "1", "--gguf", "Q4_K,Q6_K", "--dtype",
               "float32", "--peers", "llamacpp", "--hot", "--threads", "1", "--repeats", "2", "--no-plot",
               "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["hot"] is True and doc["llamacpp"]["threads"] == 1
    assert [c.ggml_type for c, _ in calls] == ["q4_K", "q6_K"] and {t for _, t in calls} == {1}
    for rec, t in zip(doc["results"], ("q4_K", "q6_K")):
        assert rec["times_ms"]["llamacpp"] == pytest.approx(rows[t]["us_per_run"] / 1e3, abs=1e-4)
        assert rec["speedup_vs"]["llamacpp"] == pytest.approx(rec["times_ms"]["llamacpp"] / rec["times_ms"]["torch_qmm"],
                                                              rel=1e-2)
    assert "x llamacpp" in capsys.readouterr().out


def test_bench_table_and_json_give_each_calls_threads(monkeypatch, tmp_path, capsys):
    """A small call runs on one thread whatever torch's count (work_split.h: one thread per 2^20
    multiply-adds), ggml on the count it is given: the report says so beside the ratio."""
    rows = {r["params"].split(",")[0].split("=")[1]: r for r in parse_perf_output(FIXTURE.read_text())[:4]}
    monkeypatch.setattr(llamacpp_peer, "ensure_binary", lambda log=print: tmp_path / "test-backend-ops")
    monkeypatch.setattr(llamacpp_peer, "time_case", lambda binary, case, threads: {**rows[case.ggml_type], "how": "x"})
    out = tmp_path / "r.json"
    # 64 x 512 x 1: 2^15 multiply-adds, one thread; 4096 x 512 x 1: 2^21, two.
    rc = main(["bench", "--device", "cpu", "--shapes", "64x512,4096x512", "--m", "1", "--gguf", "Q4_K", "--dtype",
               "float32", "--peers", "llamacpp", "--hot", "--threads", "2", "--repeats", "2", "--no-plot",
               "--output", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())["results"]
    assert [(r["n"], r["threads"]) for r in recs] == [(64, {"torch_qmm": 1, "llamacpp": 2}),
                                                      (4096, {"torch_qmm": 2, "llamacpp": 2})]
    table = capsys.readouterr().out
    assert "threads (torch_qmm/llamacpp)" in table
    lines = [ln for ln in table.splitlines() if ln.split()[:2] in (["64x512", "1"], ["4096x512", "1"])]  # the table's rows
    assert [ln.split()[-1] for ln in lines] == ["1/2", "2/2"]


def _three_rounds_of_q4k(monkeypatch, tmp_path, fake_time_case, ms: str) -> dict:
    """The JSON of a 3-round Q4_K bench (float32 and bfloat16 x, rows `ms`) with ggml's build and
    runs replaced by fake_time_case."""
    monkeypatch.setattr(llamacpp_peer, "ensure_binary", lambda log=print: tmp_path / "test-backend-ops")
    monkeypatch.setattr(llamacpp_peer, "time_case", fake_time_case)
    out = tmp_path / "r.json"
    rc = main(["bench", "--device", "cpu", "--shapes", "64x512", "--m", ms, "--gguf", "Q4_K", "--dtype",
               "float32,bfloat16", "--peers", "llamacpp", "--hot", "--threads", "1", "--repeats", "2",
               "--rounds", "3", "--no-plot", "--output", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_rounds_time_every_peer_again_and_report_the_median_of_the_rounds(monkeypatch, tmp_path):
    """--rounds 3: ggml is run again in each round (once per case and round: the float32 and
    bfloat16 rows of a round share it), and each cell is the median of its three round medians,
    which the JSON keeps in the order run."""
    row = parse_perf_output(FIXTURE.read_text())[0]
    ggml_us = iter([3000.0, 1000.0, 1500.0])  # median 1.5 ms, mean 1.83
    calls = []

    def fake_time_case(binary, case, threads):
        calls.append(case.ggml_type)
        return {**row, "us_per_run": next(ggml_us), "how": "test-file"}

    doc = _three_rounds_of_q4k(monkeypatch, tmp_path, fake_time_case, "1")
    assert calls == ["q4_K"] * 3
    assert doc["machine"]["rounds"] == 3
    for rec in doc["results"]:
        rounds = rec["round_times_ms"]
        assert [r["llamacpp"] for r in rounds] == [3.0, 1.0, 1.5]
        assert rec["times_ms"]["llamacpp"] == 1.5
        ours = sorted(r["torch_qmm"] for r in rounds)
        assert rec["times_ms"]["torch_qmm"] == pytest.approx(ours[1], abs=1e-4)
        assert rec["min_ms"]["torch_qmm"] <= ours[0] + 1e-4
        assert rec["samples"]["torch_qmm"] == 3 * 2


def test_bench_rounds_alternate_the_order_of_the_configs(monkeypatch, tmp_path):
    """--rounds: the second round (and every even one) runs the configurations in reverse, so that
    no configuration always sits at the same place in the run; ggml still runs once per case and
    round, right after the first of its configurations in that round's order, and each result keeps
    its own rounds whatever the order."""
    import torch_qmm.bench as bench

    row = parse_perf_output(FIXTURE.read_text())[0]
    events = []
    real_run_config = bench.run_config

    def recording_run_config(cfg, *args, **kwargs):
        events.append(("ours", cfg.m, cfg.dtype))
        return real_run_config(cfg, *args, **kwargs)

    def fake_time_case(binary, case, threads):
        events.append(("ggml", case.m))
        return {**row, "us_per_run": 1000.0 * case.m, "how": "test-file"}

    monkeypatch.setattr(bench, "run_config", recording_run_config)
    doc = _three_rounds_of_q4k(monkeypatch, tmp_path, fake_time_case, "1,2")
    forward = [("ours", 1, "float32"), ("ggml", 1), ("ours", 2, "float32"), ("ggml", 2),
               ("ours", 1, "bfloat16"), ("ours", 2, "bfloat16")]
    backward = [("ours", 2, "bfloat16"), ("ggml", 2), ("ours", 1, "bfloat16"), ("ggml", 1),
                ("ours", 2, "float32"), ("ours", 1, "float32")]
    assert events == forward + backward + forward
    assert "reversed" in doc["machine"]["round_order"]
    cells = {(rec["m"], rec["dtype"]): rec for rec in doc["results"]}
    assert sorted(cells) == [(1, "bfloat16"), (1, "float32"), (2, "bfloat16"), (2, "float32")]
    for (m, _), rec in cells.items():
        assert [r["llamacpp"] for r in rec["round_times_ms"]] == [1.0 * m] * 3
        assert rec["samples"]["torch_qmm"] == 3 * 2


def test_bench_peer_llamacpp_unavailable_is_reported_not_fatal(monkeypatch, tmp_path, capsys):
    def unavailable(log=print):
        raise llamacpp_peer.LlamaCppUnavailable("building ggml's test-backend-ops needs cmake, not found on PATH")

    monkeypatch.setattr(llamacpp_peer, "ensure_binary", unavailable)
    out = tmp_path / "r.json"
    rc = main(["bench", "--device", "cpu", "--shapes", "64x256", "--m", "1", "--bits", "4", "--dtype", "float32",
               "--peers", "llamacpp", "--repeats", "1", "--no-plot", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert "needs cmake" in doc["results"][0]["skipped"]["llamacpp"]
    assert "peer llamacpp not run" in capsys.readouterr().out
