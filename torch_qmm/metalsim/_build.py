"""Compiling MSL to a shared library: compiler discovery, preprocessing, staging, caching.

Pipeline (each step cached by content hash):
  MSL --clang -E (empty <metal_stdlib> stand-ins)--> expanded user code
      --_staging.stage--> C++ with entry points
      --clang++ (shim, -fsycl-is-device address spaces, Metal arithmetic flags)--> kernels.so
A second, instrumented .so (coverage load/store hooks) is built on first use of checked or
counting mode.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import _staging, _strict, _trace_ir

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
RUNTIME_C = HERE / "runtime.c"
# Bump when the staging rules or compile flags change in a way the file hashes do not show.
SHIM_VERSION = "1"

INSTALL_HINT = ("metalsim needs clang (version 18 or newer, for C++23 explicit object parameters; CI uses "
                "clang-19). Install it with `apt-get install -y clang-19`, or point TORCH_QMM_CLANG at a "
                "clang binary.")


class CompileError(RuntimeError):
    """clang rejected the (staged) Metal source; the message holds clang's diagnostics."""


def find_clang() -> str:
    env = os.environ.get("TORCH_QMM_CLANG")
    if env:
        path = shutil.which(env) or (env if os.path.exists(env) else None)
        if not path:
            raise RuntimeError(f"TORCH_QMM_CLANG={env!r} does not name an executable. {INSTALL_HINT}")
        return path
    for name in ("clang-19", "clang"):
        path = shutil.which(name)
        if path:
            return path
    if os.path.exists("/usr/bin/clang-19"):
        return "/usr/bin/clang-19"
    raise RuntimeError(f"no clang compiler found on PATH. {INSTALL_HINT}")


def cache_dir() -> Path:
    d = os.environ.get("TORCH_QMM_METALSIM_CACHE")
    if d:
        p = Path(d)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        p = Path(base) / "torch_qmm" / "metalsim"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _shim_hash() -> str:
    h = hashlib.sha256(SHIM_VERSION.encode())
    for f in sorted(INCLUDE.rglob("*")) + [RUNTIME_C, Path(_staging.__file__), Path(_trace_ir.__file__),
                                              Path(_strict.__file__), Path(__file__)]:
        if f.is_file():
            h.update(str(f.relative_to(HERE)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


_SHIM_HASH = None


def shim_hash() -> str:
    global _SHIM_HASH
    if _SHIM_HASH is None:
        _SHIM_HASH = _shim_hash()
    return _SHIM_HASH


COMMON = ["-std=c++2b", "-fPIC", "-Xclang", "-fsycl-is-device", "-Xclang", "-aux-triple", "-Xclang",
          "x86_64-pc-linux-gnu", "-mf16c", "-Xclang", "-ffloat16-excess-precision=none", "-Xclang",
          "-fbfloat16-excess-precision=none", "-ffp-contract=off", "-fno-fast-math", "-fconvergent-functions",
          "-fvisibility=hidden", "-fno-exceptions", "-fno-rtti", "-Wno-unknown-attributes",
          "-Wno-ignored-attributes", "-Wno-unused-value", "-Wno-c++20-extensions", "-Wno-c++2b-extensions",
          "-Wno-unused-command-line-argument", "-Wno-ignored-pragma-intrinsic", "-Wno-duplicate-decl-specifier",
          "-ferror-limit=30"]
# Instrumented build: sanitizer-coverage hooks see plain loads and stores; the compiler must not
# turn them into accesses the hooks cannot see (memset/memcpy from loops or merged stores: the
# -fno-builtin-mem* flags disable loop idiom recognition and MemCpyOpt; wide vector accesses from
# the vectorizers). What the frontend itself emits (struct copies, zero-initialisation) is routed
# to the runtime by _trace_ir.rewrite. Vectorizing changes no result (no FP reassociation), so
# the plain build keeps it.
INSTR = ["-fsanitize-coverage=bb,trace-loads,trace-stores", "-D__MSIM_INSTRUMENTED=1",
         "-fno-builtin-memset", "-fno-builtin-memcpy", "-fno-builtin-memmove",
         "-fno-vectorize", "-fno-slp-vectorize"]


# Undefined values (a shuffle's result read from an inactive lane) are tracked to their use by
# MemorySanitizer's instrumentation (see runtime.c). Only shuffles make such values, so a library
# that names none is built without it (the instrumentation about doubles the compile time).
UNDEF = ["-fsanitize=kernel-memory", "-mllvm", "-msan-poison-stack=0", "-fno-sanitize-memory-use-after-dtor"]
SHUFFLE_RE = re.compile(r"(?:simd|quad)_(?:shuffle|broadcast)")


def opt_flag() -> str:
    """Optimisation level of kernel builds: TORCH_QMM_METALSIM_OPT (0-3, default 2)."""
    lvl = os.environ.get("TORCH_QMM_METALSIM_OPT", "2").strip() or "2"
    if lvl not in ("0", "1", "2", "3", "s"):
        raise ValueError(f"TORCH_QMM_METALSIM_OPT must be 0, 1, 2, 3 or s, got {lvl!r}")
    return "-O" + lvl


def _run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{r.stderr.strip()}\n(command: {' '.join(cmd)})")
    return r.stdout


def _atomic_write(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def runtime_object(clang: str) -> Path:
    out = cache_dir() / f"runtime-{shim_hash()[:16]}.o"
    if not out.exists():
        with tempfile.TemporaryDirectory() as td:
            tmp = Path(td) / "runtime.o"
            _run([clang, "-x", "c", "-std=gnu11", "-O2", "-fPIC", "-fvisibility=hidden", "-I", str(INCLUDE),
                  "-c", str(RUNTIME_C), "-o", str(tmp)], "compiling the metalsim runtime")
            shutil.copy(tmp, out.with_suffix(".tmp" + str(os.getpid())))
            os.replace(out.with_suffix(".tmp" + str(os.getpid())), out)
    return out


def preprocess(clang: str, source: str, filename: str, defines, include_dirs) -> str:
    """Expand user macros and includes; <metal_stdlib> resolves to an empty stand-in."""
    args = [clang, "-x", "c++", "-std=c++17", "-E", "-I", str(INCLUDE / "stage")]
    for d in include_dirs:
        args += ["-I", str(d)]
    args += ["-include", str(INCLUDE / "metalsim" / "macros.h")]
    for k, v in (defines or {}).items():
        args.append(f"-D{k}" if v is None else f"-D{k}={v}")
    with tempfile.TemporaryDirectory() as td:
        src = Path(td) / (Path(filename).name if filename else "source.metal")
        src.write_text(source)
        args += ["-I", str(Path(filename).parent) if filename else td, str(src)]
        out = _run(args, "preprocessing the Metal source")
    # line markers name the file: the caller's path, or for source text a fixed name (not the
    # temporary directory, which would make every process's cache key different)
    return out.replace(str(src), str(filename) if filename else src.name)


def _resolve_indices(so: Path, meta: dict, wanted) -> None:
    """Attribute indices written as named constants ([[buffer(BUF_W)]]) are read back from the library."""
    import ctypes

    dll = ctypes.CDLL(str(so))
    for k, kinfo in enumerate(meta["kernels"]):
        if wanted is not None and k not in wanted:
            continue
        codes = (ctypes.c_int * (len(kinfo["params"]) + 1)).in_dll(dll, kinfo["symbol"] + "_codes")
        for p, c in zip(kinfo["params"], codes):
            p["index"] = c % 1000


def _traced_object(clang: str, cmd: list, cpp: Path) -> Path:
    """Instrumented build in two steps: optimised, instrumented IR; _trace_ir.rewrite; then
    code generation only (-disable-llvm-passes: optimising again could re-form intrinsics)."""
    ll = cpp.with_suffix(".ll")
    _strict.run(cmd + _strict.FLAGS + ["-S", "-emit-llvm", str(cpp), "-o", str(ll)],
                "compiling the staged Metal source")
    ir = ll.read_text()
    _strict.check_ir(ir)
    try:
        ll.write_text(_trace_ir.rewrite(ir))
    except _trace_ir.UnsupportedIR as e:
        raise CompileError(f"checked mode: {e}") from None
    obj = cpp.with_suffix(".o")
    _run([clang, "-x", "ir", opt_flag(), "-fPIC", "-Xclang", "-disable-llvm-passes", "-c", str(ll), "-o", str(obj)],
         "compiling the instrumented IR")
    return obj


def _plain_object(clang: str, cmd: list, cpp: Path) -> Path:
    """Plain build in two steps, like _traced_object: optimised IR (checked by
    _strict.check_ir), then code generation only."""
    ll = cpp.with_suffix(".ll")
    _strict.run(cmd + _strict.FLAGS + ["-S", "-emit-llvm", str(cpp), "-o", str(ll)],
                "compiling the staged Metal source")
    _strict.check_ir(ll.read_text())
    obj = cpp.with_suffix(".o")
    _run([clang, "-x", "ir", opt_flag(), "-fPIC", "-Xclang", "-disable-llvm-passes", "-c", str(ll), "-o", str(obj)],
         "compiling the optimised IR")
    return obj


class Staged:
    """A preprocessed and staged library: its metadata, and where its staged C++ lives."""

    def __init__(self, key: str, meta: dict, cpp: Path):
        self.key, self.meta, self.cpp = key, meta, cpp


def stage(source: str, filename, defines, include_dirs) -> Staged:
    """Preprocess and stage (cached by content hash); compiles no kernel."""
    clang = find_clang()
    pre = preprocess(clang, source, filename, dict(defines or {}), include_dirs)
    key = hashlib.sha256((shim_hash() + "\0" + opt_flag() + "\0" + pre).encode()).hexdigest()[:24]
    d = cache_dir()
    meta_path, cpp = d / f"{key}.json", d / f"{key}.staged.cpp"
    if meta_path.exists() and cpp.exists():
        return Staged(key, json.loads(meta_path.read_text()), cpp)
    _strict.check_tokens(pre)
    try:
        staged = _staging.stage(pre)
    except _staging.StrictError as e:
        raise CompileError(f"metalsim strictness: Apple's compiler rejects this:\nerror: {e}") from None
    meta = {
        "kernels": [
            {"name": k.name, "symbol": k.symbol, "function": k.function,
             "params": [{"name": p.name, "kind": p.kind, "index": p.index, "attr": p.attr, "optional": p.optional}
                        for p in k.params]}
            for k in staged.kernels
        ],
        "function_constants": [{"name": f.name, "index": f.index, "type": f.type} for f in staged.function_constants],
        "needs_fibers": staged.needs_fibers,
        "uses_shuffles": bool(SHUFFLE_RE.search(pre)),
    }
    _atomic_write(cpp, staged.source)
    _atomic_write(meta_path, json.dumps(meta))
    return Staged(key, meta, cpp)


def specialisation(constants) -> str:
    """C++ that gives a build the function constant values `constants` ({index: bytes}):
    one __msim_fcv<index> per value (include/metalsim/kernel.h reads them)."""
    out = []
    for idx, data in sorted(constants.items()):
        out.append(f"template <> struct __msim_fcv<{int(idx)}> {{ static constexpr int size = {len(data)}; "
                   f"static constexpr __msim_fcbytes<{len(data)}> bytes = {{{{{', '.join(str(b) for b in data)}}}}}; }};\n")
    return "".join(out)


def _spec_tag(constants) -> str:
    if not constants:
        return ""
    h = hashlib.sha256(repr(sorted((int(i), bytes(d)) for i, d in constants.items())).encode())
    return "-fc" + h.hexdigest()[:16]


def _source_for(st: Staged, wanted, constants=None) -> str:
    return ('#include <metal_stdlib>\n' + specialisation(constants or {})
            + _staging.selection(len(st.meta["kernels"]), wanted) + st.cpp.read_text())


def check_syntax(st: Staged) -> None:
    """Parse and check the library without compiling any kernel (a lazy library's compile step)."""
    marker = cache_dir() / f"{st.key}.syntax-ok"
    if marker.exists():
        return
    clang = find_clang()
    with tempfile.TemporaryDirectory() as td:
        cpp = Path(td) / "staged.cpp"
        cpp.write_text(_source_for(st, ()))
        _compile_checked([clang, "-x", "c++", *COMMON, "-I", str(INCLUDE), "-fsyntax-only", str(cpp)])
    _atomic_write(marker, "")


def build(st: Staged, wanted, instrumented: bool, constants=None):
    """Compile the kernels `wanted` (indices; None: all) of a staged library into a shared
    library, specialised for the function constant values `constants` ({index: bytes}; the
    others are not defined); returns its path and the kernels' metadata with named indices
    resolved. Cached by the library's content hash, the kernels and the constant values."""
    clang = find_clang()
    tag = ("" if wanted is None else "-k" + "-".join(str(k) for k in sorted(wanted))) + _spec_tag(constants)
    so = cache_dir() / f"{st.key}{tag}{'-instr' if instrumented else ''}.so"
    # The build's metadata (named indices resolved) beside its library: `<so>.json`, never the
    # staged metadata's `<key>.json`, which stage() may write again in another process (unresolved).
    meta_path = so.with_name(so.name + ".json")
    if so.exists() and meta_path.exists():
        return so, json.loads(meta_path.read_text())
    meta = json.loads(json.dumps(st.meta))
    rt = runtime_object(clang)
    with tempfile.TemporaryDirectory() as td:
        cpp = Path(td) / "staged.cpp"
        cpp.write_text(_source_for(st, wanted, constants))
        out = Path(td) / "kernels.so"
        cmd = [clang, "-x", "c++", *COMMON, opt_flag(), "-I", str(INCLUDE)]
        if instrumented:
            undef = UNDEF if st.meta.get("uses_shuffles", True) else []
            cmd = [clang, "-shared", str(_traced_object(clang, cmd + INSTR + undef, cpp))]
            cmd += ["-x", "none", str(rt), "-o", str(out), "-lm", "-lpthread"]
            _run(cmd, "compiling the staged Metal source")
        else:
            cmd = [clang, "-shared", str(_plain_object(clang, cmd, cpp))]
            cmd += ["-x", "none", str(rt), "-o", str(out), "-lm", "-lpthread"]
            _run(cmd, "linking the staged Metal source")
        _resolve_indices(out, meta, None if wanted is None else set(wanted))
        shutil.copy(out, so.with_suffix(f".tmp{os.getpid()}"))
        os.replace(so.with_suffix(f".tmp{os.getpid()}"), so)
    _atomic_write(meta_path, json.dumps(meta))
    return so, meta


def _compile_checked(cmd) -> None:
    """Run a compile of user code with metalsim's strictness diagnostics (see _strict)."""
    _strict.run(cmd + _strict.FLAGS, "compiling the staged Metal source")
