"""The chunk kernels compile for each instruction-set variant, on any x86 machine with g++.

The build uses -march=native, so on a CPU without AVX-512 (or without AVX512_BF16 / VBMI) the
AVX-512 kernels of csrc/cpu/ (chunk.h, qmm_chunked.cpp, the GGUF units) are compiled out and no
other test reaches them there (nor the fallbacks that stand in for them elsewhere). This one
compiles those units with the features the kernels test for (g++ -fsyntax-only instantiates the templates the unit uses), so that a change to
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
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# AVX-512 without BF16 (the float32 multipliers only), every feature the kernels test for, AVX2
# only, and no AVX at all (the portable fallbacks: each unit's kernels compiled out).
FEATURES = {
    "avx512": [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512-bf16-vbmi": [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi"],
    "avx2": AVX2,
    "portable": ["-march=x86-64"],
}
# (unit, features): the bfloat16 GGUF chunks need AVX512_BF16, the float32 ones AVX-512 (AVX2 in
# gguf_avx2.cpp); avx2_chunked.cpp is AVX2 code, checked here to compile alongside the others on
# an AVX-512 build. The GGUF units share gguf_chunk_kernel.h: each compiles on every variant.
GGUF_UNITS = ["csrc/cpu/gguf_chunked.cpp", "csrc/cpu/gguf_f32.cpp", "csrc/cpu/gguf_avx2.cpp"]
CASES = [("csrc/cpu/qmm_chunked.cpp", "avx512"), ("csrc/cpu/qmm_chunked.cpp", "avx512-bf16-vbmi"),
         ("csrc/cpu/avx2_chunked.cpp", "avx512-bf16-vbmi"),
         *[(u, f) for u in GGUF_UNITS for f in FEATURES]]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                                reason="needs g++ targeting x86-64")


@pytest.mark.parametrize("unit, features", CASES, ids=[f"{Path(u).stem}-{f}" for u, f in CASES])
def test_avx512_unit_compiles(unit, features):
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-w", "-fopenmp", *FEATURES[features],
           f"-I{ROOT / 'csrc'}", f"-I{sysconfig.get_paths()['include']}", *[f"-I{p}" for p in include_paths()],
           str(ROOT / unit)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{unit} with {features} does not compile:\n{r.stderr[-4000:]}"
