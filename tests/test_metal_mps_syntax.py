"""The MPS executor (csrc/mps/*.mm) cannot run here (no Apple hardware). What Linux CI can
check: the Objective-C++ parses and type-checks against the real ATen/mps headers and stub headers
declaring exactly the Apple APIs it uses (tests/metal_mps_stubs/, written from Apple's docs), in
both ARC and manual reference counting, against the macOS 15 SDK's declarations and the macOS 14 SDK's; the source it compiles for a kernel (the generated
metal_source.inc through csrc/mps/metal_kernel_source.h, built here as plain C++) is the text
torch_qmm/metal_source.py gives and metalsim runs; and that text compiles to that kernel alone."""

from __future__ import annotations

import random
import runpy
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from torch_qmm import metal_source

ROOT = Path(__file__).resolve().parents[1]
EMBED = runpy.run_path(str(ROOT / "csrc" / "mps" / "embed_metal.py"))


def _clang(cxx: bool = False) -> str:
    for name in (("clang++-19", "clang++") if cxx else ("clang-19", "clang")):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("clang is needed for the Objective-C++ syntax check (apt-get install -y clang-19)")


@pytest.mark.parametrize("sdk", [15, 14], ids=["sdk15", "sdk14"])
@pytest.mark.parametrize("arc", [False, True], ids=["mrc", "arc"])
def test_mps_executor_compiles_syntax_only(tmp_path, arc, sdk):
    """sdk: the macOS SDK the stub headers stand for; 14 lacks MTLCompileOptions' mathMode and
    mathFloatingPointFunctions (the executor declares them itself), 15 deprecates fastMathEnabled."""
    from torch.utils.cpp_extension import include_paths

    EMBED["write_embedded_source"](tmp_path / EMBED["OUTPUT"].name)
    cmd = [_clang(), "-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-Wno-c++20-extensions", "-Werror=objc-method-access",
           "-Werror=deprecated-declarations",
           "-fobjc-runtime=gnustep-2.0", "-fblocks", "-I", str(ROOT / "tests" / "metal_mps_stubs"), "-I", str(tmp_path),
           "-I", str(ROOT / "csrc"), "-I", sysconfig.get_paths()["include"]]
    cmd += [f"-I{p}" for p in include_paths()]
    if arc:
        cmd.append("-fobjc-arc")
    if sdk == 14:
        cmd.append("-DTQMM_STUB_MACOS_SDK_14")
    for mm in sorted((ROOT / "csrc" / "mps").glob("*.mm")):
        result = subprocess.run(cmd + [str(mm)], capture_output=True, text=True)
        assert result.returncode == 0, f"{mm.name}:\n{result.stderr[-4000:]}"


def test_the_executor_compiles_the_same_text_as_metal_source(tmp_path):
    """Every kernel's source as the MPS build assembles it (C++, from the generated tables) is
    byte for byte metal_source.kernel_source(name); an unknown name gives ""."""
    EMBED["write_embedded_source"](tmp_path / EMBED["OUTPUT"].name)
    (tmp_path / "dump.cpp").write_text(
        '#include <cstdio>\n#include <iostream>\n#include "mps/metal_kernel_source.h"\n'
        "int main() {\n  for (const MetalKernelSource& k : kMetalKernels)\n"
        '    std::cout << k.name << "\\x1e" << torch_qmm::mps::kernel_source(k.name) << "\\x1d";\n'
        '  std::cout << "nope\\x1e" << torch_qmm::mps::kernel_source("affine_qmv_fast_float_gs_64_b_7") << "\\x1d";\n'
        "}\n")
    (tmp_path / "mps").mkdir()
    shutil.copy(ROOT / "csrc" / "mps" / "metal_kernel_source.h", tmp_path / "mps")
    shutil.copy(tmp_path / "metal_source.inc", tmp_path / "mps")
    exe = tmp_path / "dump"
    subprocess.run([_clang(cxx=True), "-std=c++17", "-O0", "-I", str(tmp_path), str(tmp_path / "dump.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = dict(item.split("\x1e", 1) for item in out.split("\x1d") if item)
    assert got.pop("nope") == ""
    assert list(got) == list(metal_source.kernels())
    for name, text in got.items():
        assert text == metal_source.kernel_source(name), name


def test_kernel_names_agree_with_the_compiled_libraries():
    """metal_source reads the instantiation macros itself: its names must be what clang's
    preprocessor makes of the same macros (metalsim compiles the whole library files)."""
    from metal_helpers import require_clang

    require_clang()
    from torch_qmm.metalsim_backend import gguf_library, library

    names = set(metal_source.kernels())
    compiled = set(gguf_library().kernels)
    for bits in (3, 8):
        compiled |= set(library(bits).kernels)
    assert {n for n in names if n.endswith(("_b_3", "_b_8")) or n.startswith("gguf_")} == compiled
    assert {n.rsplit("_b_", 1)[1] for n in names if n.startswith("affine_")} == {"2", "3", "4", "5", "6", "8"}


def test_a_kernel_source_compiles_to_that_kernel_alone():
    from metal_helpers import require_clang

    require_clang()
    from torch_qmm import metalsim

    names = list(metal_source.kernels())
    for name in random.Random(0).sample(names, 3) + [names[-1]]:
        assert metalsim.compile(metal_source.kernel_source(name)).kernels == [name]
    with pytest.raises(KeyError, match="affine_qmv_fast_float_gs_64_b_7"):
        metal_source.kernel_source("affine_qmv_fast_float_gs_64_b_7")


def test_a_dispatch_compiles_only_the_kernel_it_launches():
    """A fresh process: one qmm on the metalsim backend compiles exactly the planned kernel; concurrent
    first uses of a kernel compile it once."""
    from metal_helpers import require_clang

    require_clang()
    code = (
        "import json, torch, torch_qmm\n"
        "from torch_qmm.metalsim_backend import backend, compiled_kernels, kernel_library, last_launches\n"
        "w = torch.randn(40, 128); x = torch.randn(3, 128)\n"
        "wq, s, b = torch_qmm.quantize(w, group_size=64, bits=5)\n"  # CPU op: no Metal kernel
        "with backend():\n"
        "    torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=5)\n"
        "(l,) = last_launches()\n"
        "first = [l.kernel, compiled_kernels(), kernel_library(l.kernel).kernels]\n"
        # four threads' first use of another kernel: one compile, one library for all
        "import threading\n"
        "name = 'gguf_qmv_float_q6_K'; got = []\n"
        "ts = [threading.Thread(target=lambda: got.append(kernel_library(name))) for _ in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(json.dumps(first + [compiled_kernels(), len({id(g) for g in got}), len(got)]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    kernel, compiled, in_library, compiled_after, libraries, calls = json.loads(result.stdout.strip().splitlines()[-1])
    assert kernel == "affine_qmm_t_bm4_float_gs_64_b_5"
    assert compiled == [kernel] and in_library == [kernel]
    assert compiled_after == [kernel, "gguf_qmv_float_q6_K"] and (libraries, calls) == (1, 4)
