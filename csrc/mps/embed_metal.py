"""Writes the Metal source of the MPS build: csrc/mps/metal_source.inc (generated, not in git).

The executor (metal_executor.mm) compiles one kernel at a time, on its first use: newLibraryWithSource
of kMetalPreludes[library] + "\\n" + line + "\\n", the text torch_qmm/metal_source.py's
kernel_source(name) returns and that metalsim compiles in CI (torch_qmm/metalsim_backend.py).
The .inc holds the preludes (each library's headers flattened: newLibraryWithSource cannot open
our headers) and one {name, library, instantiation line} row per kernel, both taken from
metal_source.py, so nothing here restates the kernel table.

setup.py runs this on macOS before compiling csrc/mps/*.mm, then, when `xcrun` exists,
build_metallib(): every library of metal/ (kMetalPreludes[library] + all its instantiation lines)
compiled with Apple's command-line tools into one metallib shipped next to the extension module,
under the name kMetallibName, which hashes the embedded sources. The executor loads it first
(newLibraryWithURL) and compiles a kernel from source only when the metallib is absent, fails
to load or lacks the kernel (csrc/mps/metallib_choice.h).

    python csrc/mps/embed_metal.py [output]
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = Path(__file__).resolve().with_name("metal_source.inc")
_DELIM = "TQMM_SRC"  # raw-string delimiters are at most 16 characters


def metal_source():
    """torch_qmm/metal_source.py, loaded by path (importing the package would need the built _C)."""
    spec = importlib.util.spec_from_file_location("torch_qmm_metal_source", ROOT / "torch_qmm" / "metal_source.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _raw_literal(text: str) -> str:
    assert f"){_DELIM}\"" not in text
    # Chunks: some compilers limit the length of one string literal; adjacent literals concatenate.
    return "\n".join(f'R"{_DELIM}({text[i : i + 8000]}){_DELIM}"' for i in range(0, len(text), 8000))


def _plain_literal(text: str) -> str:
    if any(c in text for c in '"\\\n') or not text.isascii():
        raise ValueError(f"embed_metal: unexpected character in {text!r}")
    return f'"{text}"'


def _tables(ms) -> str:
    preludes = ",\n".join(f"// {lib}\n{_raw_literal(ms.prelude(lib, ms.metal_dir()))}" for lib in ms.LIBRARIES)
    rows = "\n".join(
        f"    {{{_plain_literal(k.name)}, {ms.LIBRARIES.index(k.library)}, {_plain_literal(k.line)}}},"
        for k in ms.kernels(ms.metal_dir()).values()
    )
    return (
        "// The headers of each library file of metal/ (" + ", ".join(ms.LIBRARIES) + "), flattened.\n"
        f"static const char* const kMetalPreludes[] = {{\n{preludes}}};\n"
        "// One row per kernel: kernel `name` alone compiles from kMetalPreludes[library] + \"\\n\" + line + \"\\n\".\n"
        "struct MetalKernelSource {\n  const char* name;\n  int library;\n  const char* line;\n};\n"
        f"static const MetalKernelSource kMetalKernels[] = {{\n{rows}\n}};\n"
    )


def metallib_name(ms=None) -> str:
    """The install-time metallib's file name: it names the sources it was built from."""
    digest = hashlib.sha256((_tables(ms or metal_source()) + " ".join(METAL_FLAGS)).encode()).hexdigest()[:16]
    return f"torch_qmm-{digest}.metallib"


def library_source(library: str, ms=None) -> str:
    """The source of every kernel of `library` at once: its prelude and all its instantiation lines
    (each kernel's own source, kernel_source(name), is the prelude and one of these lines)."""
    ms = ms or metal_source()
    lines = [k.line for k in ms.kernels(ms.metal_dir()).values() if k.library == library]
    return ms.prelude(library, ms.metal_dir()) + "\n" + "\n".join(lines) + "\n"


# Apple's command-line tools ("Building a shader library by precompiling source files"); the
# same language version and math mode as the executor's newLibraryWithSource options.
METAL_FLAGS = ("-std=metal3.1", "-fno-fast-math")


def build_metallib(out_dir: Path, ms=None) -> Path | None:
    """Compiles metal/ into out_dir/metallib_name() with `xcrun metal` and `xcrun metallib`;
    None (with a warning when the tools fail) if `xcrun` is missing: the executor then compiles
    each kernel from its source on first use, as without a metallib."""
    xcrun = shutil.which("xcrun")
    if xcrun is None:
        return None
    ms = ms or metal_source()
    out = Path(out_dir) / metallib_name(ms)
    with tempfile.TemporaryDirectory() as tmp:
        airs = []
        for library in ms.LIBRARIES:
            src = Path(tmp) / library
            src.write_text(library_source(library, ms))
            air = src.with_suffix(".air")
            cmd = [xcrun, "-sdk", "macosx", "metal", *METAL_FLAGS, "-c", str(src), "-o", str(air)]
            if not _run(cmd):
                return None
            airs.append(str(air))
        if not _run([xcrun, "-sdk", "macosx", "metallib", *airs, "-o", str(out)]):
            return None
    for stale in Path(out_dir).glob("torch_qmm-*.metallib"):
        if stale != out:
            stale.unlink()
    return out


def _run(cmd) -> bool:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        warnings.warn(f"embed_metal: {' '.join(cmd)} failed (kernels will compile from source at first use):\n"
                      f"{result.stderr[-2000:]}")
    return result.returncode == 0


def embedded_source(ms=None) -> str:
    ms = ms or metal_source()
    return (
        "// Generated by csrc/mps/embed_metal.py from metal/ (torch_qmm/metal_source.py): do not edit.\n"
        "#pragma once\n"
        + _tables(ms)
        + "// The install-time metallib of these sources, next to the extension module (metallib_choice.h).\n"
        f"static const char kMetallibName[] = {_plain_literal(metallib_name(ms))};\n"
    )


def write_embedded_source(output: Path = OUTPUT) -> Path:
    text = embedded_source()
    if not output.exists() or output.read_text() != text:
        output.write_text(text)
    return output


if __name__ == "__main__":
    print(write_embedded_source(Path(sys.argv[1]) if len(sys.argv) > 1 else OUTPUT))
