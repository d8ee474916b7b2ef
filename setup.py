"""Builds torch_qmm._C with torch.utils.cpp_extension (ninja).

Install without build isolation so the extension compiles against the torch you already have
(a bare `torch` requirement in an isolated build would download a multi-GB CUDA wheel):
    pip install --no-build-isolation -e ".[test]"      (see README.md / install.sh)
"""

import glob
import os
import runpy
import shutil
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_mps() -> bool:
    """Whether the MPS executor (csrc/mps/*.mm) is built: on macOS, with a torch built with MPS.
    torch's BuildExtension accepts .mm sources only when torch.backends.mps.is_built()."""
    return sys.platform == "darwin" and torch.backends.mps.is_built()


def sources() -> list[str]:
    found = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    if build_mps():
        # The MPS executor (Objective-C++). It embeds metal/'s sources, one per kernel:
        # csrc/mps/embed_metal.py writes csrc/mps/metal_source.inc (generated, git-ignored).
        embed = runpy.run_path(os.path.join(ROOT, "csrc", "mps", "embed_metal.py"))
        embed["write_embedded_source"]()
        # Optional: with Apple's command-line tools (`xcrun`), metal/ compiled once now into a
        # metallib shipped next to _C, which the executor loads before compiling any source.
        if shutil.which("xcrun"):
            embed["build_metallib"](os.path.join(ROOT, "torch_qmm"))
        found += sorted(glob.glob(os.path.join("csrc", "mps", "*.mm")))
    return found


def compile_args() -> list[str]:
    args = ["-O3", "-std=c++17", "-fvisibility=hidden"]
    if sys.platform.startswith("linux"):
        # ATen's at::parallel_for is OpenMP in the torch wheels: without -fopenmp it runs serially.
        args += ["-fopenmp"]
        if os.environ.get("TORCH_QMM_PORTABLE", "0") != "1":
            # Built from source on the machine that runs it (set TORCH_QMM_PORTABLE=1 for a
            # redistributable build).
            args += ["-march=native"]
    return args


def link_args() -> list[str]:
    if build_mps():
        return ["-framework", "Metal", "-framework", "Foundation"]
    if sys.platform == "darwin":
        return []
    return ["-fopenmp"]


setup(
    packages=find_packages(include=["torch_qmm", "torch_qmm.*"]),
    # metalsim's shim headers (metal_* have no extension) and runtime ship with the package.
    package_data={
        "torch_qmm": [
            "metalsim/README.md",
            "metalsim/runtime.c",
            "metalsim/include/*",
            "metalsim/include/metalsim/*.h",
            "metalsim/include/stage/*",
            "*.metallib",  # built on macOS when xcrun exists (csrc/mps/embed_metal.py)
        ]
    },
    ext_modules=[
        CppExtension(
            "torch_qmm._C",
            sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": compile_args()},
            extra_link_args=link_args(),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
