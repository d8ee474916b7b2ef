"""The AVX-512 chunk kernels compile, on any x86 machine with g++ and torch's headers.

The build uses -march=native, so on a CPU without AVX-512 (or without AVX512_BF16 / VBMI) the
AVX-512 kernels of csrc/cpu/ (chunk.h, qmm_chunked.cpp, gguf_chunked.cpp) are compiled out and
no other test reaches them there. This one compiles those units with the AVX-512 features the
kernels test for (g++ -fsyntax-only instantiates the templates the unit uses), so that a change to
the shared driver (chunk_driver.h) or to the multipliers cannot leave them broken unnoticed.
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
# AVX-512 without BF16 (the float32 multiplier only), and every feature the kernels test for.
FEATURES = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512-bf16-vbmi": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi"],
}
# (unit, features): the GGUF chunks need AVX512_BF16; avx2_chunked.cpp is AVX2 code, checked here to
# compile alongside the others on an AVX-512 build.
CASES = [("csrc/cpu/qmm_chunked.cpp", "avx512"), ("csrc/cpu/qmm_chunked.cpp", "avx512-bf16-vbmi"),
         ("csrc/cpu/gguf_chunked.cpp", "avx512-bf16-vbmi"), ("csrc/cpu/avx2_chunked.cpp", "avx512-bf16-vbmi")]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                                reason="needs g++ targeting x86-64")


@pytest.mark.parametrize("unit, features", CASES, ids=[f"{Path(u).stem}-{f}" for u, f in CASES])
def test_avx512_unit_compiles(unit, features):
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-w", "-fopenmp", "-mavx2", "-mfma", "-mf16c", *FEATURES[features],
           f"-I{ROOT / 'csrc'}", f"-I{sysconfig.get_paths()['include']}", *[f"-I{p}" for p in include_paths()],
           str(ROOT / unit)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{unit} with {features} does not compile:\n{r.stderr[-4000:]}"
