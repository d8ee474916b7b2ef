"""The MPS executor (csrc/mps/*.mm) cannot run here (no Apple hardware). What Linux CI can
check: the Objective-C++ parses and type-checks against the real ATen/mps headers and stub headers
declaring exactly the Apple APIs it uses (tests/metal_mps_stubs/, written from Apple's docs), in
both ARC and manual reference counting; and the Metal source it embeds (metal/ flattened by
csrc/mps/embed_metal.py) compiles to the same kernels as metal/affine.metal + metal/gguf.metal."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBED = runpy.run_path(str(ROOT / "csrc" / "mps" / "embed_metal.py"))


def _clang() -> str:
    for name in ("clang-19", "clang"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("clang is needed for the Objective-C++ syntax check (apt-get install -y clang-19)")


@pytest.mark.parametrize("arc", [False, True], ids=["mrc", "arc"])
def test_mps_executor_compiles_syntax_only(tmp_path, arc):
    from torch.utils.cpp_extension import include_paths

    EMBED["write_embedded_source"](tmp_path / EMBED["OUTPUT"].name)
    cmd = [_clang(), "-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-Wno-c++20-extensions", "-Werror=objc-method-access",
           "-fobjc-runtime=gnustep-2.0", "-fblocks", "-I", str(ROOT / "tests" / "metal_mps_stubs"), "-I", str(tmp_path),
           "-I", str(ROOT / "csrc"), "-I", sysconfig.get_paths()["include"]]
    cmd += [f"-I{p}" for p in include_paths()]
    if arc:
        cmd.append("-fobjc-arc")
    for mm in sorted((ROOT / "csrc" / "mps").glob("*.mm")):
        result = subprocess.run(cmd + [str(mm)], capture_output=True, text=True)
        assert result.returncode == 0, f"{mm.name}:\n{result.stderr[-4000:]}"


def test_embedded_source_compiles_to_the_same_kernels(tmp_path):
    from metal_helpers import require_clang

    require_clang()
    from torch_qmm import metalsim
    from torch_qmm.metalsim_backend import gguf_library, library

    flat = tmp_path / "flat.metal"
    flat.write_text(EMBED["flatten_all"]())
    assert '#include "' not in flat.read_text()
    lib = metalsim.compile(flat, defines={"TORCH_QMM_ONLY_BITS": "6"})
    assert sorted(lib.kernels) == sorted(library(6).kernels + gguf_library().kernels)
