"""`python -m torch_qmm selftest` (torch_qmm/selftest.py) and the macOS workflow that runs it.

The selftest's cases come from the planner; these tests check them against the planner and the
kernel table independently (every route, every kernel of metal/), run it in full on the CPU
kernels and on a reduced set on metalsim (the full metalsim run compiles every kernel of
metal/: minutes), and check that a failure is reported and turns the exit code non-zero.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from torch_qmm.formats import FORMATS
import yaml

from torch_qmm import metal_source, selftest
from torch_qmm.__main__ import main

from cpu_features import takes_bf16_gemm

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "macos-mps.yml"
REPORT_KEYS = {"route", "kernel", "planned_kernel", "M", "N", "K", "dtype", "bits", "group_size", "transpose",
               "ggml_type", "ok", "error", "max_error", "bound", "worst_ratio", "variant", "op", "E", "pattern",
               "x_batch", "lhs", "rhs", "sorted_indices", "precision"}


def _routes() -> list[dict]:
    """The routing table's rows (selftest covers every one)."""
    return json.loads(torch.ops.torch_qmm._routes())


@pytest.fixture(scope="module")
def all_cases():
    return selftest.cases()


def test_every_route_and_cell_has_a_case_that_the_planner_sends_there(all_cases):
    assert not [c.error for c in all_cases if c.error], "a route no probe shape reaches"
    for c in all_cases:  # ask the planner again, independently of how the case was found
        if c.op == "gguf_qmm":
            (l,) = json.loads(torch.ops.torch_qmm._plan_gguf(c.M, c.N, c.K, selftest.native_gguf_types()[c.ggml_type],
                                                             selftest.DTYPES[c.dtype]))
        elif c.op == "gather_qmm":
            assert len(c.lhs) == len(c.rhs) and max(c.lhs) < c.x_batch and max(c.rhs) < c.E, c
            (l,) = json.loads(torch.ops.torch_qmm._plan_gather(c.M, c.N, c.K, len(c.rhs), c.E, c.x_batch, c.bits,
                                                               c.group_size, selftest.DTYPES[c.dtype], c.transpose,
                                                               c.sorted_indices, c.mode))
        else:
            (l,) = json.loads(torch.ops.torch_qmm._plan(c.op, c.M, c.N, c.K, c.bits, c.group_size,
                                                        selftest.DTYPES[c.dtype], bool(c.transpose in (None, True)),
                                                        c.mode))
        assert (l["route"], l["kernel"]) == (c.route, c.planned_kernel), c
    have = {(c.route, c.mode, c.bits, c.group_size, c.dtype, c.ggml_type) for c in all_cases}
    for r in _routes():
        if r["op"] == "gguf_qmm":
            cells = itertools.product(["affine"], [None], [None], selftest.DTYPES, ["Q4_K", "Q6_K"])
        else:
            cells = ((m, b, g, d, None) for m in r["formats"] if m in FORMATS
                     for (b, g), d in itertools.product(selftest._mode_cells(m, selftest.BITS, selftest.GROUP_SIZES),
                                                        selftest.DTYPES))
        for m, b, g, d, t in cells:
            assert (r["route"], m, b, g, d, t) in have, (r["route"], m, b, g, d, t)
    assert {"mxfp4", "nvfp4"} <= {c.mode for c in all_cases}


def test_the_cases_reach_every_kernel_of_metal(all_cases):
    # Kernels of a mode the format table does not list yet have no op to reach them.
    want = {k for k in metal_source.kernels() if k.split("_", 1)[0] in set(FORMATS) | {"gguf"}}
    assert {c.planned_kernel for c in all_cases} == want


def test_aligned_and_unaligned_shapes_are_what_they_say(all_cases):
    unaligned_routes = set()
    for c in all_cases:
        if c.variant == "aligned":
            assert c.N % 32 == 0 and c.K % 512 == 0 and c.M in (0, 1) + selftest.ALIGNED_MS, c
        else:
            assert c.N % 2 == 1 or c.K % 2 == 1 or c.M % 2 == 1, c
            unaligned_routes.add(c.route)
    # Every route takes an unaligned shape except the fast M = 1 path, which exists for aligned ones.
    assert unaligned_routes == {r["route"] for r in _routes()} - {"qmv_fast"}


def _run(tmp_path, *args) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    rc = main(["selftest", *args, "--json", str(report)])
    return rc, json.loads(report.read_text())


@pytest.fixture
def one_thread():
    """Small shapes: intra-op threads only add spin-waiting on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_selftest_on_cpu_passes_in_full(tmp_path, capsys, all_cases, one_thread):
    rc, doc = _run(tmp_path, "--device", "cpu", "--failures-only")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert f"{len(all_cases)} cases, 0 failed" in out
    assert len(doc["cases"]) == len(all_cases) and doc["summary"]["failed"] == 0
    for c in doc["cases"]:
        assert REPORT_KEYS <= set(c) and c["ok"] and c["error"] is None
        assert c["kernel"] and c["max_error"] is not None, c
        if c["op"] == "dequantize" or (c["op"] == "quantize" and c["mode"] != "affine"):
            assert c["max_error"] == 0 and c["bound"] == 0, c  # bit for bit (affine dequantize: MLX's rounding)
        elif c["op"] in ("qmm", "gguf_qmm", "gather_qmm"):
            assert 0 <= c["worst_ratio"] <= 1 and c["bound"] > 0, c
            # qmm calls that take the bfloat16 GEMM route (tests/cpu_features.py) are held to its
            # bound, and so are gather_qmm calls whose largest group (rows of one matrix) takes it;
            # every other result to the exact tolerance.
            rows = c["M"]
            if c["op"] == "gather_qmm":
                rows *= max(c["rhs"].count(e) for e in c["rhs"])
            bf16 = c["op"] in ("qmm", "gather_qmm") and takes_bf16_gemm(
                rows, selftest.DTYPES[c["dtype"]], c["transpose"] in (None, True), bits=c["bits"], k=c["K"], mode=c["mode"])
            assert c["kernel"].split(" ")[-1] == "gemm-bf16" if bf16 else "gemm-bf16" not in c["kernel"], c
            assert c["precision"] == ("medium" if bf16 else "highest"), c
    env = doc["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["commit"]
    # the kernel recorded on cpu is the CPU route the op takes
    some = next(c for c in doc["cases"] if c["route"] == "qmv_fast" and c["dtype"] == "float32" and c["bits"] == 4)
    x = torch.zeros(some["M"], some["K"])
    wq = torch.zeros(some["N"], some["K"] * 4 // 32, dtype=torch.uint32)
    s = torch.zeros(some["N"], some["K"] // some["group_size"])
    assert some["kernel"] == torch.ops.torch_qmm._cpu_route(x, wq, s, s, 4, some["group_size"], True)


def test_selftest_on_metalsim_reduced_set(tmp_path, capsys):
    from metal_helpers import require_clang

    require_clang()
    rc, doc = _run(tmp_path, "--device", "metalsim", "--bits", "4", "--group-sizes", "64", "--dtypes", "float16")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    cases = doc["cases"]
    assert {c["route"] for c in cases} == {r["route"] for r in _routes()}
    for c in cases:
        assert c["ok"], c
        assert c["kernel"] == c["planned_kernel"], c  # the launch metalsim ran is the planned one
        assert c["kernel"] in out  # the table names it
    assert doc["environment"]["device"] == "metalsim" and "clang" in doc["environment"]


def test_a_failing_case_is_reported_and_the_exit_code_is_1(tmp_path, capsys, monkeypatch):
    # A bound a billion times tighter than the rule: the kernel's ordinary rounding must fail it.
    rule = selftest.error_bound
    monkeypatch.setattr(selftest, "error_bound", lambda *a, **k: rule(*a, **k) * 1e-9)
    rc, doc = _run(tmp_path, "--device", "cpu", "--bits", "4", "--group-sizes", "64", "--dtypes", "float16",
                   "--routes", "qmm_t_bm2,quantize")
    out = capsys.readouterr().out
    assert rc == 1
    by_route = {c["route"]: c for c in doc["cases"]}
    bad = by_route["qmm_t_bm2"]
    assert not bad["ok"] and "exceeds the float16 tolerance" in bad["error"] and bad["worst_ratio"] > 1
    assert by_route["quantize"]["ok"]  # exact comparison, not the tolerance rule
    assert "FAIL qmm_t_bm2" in out and doc["summary"]["failed"] == sum(not c["ok"] for c in doc["cases"])


def test_bad_arguments_and_a_missing_device_exit_2(capsys, tmp_path):
    assert main(["selftest", "--device", "cpu", "--routes", "no_such_route"]) == 2
    assert "no_such_route" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["selftest", "--bits", "7"])
    assert "--bits" in capsys.readouterr().err
    # An unknown mode is refused, not run as "no case of that mode" (only the GGUF cases, exit 0).
    for modes in ("fp4", "mxfp4,nvfp", ""):
        with pytest.raises(SystemExit) as exc:
            main(["selftest", "--device", "cpu", "--modes", modes, "--routes", "gguf_qmv"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--modes" in err and repr(modes) in err and "'mxfp4'" in err, err
    # A report that cannot be written is refused before the run
    (tmp_path / "file").write_text("")
    for path, message in [(tmp_path / "file" / "r.json", "is not a folder"), (tmp_path, "(a folder)")]:
        with pytest.raises(SystemExit) as exc:
            main(["selftest", "--device", "cpu", "--json", str(path), "--routes", "quantize"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --json" in err and message in err, err
    # Spaces after the commas are allowed in every list
    assert main(["selftest", "--device", "cpu", "--modes", "affine, mxfp4", "--dtypes", "float32, float16",
                 "--bits", "4", "--group-sizes", "64", "--routes", "qmv_fast"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4" in out and "float16" in out and "4 cases, 0 failed" in out, out
    if not torch.backends.mps.is_available():
        assert main(["selftest", "--device", "mps"]) == 2
        assert "torch.backends.mps.is_available() is False" in capsys.readouterr().err


# ---- the workflow ----------------------------------------------------------------------------------

def test_the_workflow_passes_actionlint():
    exe = shutil.which("actionlint")
    assert exe, "actionlint is missing: it comes with the test extra (bash install.sh --test)"
    result = subprocess.run([exe, "-no-color", str(WORKFLOW)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    exe = shutil.which("actionlint")
    assert exe, "actionlint is missing: it comes with the test extra (bash install.sh --test)"
    broken = tmp_path / ".github" / "workflows" / "w.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:"))
    result = subprocess.run([exe, "-no-color", str(broken)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0 and "runs-on" in result.stdout


def test_the_workflow_installs_as_the_readme_says_and_runs_the_selftest_on_mps():
    doc = yaml.safe_load(WORKFLOW.read_text())
    (job,) = doc["jobs"].values()
    assert "macos-14" in job["runs-on"]  # arm64 (Apple silicon) hosted runner, or a self-hosted label
    runs = [s.get("run", "") for s in job["steps"]]
    readme = (ROOT / "README.md").read_text()
    assert "bash install.sh " in readme and "add --test for the test tools" in readme
    assert "bash install.sh --test" in runs
    assert "python3 -m torch_qmm selftest --device mps --json selftest.json" in runs
    assert any("pytest" in r and '-k "mps' in r for r in runs)
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert "selftest" in upload["with"]["path"] and upload["if"] == "${{ !cancelled() }}"
