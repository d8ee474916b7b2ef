"""The llama.cpp peer of the kernel benchmark: ggml's CPU MUL_MAT, timed by ggml's own
`test-backend-ops perf` in a child process.

Where ggml comes from: the llama-cpp-python sdist on PyPI (`pip download --no-deps --no-binary
:all: llama-cpp-python`), which vendors llama.cpp under vendor/llama.cpp. Its `ggml/` folder and
`tests/test-backend-ops.cpp` are copied to `<cache>/llamacpp-<version>/src` with a CMakeLists.txt
of ours that builds that one executable against ggml (CPU backend only, GGML_NATIVE, Release; no
libllama), and built once; later runs reuse the binary (`<cache>` = $XDG_CACHE_HOME/torch_qmm, by
default ~/.cache/torch_qmm; TORCH_QMM_LLAMACPP_SDIST names a local sdist instead of downloading).
test-backend-ops sets the CPU backend to half the hardware threads; the copy reads
TORCH_QMM_GGML_THREADS instead (one line replaced at build time), which the benchmark sets to
torch.get_num_threads().

Which cases: test-backend-ops' perf list (make_test_cases_perf) holds MUL_MAT of every ggml type at
m=4096 (rows of W, our N), k=14336, n (rows of x, our M) in {1, 2, 3, 4, 5, 8, 512}, and Q4_K at m
in {4096, 6144, 6272, 14336}, k=4096, n in {1, 2, 3, 4, 8}; those are selected by `-o MUL_MAT -p
<regex of the case's parameters>`. Any other shape is run from a one-line --test-file (the format
test-backend-ops reads for graphs exported by test-export-graph-ops: a generic MUL_MAT of the same
sources). x is float32 in every case (ggml quantizes it to 8 bits itself before the dot products).

How ggml times: one weight tensor, one graph holding the MUL_MAT many times, run for at least one
second; the reported time is the mean per MUL_MAT. The weights are therefore hot (the same tensor
every call); compare with `bench --hot`, which gives torch_qmm one weight copy as well.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

# torch_qmm format (Config.fmt, bits) -> the ggml type it is compared with. Affine 4/5/8-bit have
# no ggml twin; q4_0 / q5_0 / q8_0 (one f16 scale per 32 weights, no bias) are the nearest.
GGML_TYPES = {("Q2_K", None): "q2_K", ("Q3_K", None): "q3_K", ("Q4_K", None): "q4_K", ("Q5_K", None): "q5_K",
              ("Q6_K", None): "q6_K", ("IQ4_XS", None): "iq4_xs", ("affine", 4): "q4_0", ("affine", 5): "q5_0", ("affine", 8): "q8_0",
              ("mxfp4", None): "mxfp4", ("IQ1_S", None): "iq1_s", ("IQ1_M", None): "iq1_m", ("IQ2_XXS", None): "iq2_xxs",
              ("IQ2_XS", None): "iq2_xs", ("IQ2_S", None): "iq2_s", ("IQ3_XXS", None): "iq3_xxs", ("IQ3_S", None): "iq3_s"}
# ggml type -> (weights per block, bytes per block): the weight bytes of a ggml matrix.
GGML_BLOCKS = {"q4_0": (32, 18), "q5_0": (32, 22), "q8_0": (32, 34), "q2_K": (256, 84), "q3_K": (256, 110),
               "q4_K": (256, 144), "q5_K": (256, 176), "q6_K": (256, 210), "iq4_xs": (256, 136),
               "mxfp4": (32, 17), "iq1_s": (256, 50), "iq1_m": (256, 56), "iq2_xxs": (256, 66), "iq2_xs": (256, 74),
               "iq2_s": (256, 82), "iq3_xxs": (256, 98), "iq3_s": (256, 110)}
# ggml type name -> enum ggml_type value (ggml.h), for --test-file lines.
GGML_TYPE_IDS = {"f32": 0, "q4_0": 2, "q5_0": 6, "q8_0": 8, "q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13, "q6_K": 14,
                 "iq2_xxs": 16, "iq2_xs": 17, "iq3_xxs": 18, "iq1_s": 19, "iq3_s": 21, "iq2_s": 22, "iq4_xs": 23,
                 "iq1_m": 29, "mxfp4": 39}

# The MUL_MAT cases of make_test_cases_perf (see the module docstring): (N, K) -> rows of x.
PERF_ALL_TYPES = {(4096, 14336): {1, 2, 3, 4, 5, 8, 512}}
PERF_Q4_K = {(n, 4096): {1, 2, 3, 4, 8} for n in (4096, 6144, 6272, 14336)}

ISOLATION = ("llamacpp is ggml's test-backend-ops perf mode in a child process, one case per run, right after "
             "torch_qmm's first config of that case was timed (same background load); ggml reuses one weight "
             "tensor (hot)")


class LlamaCppUnavailable(RuntimeError):
    """ggml's test-backend-ops could not be obtained or built here (the message says why)."""


@dataclass(frozen=True)
class Case:
    ggml_type: str
    n: int  # rows of W (ggml's m)
    k: int
    m: int  # rows of x (ggml's n)

    def weight_bytes(self) -> int:
        per, nbytes = GGML_BLOCKS[self.ggml_type]
        return self.n * (self.k // per) * nbytes

    def in_perf_list(self) -> bool:
        if self.m in PERF_ALL_TYPES.get((self.n, self.k), ()):
            return True
        return self.ggml_type == "q4_K" and self.m in PERF_Q4_K.get((self.n, self.k), ())

    def params_regex(self) -> str:
        """The -p regex that selects exactly this perf-list case (matched against its parameters)."""
        return (rf"^type_a={self.ggml_type},type_b=f32,m={self.n},n={self.m},k={self.k},bs=\[1,1\],nr=\[1,1\],"
                r"per=\[0,1,2,3\]")

    def test_file_line(self, mul_mat_op: int) -> str:
        """A --test-file line: op, out type, out ne[4], no op params, 2 sources (type, ne[4], nb[4]), no name."""
        per, nbytes = GGML_BLOCKS[self.ggml_type]
        row = self.k // per * nbytes
        w = [GGML_TYPE_IDS[self.ggml_type], self.k, self.n, 1, 1, nbytes, row, row * self.n, row * self.n]
        x = [0, self.k, self.m, 1, 1, 4, 4 * self.k, 4 * self.k * self.m, 4 * self.k * self.m]
        fields = [mul_mat_op, 0, self.n, self.m, 1, 1, 0, 2, *w, *x, "-"]
        return " ".join(str(f) for f in fields)


def case_for(fmt: str, bits: int, n: int, k: int, m: int) -> Case | None:
    """The ggml case a torch_qmm config is compared with, or None (no ggml counterpart)."""
    t = GGML_TYPES.get((fmt, bits if fmt == "affine" else None))
    if t is None or k % GGML_BLOCKS[t][0]:
        return None
    return Case(t, n, k, m)


# One result line of the console printer, e.g.
#   MUL_MAT(type_a=q4_0,...,pad=0):     69 runs - 22259.23 us/run - 117.44 MFLOP/run - 5.28 GFLOPS
_RESULT = re.compile(r"^\s*(?P<op>[A-Z_]+)\((?P<params>.*)\):\s+(?P<runs>\d+) runs - +(?P<us>[0-9.]+) us/run")
_UNSUPPORTED = re.compile(r"^\s*(?P<op>[A-Z_]+)\((?P<params>.*)\):\s+not supported")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_perf_output(text: str) -> list[dict]:
    """The results of a test-backend-ops perf run: [{op, params, runs, us_per_run}] (us_per_run None
    for cases the backend does not support)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        if mt := _RESULT.match(line):
            out.append({"op": mt["op"], "params": mt["params"], "runs": int(mt["runs"]), "us_per_run": float(mt["us"])})
        elif mt := _UNSUPPORTED.match(line):
            out.append({"op": mt["op"], "params": mt["params"], "runs": 0, "us_per_run": None})
    return out


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "torch_qmm"


_THREADS_LINE = "ggml_backend_set_n_threads_fn(backend.get(), std::max<int>(1, N_THREADS/2));"
_THREADS_PATCHED = ('ggml_backend_set_n_threads_fn(backend.get(), std::max<int>(1, std::getenv("TORCH_QMM_GGML_THREADS")'
                    ' ? std::atoi(std::getenv("TORCH_QMM_GGML_THREADS")) : int(N_THREADS/2)));')
_CMAKELISTS = """cmake_minimum_required(VERSION 3.14)
project(torch_qmm_ggml_peer C CXX)
add_subdirectory(ggml)
add_executable(test-backend-ops tests/test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
target_compile_features(test-backend-ops PRIVATE cxx_std_17)
"""
_CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_BLAS=OFF", "-DGGML_METAL=OFF",
                "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_OPENCL=OFF", "-DBUILD_SHARED_LIBS=OFF"]


def _sdist(root: Path, log) -> Path:
    local = os.environ.get("TORCH_QMM_LLAMACPP_SDIST")
    if local:
        if not Path(local).is_file():
            raise LlamaCppUnavailable(f"TORCH_QMM_LLAMACPP_SDIST={local!r} is not a file")
        return Path(local)
    found = sorted((root / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    log("downloading the llama-cpp-python sdist (vendors llama.cpp) ...")
    (root / "sdist").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "llama-cpp-python", "-d", str(root / "sdist")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted((root / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise LlamaCppUnavailable(f"pip download of llama-cpp-python failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return found[-1]


def _extract(sdist: Path, src: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = []
        for mem in tar.getmembers():
            parts = mem.name.split("/")
            if len(parts) > 3 and parts[1:3] == ["vendor", "llama.cpp"]:
                rel = "/".join(parts[3:])
                if rel.startswith("ggml/") or rel == "tests/test-backend-ops.cpp":
                    mem.name = rel
                    members.append(mem)
        if not any(m.name == "tests/test-backend-ops.cpp" for m in members):
            raise LlamaCppUnavailable(f"{sdist.name} has no vendor/llama.cpp/tests/test-backend-ops.cpp")
        try:
            tar.extractall(src, members=members, filter="data")
        except TypeError:  # Python without extraction filters
            tar.extractall(src, members=members)
    cpp = src / "tests" / "test-backend-ops.cpp"
    text = cpp.read_text()
    if _THREADS_LINE not in text:
        raise LlamaCppUnavailable(f"{sdist.name}: test-backend-ops.cpp does not set its thread count as expected "
                                  f"({_THREADS_LINE!r}); the benchmark cannot choose ggml's threads")
    cpp.write_text(text.replace(_THREADS_LINE, _THREADS_PATCHED))
    (src / "CMakeLists.txt").write_text(_CMAKELISTS)


def ensure_binary(log=print) -> Path:
    """ggml's test-backend-ops, built once into the cache (see the module docstring)."""
    root = cache_root()
    built = sorted(root.glob("llamacpp-*/build/test-backend-ops"))
    if built:
        return built[-1]
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise LlamaCppUnavailable(f"building ggml's test-backend-ops needs {' and '.join(missing)}, not found on PATH")
    sdist = _sdist(root, log)
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    home = root / f"llamacpp-{version}"
    src, build = home / "src", home / "build"
    if not (src / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        _extract(sdist, src)
    log(f"building ggml's test-backend-ops (llama-cpp-python {version}) in {build}, once ...")
    with open(home / "build.log", "w") as out:
        for cmd in (["cmake", "-S", str(src), "-B", str(build), *_CMAKE_FLAGS],
                    ["cmake", "--build", str(build), "--target", "test-backend-ops", "-j", str(os.cpu_count() or 2)]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = (home / "build.log").read_text()[-600:]
                raise LlamaCppUnavailable(f"{' '.join(cmd[:2])} failed (log: {home / 'build.log'}):\n{tail}")
    return build / "test-backend-ops"


def _mul_mat_op(binary: Path) -> int:
    """GGML_OP_MUL_MAT's value in the ggml.h the binary was built from."""
    header = binary.parents[1] / "src" / "ggml" / "include" / "ggml.h"
    body = header.read_text().split("enum ggml_op {", 1)[1].split("};", 1)[0]
    names = re.findall(r"^\s*(GGML_OP_[A-Z0-9_]+)", body, flags=re.M)
    return names.index("GGML_OP_MUL_MAT")


def time_case(binary: Path, case: Case, threads: int) -> dict:
    """One ggml perf run of `case`: {us_per_run, runs, params, how} (how: "perf-list" or "test-file")."""
    env = {**os.environ, "TORCH_QMM_GGML_THREADS": str(threads)}
    cmd = [str(binary), "perf", "-b", "CPU", "-o", "MUL_MAT"]
    if case.in_perf_list():
        cmd += ["-p", case.params_regex()]
        how = "perf-list"
    else:
        path = binary.parent / f"case-{case.ggml_type}-{case.n}x{case.k}-m{case.m}.txt"
        path.write_text(case.test_file_line(_mul_mat_op(binary)) + "\n")
        cmd += ["--test-file", str(path)]
        how = "test-file"
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    rows = [row for row in parse_perf_output(r.stdout) if row["op"] == "MUL_MAT"]
    if r.returncode != 0 or not rows or rows[0]["us_per_run"] is None:
        why = "not supported" if rows else (r.stderr or r.stdout).strip()[-200:]
        raise RuntimeError(f"test-backend-ops {how} {case}: {why}")
    return {**rows[0], "how": how}
