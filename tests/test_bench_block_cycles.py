"""Smoke test of benchmarks/gguf_block_cycles.cpp: it includes the AVX2 GGUF kernels' source and
names their internals, so it is built here (as its header says) and run on tiny shapes, so that a
change to the kernels that breaks it shows. Times are never asserted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from cpu_features import HAS_AVX2

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "gguf_block_cycles.cpp"

pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the tool times the AVX2 + FMA kernels; this CPU builds none")


@pytest.fixture(scope="module")
def tool(tmp_path_factory) -> Path:
    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    out = tmp_path_factory.mktemp("block_cycles") / "gguf_block_cycles"
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [cxx, "-O2", "-std=c++17", "-march=native", "-fopenmp", "-w", f"-I{ROOT / 'csrc'}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), "-o", str(out), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return out


def run(tool: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=120, env=env)


# The route gguf_avx2 takes (csrc/cpu/gguf_avx2.cpp, subnormal_fields_for; the tool takes
# subnormal fields unless --convert): Q6_K at every M, Q4_K where M % 4 < 2.
@pytest.mark.parametrize("kind,m", [("Q4_K", 1), ("Q4_K", 2), ("Q4_K", 4), ("Q6_K", 1), ("Q6_K", 2)])
@pytest.mark.parametrize("convert", [False, True])
def test_tool_runs_and_names_the_route(tool, kind, m, convert):
    args = ["--type", kind, "--m", str(m), "--blocks", "2", "--n", "16", "--reps", "2"]
    r = run(tool, *args, *(["--convert"] if convert else []))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{kind}, {m} row(s) of x")
    fields = "converted" if convert else "subnormal"
    assert f"block ({fields} fields)" in lines[1]
    stem = "avx2-q4k" if kind == "Q4_K" else "avx2-q6k"
    subnormal = not convert and (kind == "Q6_K" or m % 4 < 2)
    assert f"driver ({stem}{'-subnormal' if subnormal else ''})" in lines[2]
    for line in lines[1:3]:
        ns = float(line.split(": ")[1].split(" ns")[0])
        assert ns > 0


@pytest.mark.parametrize("args,message", [
    (["--type", "Q5_K"], "--type: expected Q4_K or Q6_K, got Q5_K"),
    (["--m", "3"], "--m: expected 1, 2 or 4 rows of x"),
    (["--n", "0"], "must be positive"),
    (["--blocks"], "missing value after --blocks"),
    (["--bogus"], "unknown argument --bogus"),
])
def test_tool_refuses_bad_arguments(tool, args, message):
    r = run(tool, *args)
    assert r.returncode == 2
    assert message in r.stderr
