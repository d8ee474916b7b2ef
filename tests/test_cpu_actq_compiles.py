"""The int8-activation kernels compile for every ISA variant, on any x86 machine with g++.

The build uses -march=native, so only one variant of csrc/cpu/actq_dot.h and of the kernels is
compiled here. This compiles csrc/cpu/actq_qmm.cpp (affine) and csrc/cpu/actq_gguf.cpp (Q4_K, Q6_K)
for each instruction-set variant (g++ -fsyntax-only instantiates the templates the units use), so
that none is left broken unnoticed:
- avx2: the 256-bit kernels with vpmaddubsw + vpmaddwd, nothing wider;
- avxvnni: the 256-bit affine kernels with AVX-VNNI's vpdpbusd;
- avx512bw: AVX-512 without VNNI: the 512-bit GGUF kernels, the 256-bit affine ones on AVX2's
  products;
- avx512vnni: the 512-bit kernels (affine vpdpbusd zmm, GGUF) and the 256-bit ones with
  AVX512_VNNI + AVX512VL's vpdpbusd ymm (the TORCH_QMM_CPU_NO_INT8_512 route);
- avx512vnni-novl: AVX512_VNNI without AVX512VL (the 512-bit kernels, 256-bit ones on AVX2's
  products);
- portable: no AVX2, the portable kernels only.
The AVX-512 float32 GGUF units (csrc/cpu/gguf_f32.cpp, gguf_panel.cpp) likewise compile with and
without AVX512_VBMI (gguf_fields.h unpacks Q4_K's scales with a byte permute where it has it).
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
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq"]
FLAGS = {
    "avx2": AVX2,
    "avxvnni": [*AVX2, "-mavxvnni"],
    "avx512bw": [*AVX512, "-mavx512vl"],
    "avx512vnni": [*AVX512, "-mavx512vl", "-mavx512vnni"],
    "avx512vnni-novl": [*AVX512, "-mavx512vnni"],
    "portable": ["-march=x86-64"],
}
UNITS = ["actq_qmm.cpp", "actq_gguf.cpp"]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                                reason="needs g++ targeting x86-64")


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("variant", list(FLAGS))
def test_actq_unit_compiles(variant, unit):
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-w", "-fopenmp", *FLAGS[variant], f"-I{ROOT / 'csrc'}",
           f"-I{sysconfig.get_paths()['include']}", *[f"-I{p}" for p in include_paths()],
           str(ROOT / "csrc/cpu" / unit)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{unit} ({variant}) does not compile:\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("variant, macros", [
    ("avx2", set()), ("avx512bw", {"__AVX512BW__"}), ("avx512vnni", {"__AVX512BW__", "__AVX512VNNI__"}),
    ("avx512vnni-novl", {"__AVX512BW__", "__AVX512VNNI__"}), ("portable", set()),
])
def test_variants_define_what_the_kernels_test(variant, macros):
    # The flags of each variant reach the guards of the kernels it is meant to compile (a flag
    # the compiler ignored would leave a variant compiling nothing new).
    r = subprocess.run(["g++", "-dM", "-E", *FLAGS[variant], "-x", "c++", "/dev/null"], capture_output=True,
                       text=True, timeout=60)
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define")}
    assert {"__AVX512BW__", "__AVX512VNNI__"} & defined == macros
    assert ("__AVX2__" in defined) == (variant != "portable")


@pytest.mark.parametrize("unit", ["gguf_f32.cpp", "gguf_panel.cpp"])
@pytest.mark.parametrize("vbmi", [False, True], ids=["avx512bw", "avx512vbmi"])
def test_gguf_float32_units_compile_with_and_without_vbmi(vbmi, unit):
    flags = [*AVX512, "-mavx512vl", *(["-mavx512vbmi"] if vbmi else [])]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-w", "-fopenmp", *flags, f"-I{ROOT / 'csrc'}",
           f"-I{sysconfig.get_paths()['include']}", *[f"-I{p}" for p in include_paths()],
           str(ROOT / "csrc/cpu" / unit)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{unit} ({'with' if vbmi else 'without'} VBMI) does not compile:\n{r.stderr[-4000:]}"
    defined = subprocess.run(["g++", "-dM", "-E", *flags, "-x", "c++", "/dev/null"], capture_output=True, text=True,
                             timeout=60).stdout
    assert ("#define __AVX512VBMI__" in defined) == vbmi
