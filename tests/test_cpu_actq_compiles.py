"""The int8-activation kernels compile for every ISA variant, on any x86 machine with g++.

The build uses -march=native, so only one variant of csrc/cpu/actq_dot.h is compiled here (AVX2's
vpmaddubsw on a CPU without VNNI) and the portable kernel is the only one a CPU without AVX2 gets.
This compiles csrc/cpu/actq_qmm.cpp with AVX-VNNI, with AVX512_VNNI + AVX512VL, and without AVX2
(g++ -fsyntax-only instantiates the templates the unit uses), so that none is left broken unnoticed.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parent.parent
FLAGS = {
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
    "portable": ["-march=x86-64"],
}

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                                reason="needs g++ targeting x86-64")


@pytest.mark.parametrize("variant", list(FLAGS))
def test_actq_unit_compiles(variant):
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-w", "-fopenmp", *FLAGS[variant], f"-I{ROOT / 'csrc'}",
           f"-I{sysconfig.get_paths()['include']}", *[f"-I{p}" for p in include_paths()],
           str(ROOT / "csrc/cpu/actq_qmm.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"actq_qmm.cpp ({variant}) does not compile:\n{r.stderr[-4000:]}"
