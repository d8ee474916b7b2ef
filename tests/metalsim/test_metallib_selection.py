"""The install-time metallib (csrc/mps/embed_metal.py's build_metallib, run by setup.py when
`xcrun` exists) and the executor's choice between it and a kernel's source
(csrc/mps/metallib_choice.h). No Apple tools here: the choice is compiled and run as plain C++,
the build runs against a stand-in `xcrun` that records its command lines, and metalsim compiles
the very sources the metallib is built from. Nothing here shows that a Mac loads the metallib."""
from __future__ import annotations

import os
import runpy
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EMBED = runpy.run_path(str(ROOT / "csrc" / "mps" / "embed_metal.py"))


def _cxx():
    for name in ("clang++-19", "clang++", "g++"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("a C++ compiler is needed (apt-get install -y clang-19)")


def test_the_choice_between_metallib_and_source(tmp_path):
    (tmp_path / "choice.cpp").write_text(
        '#include <iostream>\n#include "mps/metallib_choice.h"\nusing namespace torch_qmm::mps;\n'
        "int main() {\n"
        '  std::cout << metallib_path("/site/torch_qmm/_C.cpython-312-darwin.so", "torch_qmm-ab.metallib") << "\\n"\n'
        '            << metallib_path("_C.so", "x.metallib") << "\\n";\n'
        '  std::cout << metallib_enabled(nullptr) << metallib_enabled("0") << metallib_enabled("1") << "\\n";\n'
        "  for (int e = 0; e < 2; e++) for (int l = 0; l < 2; l++) for (int f = 0; f < 2; f++)\n"
        "    std::cout << (kernel_origin(e, l, f) == KernelOrigin::kMetallib ? 'M' : 'S');\n"
        '  std::cout << "\\n";\n}\n')
    exe = tmp_path / "choice"
    subprocess.run([_cxx(), "-std=c++17", "-I", str(ROOT / "csrc"), str(tmp_path / "choice.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[0] == "/site/torch_qmm/torch_qmm-ab.metallib"   # next to the extension module
    assert out[1] == "./x.metallib"
    assert out[2] == "101"                                      # TORCH_QMM_METALLIB=0 disables it
    # only enabled + loaded + has the function takes the metallib; any other case compiles source
    assert out[3] == "SSSSSSSM"


def _fake_xcrun(tmp_path, fail_on=None):
    """An `xcrun` that logs its arguments and writes the file after -o (or fails for one tool)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "xcrun.log"
    script = bin_dir / "xcrun"
    fail = f'[ "$3" = "{fail_on}" ] && {{ echo "error: {fail_on} broke" >&2; exit 1; }}\n' if fail_on else ""
    script.write_text("#!/bin/sh\n" f'echo "$@" >> "{log}"\n' + fail +
                      'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo built > "$2"; shift; done\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir, log


def test_build_metallib_runs_apples_tools_and_names_the_sources(tmp_path, monkeypatch):
    bin_dir, log = _fake_xcrun(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out_dir = tmp_path / "pkg"
    out_dir.mkdir()
    (out_dir / "torch_qmm-0000000000000000.metallib").write_text("stale")
    ms = EMBED["metal_source"]()
    built = EMBED["build_metallib"](out_dir, ms)
    assert built == out_dir / EMBED["metallib_name"](ms)
    assert sorted(p.name for p in out_dir.iterdir()) == [built.name]      # the stale one removed
    calls = log.read_text().splitlines()
    assert len(calls) == len(ms.LIBRARIES) + 1
    for call, library in zip(calls, ms.LIBRARIES):
        assert call.startswith("-sdk macosx metal -std=metal3.1 -fno-fast-math -c ") and library in call
    assert calls[-1].startswith("-sdk macosx metallib ") and calls[-1].endswith(f"-o {built}")
    # the executor looks for exactly that name (the generated table it is built with)
    assert f'kMetallibName[] = "{built.name}";' in EMBED["embedded_source"](ms)


def test_without_xcrun_or_when_it_fails_no_metallib_is_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert EMBED["build_metallib"](tmp_path) is None
    bin_dir, _ = _fake_xcrun(tmp_path, fail_on="metallib")
    monkeypatch.setenv("PATH", str(bin_dir))
    out_dir = tmp_path / "pkg"
    out_dir.mkdir()
    with pytest.warns(UserWarning, match="metallib broke"):
        assert EMBED["build_metallib"](out_dir) is None
    assert not list(out_dir.glob("*.metallib"))


def test_the_metallib_sources_hold_every_kernel_the_executor_asks_for(metalsim):
    # what `xcrun metal` compiles, parsed and strictness-checked by metalsim (kernels built
    # lazily, none here): each library's source defines exactly the kernels of its table, so
    # the executor finds every kernel in the metallib and never falls back for a known name
    ms = EMBED["metal_source"]()
    table = ms.kernels(ms.metal_dir())
    for library in ms.LIBRARIES:
        lib = metalsim.compile(EMBED["library_source"](library, ms), lazy=True)
        assert sorted(lib.kernels) == sorted(n for n, k in table.items() if k.library == library)
