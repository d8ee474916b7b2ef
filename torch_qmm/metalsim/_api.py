"""Python API: compile(), Library.dispatch(), statistics and faults."""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from . import _build

MAX_BUFFERS = 32
MAX_TG_ARGS = 32
MAX_FC = 65536  # function constant indices 0..65535
# A library with more kernels than this compiles each kernel when it is first dispatched.
LAZY_THRESHOLD = 1024
MAX_THREADS_PER_THREADGROUP = 1024


class KernelFault(RuntimeError):
    """A fault found while running a kernel (checked mode), e.g. an out-of-bounds access.

    Attributes:
        kernel: host name of the kernel.
        message: what happened, with buffer index / offset and the thread position.
    """

    def __init__(self, kernel: str, message: str):
        super().__init__(message)
        self.kernel = kernel
        self.message = message


class _Launch(ctypes.Structure):
    _fields_ = [
        ("entry", ctypes.c_void_p),
        ("kernel_name", ctypes.c_char_p),
        ("bufs", ctypes.c_void_p * MAX_BUFFERS),
        ("buf_base", ctypes.c_void_p * MAX_BUFFERS),
        ("buf_size", ctypes.c_uint64 * MAX_BUFFERS),
        ("buf_offset", ctypes.c_uint64 * MAX_BUFFERS),
        ("tg_arg_size", ctypes.c_uint64 * MAX_TG_ARGS),
        ("unbound", ctypes.c_uint32),
        ("groups", ctypes.c_uint32 * 3),
        ("tptg", ctypes.c_uint32 * 3),
        ("threads", ctypes.c_uint32 * 3),
        ("nonuniform", ctypes.c_int),
        ("use_fibers", ctypes.c_int),
        ("check", ctypes.c_int),
        ("count", ctypes.c_int),
        ("nworkers", ctypes.c_int),
        ("fault", ctypes.c_int),
        ("fault_msg", ctypes.c_char * 2048),
        ("bytes_loaded", ctypes.c_uint64 * MAX_BUFFERS),
        ("bytes_stored", ctypes.c_uint64 * MAX_BUFFERS),
        ("unique_bytes", ctypes.c_uint64 * MAX_BUFFERS),
        ("tg_footprint", ctypes.c_uint64 * MAX_BUFFERS),
    ]


@dataclasses.dataclass
class BufferStats:
    """Device-memory traffic of one buffer index (counting or checked mode; zeros otherwise).

    bytes_loaded / bytes_stored: as the kernel's loads and stores ask (no caches).
    unique_bytes: distinct bytes touched by the whole launch.
    tg_footprint: sum over threadgroups of the distinct bytes each threadgroup touched
        (the traffic when caches give no reuse between threadgroups).
    """

    bytes_loaded: int = 0
    bytes_stored: int = 0
    unique_bytes: int = 0
    tg_footprint: int = 0


@dataclasses.dataclass
class DispatchStats:
    kernel: str
    threads: int
    threadgroups: int
    seconds: float
    counted: bool
    buffers: dict


def check_enabled() -> bool:
    """True when TORCH_QMM_METALSIM_CHECK asks for checked mode for every dispatch."""
    return os.environ.get("TORCH_QMM_METALSIM_CHECK", "").strip().lower() not in ("", "0", "false", "no", "off")


def _dim3(v, what) -> tuple:
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or any(x < 1 for x in v):
        raise ValueError(f"{what} must be 1 to 3 positive integers, got {v}")
    return v + (1,) * (3 - len(v))


def _memory(obj: Any, what: str):
    """(keepalive, base address, nbytes) of a numpy array, CPU torch tensor or buffer object."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what}: arrays must be C-contiguous (got strides {obj.strides})")
        return obj, obj.__array_interface__["data"][0], obj.nbytes
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, duck-typed
        dev = getattr(obj, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            raise ValueError(f"{what}: tensors must be on the CPU (got {dev})")
        if not obj.is_contiguous():
            raise ValueError(f"{what}: tensors must be contiguous")
        return obj, int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size())
    if hasattr(obj, "__array_interface__"):
        return _memory(np.asarray(obj), what)
    raise TypeError(f"{what}: expected a numpy array or CPU torch tensor, got {type(obj).__name__}")


def _bytes_of(v: Any, what: str) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, (np.generic, np.ndarray)):
        return np.ascontiguousarray(v).tobytes()
    if isinstance(v, ctypes.Structure) or isinstance(v, ctypes.Array) or isinstance(v, ctypes._SimpleCData):
        return bytes(v)
    if isinstance(v, (bool, int, float)):
        raise TypeError(f"{what}: give setBytes values a width, e.g. np.uint32({v!r}) or np.float32({v!r})")
    raise TypeError(f"{what}: expected bytes, a numpy scalar/array or a ctypes value, got {type(v).__name__}")


_FC_DTYPES = {
    "bool": np.bool_, "char": np.int8, "int8_t": np.int8, "uchar": np.uint8, "uint8_t": np.uint8,
    "short": np.int16, "int16_t": np.int16, "ushort": np.uint16, "uint16_t": np.uint16, "int": np.int32,
    "int32_t": np.int32, "uint": np.uint32, "uint32_t": np.uint32, "long": np.int64, "int64_t": np.int64,
    "ulong": np.uint64, "uint64_t": np.uint64, "size_t": np.uint64, "float": np.float32, "half": np.float16,
}


class Library:
    """A compiled Metal library: its kernels, ready to dispatch."""

    def __init__(self, staged, lazy: bool):
        self._staged = staged
        self._meta = staged.meta
        self._lazy = lazy
        self._dlls = {}  # (kernel index or None, instrumented, constants) -> (CDLL, metadata)
        self._lock = threading.Lock()
        self._index = {k["name"]: i for i, k in enumerate(self._meta["kernels"])}
        self._fcs = {f["name"]: f for f in self._meta["function_constants"]}
        if lazy:
            _build.check_syntax(staged)
        else:
            self._library(None, False)

    def _library(self, kernel, instrumented: bool, constants=None):
        """(CDLL, metadata) of the build that holds `kernel` (an index) specialised for the
        function constant values `constants` ({index: bytes}). Without constants that is the
        whole library's build, unless the library is lazy; a specialised build holds only `kernel`."""
        spec = tuple(sorted((constants or {}).items()))
        key = (kernel if self._lazy or spec else None, instrumented, spec)
        with self._lock:
            got = self._dlls.get(key)
            if got is None:
                so, meta = _build.build(self._staged, None if key[0] is None else [key[0]], instrumented,
                                        dict(spec))
                dll = ctypes.CDLL(str(so))
                dll.msim_launch_size.restype = ctypes.c_size_t
                size = dll.msim_launch_size()
                if size != ctypes.sizeof(_Launch):
                    raise RuntimeError(f"metalsim: runtime ABI mismatch ({size} != {ctypes.sizeof(_Launch)})")
                got = self._dlls[key] = (dll, meta)
            return got

    @property
    def _kernels(self) -> dict:
        return {k["name"]: k for k in self._meta["kernels"]}

    @property
    def kernels(self) -> list:
        """Host names of the kernels in this library."""
        return list(self._kernels)

    @property
    def function_constants(self) -> dict:
        """name -> (index, type) of the library's function constants."""
        return {n: (f["index"], f["type"]) for n, f in self._fcs.items()}

    def dispatch_threads(self, name: str, threads, threads_per_threadgroup, **kw) -> DispatchStats:
        """Like dispatchThreads: a non-uniform grid of `threads`; edge threadgroups are partial."""
        return self.dispatch(name, threads=threads, threads_per_threadgroup=threads_per_threadgroup, **kw)

    def dispatch(self, name: str, buffers: Optional[Mapping[int, Any]] = None, threadgroups=None,
                 threads_per_threadgroup=(1, 1, 1), bytes: Optional[Mapping[int, Any]] = None,
                 function_constants: Optional[Mapping[Union[int, str], Any]] = None,
                 threadgroup_memory: Optional[Mapping[int, int]] = None, check: Optional[bool] = None,
                 count: bool = False, threads=None, workers: Optional[int] = None) -> DispatchStats:
        """Run kernel `name` once, like one dispatchThreadgroups (or dispatchThreads) call.

        Args:
            name: kernel host name (see `kernels`).
            buffers: {index: array | (array, byte_offset)} like setBuffer(buf, offset, index).
                numpy arrays or CPU torch tensors, C-contiguous; the kernel reads and writes
                their memory in place.
            threadgroups: (gx, gy, gz) threadgroups per grid (dispatchThreadgroups).
            threads_per_threadgroup: (tx, ty, tz), at most 1024 threads.
            bytes: {index: value} like setBytes; numpy scalars/arrays, bytes or ctypes values.
            function_constants: {index or name: value}, like MTLFunctionConstantValues: the
                kernel is built specialised for these values (cached per set of values);
                constants not given are undefined (is_function_constant_defined is false).
            threadgroup_memory: {index: nbytes} for [[threadgroup(n)]] arguments
                (setThreadgroupMemoryLength).
            check: checked mode (faults raise KernelFault); None means the
                TORCH_QMM_METALSIM_CHECK environment variable decides.
            count: fill the byte counters of the returned stats (implied by check).
            threads: (nx, ny, nz) threads per grid instead of `threadgroups` (dispatchThreads).
            workers: OS threads for threadgroups (default: all cores; 1 when checking or counting).
        Returns:
            DispatchStats with .threads, .seconds and per-index .buffers[i] byte counters.
        """
        if name not in self._index:
            raise KeyError(f"no kernel {name!r} in this library; kernels: {', '.join(self._index) or '(none)'}")
        if check is None:
            check = check_enabled()
        check = bool(check)
        count = bool(count) or check
        tptg = _dim3(threads_per_threadgroup, "threads_per_threadgroup")
        ntg = tptg[0] * tptg[1] * tptg[2]
        if ntg > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(f"threads_per_threadgroup {tptg} has {ntg} threads; Metal allows at most "
                             f"{MAX_THREADS_PER_THREADGROUP}")
        L = _Launch()
        if threads is not None:
            if threadgroups is not None:
                raise ValueError("give either threadgroups (dispatchThreadgroups) or threads (dispatchThreads)")
            grid = _dim3(threads, "threads")
            groups = tuple(-(-g // t) for g, t in zip(grid, tptg))
            L.nonuniform = 1
            L.threads[:] = grid
        else:
            if threadgroups is None:
                raise ValueError("threadgroups (or threads) is required")
            groups = _dim3(threadgroups, "threadgroups")
            L.threads[:] = tuple(g * t for g, t in zip(groups, tptg))
        L.groups[:] = groups
        L.tptg[:] = tptg
        keep = []
        bound = {}
        for idx, v in (buffers or {}).items():
            idx = int(idx)
            if not 0 <= idx < MAX_BUFFERS:
                raise ValueError(f"buffers: index {idx} out of range 0..{MAX_BUFFERS - 1}")
            off = 0
            if isinstance(v, tuple):
                v, off = v
                off = int(off)
            obj, base, nbytes = _memory(v, f"buffers[{idx}]")
            if not 0 <= off <= nbytes:
                raise ValueError(f"buffers[{idx}]: offset {off} outside the {nbytes}-byte buffer")
            keep.append(obj)
            bound[idx] = (base, nbytes, off)
        for idx, v in (bytes or {}).items():
            idx = int(idx)
            if idx in bound:
                raise ValueError(f"index {idx} is given both in buffers and in bytes")
            if not 0 <= idx < MAX_BUFFERS:
                raise ValueError(f"bytes: index {idx} out of range 0..{MAX_BUFFERS - 1}")
            data = _bytes_of(v, f"bytes[{idx}]")
            arr = np.zeros(max(len(data), 1) + 64, dtype=np.uint8)
            start = (-arr.__array_interface__["data"][0]) % 64
            arr = arr[start:start + max(len(data), 1)]
            arr[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            keep.append(arr)
            bound[idx] = (arr.__array_interface__["data"][0], len(data), 0)
        dll, meta = self._library(self._index[name], count, self._constant_values(function_constants))
        k = meta["kernels"][self._index[name]]
        # Metal lets a dispatch leave buffers unbound that the kernel does not access. Checked
        # mode binds them to an empty buffer, so an access faults naming the index; otherwise
        # they point at 64 KB of zeros of their own.
        for p in k["params"]:
            if p["kind"] == "buffer" and p["index"] not in bound:
                idx = p["index"]
                filler = _EMPTY if count else np.zeros(1 << 16, dtype=np.uint8)
                keep.append(filler)
                bound[idx] = (filler.__array_interface__["data"][0], 0 if count else filler.nbytes, 0)
                L.unbound |= 1 << idx
        for idx, (base, nbytes, off) in bound.items():
            L.bufs[idx] = base + off
            L.buf_base[idx] = base
            L.buf_size[idx] = nbytes
            L.buf_offset[idx] = off
        for idx, nbytes in (threadgroup_memory or {}).items():
            L.tg_arg_size[int(idx)] = int(nbytes)
        for p in k["params"]:
            if p["kind"] == "threadgroup" and int(p["index"]) not in {int(i) for i in (threadgroup_memory or {})}:
                raise ValueError(f"kernel {name}: [[threadgroup({p['index']})]] ({p['name']}) needs "
                                 f"threadgroup_memory={{{p['index']}: nbytes}}")
        entry = getattr(dll, k["symbol"])
        L.entry = ctypes.cast(entry, ctypes.c_void_p).value
        kname = name.encode()
        L.kernel_name = kname
        L.use_fibers = int(bool(self._meta["needs_fibers"]) or check)
        L.check = int(check)
        L.count = int(count)
        if workers is None:
            workers = int(os.environ.get("TORCH_QMM_METALSIM_THREADS", "0") or 0) or (os.cpu_count() or 1)
        L.nworkers = 1 if count else int(workers)
        run = dll.msim_run
        run.argtypes = [ctypes.POINTER(_Launch)]
        run.restype = ctypes.c_int
        t0 = time.perf_counter()
        rc = run(ctypes.byref(L))
        seconds = time.perf_counter() - t0
        del keep
        if rc or L.fault:
            raise KernelFault(name, L.fault_msg.decode(errors="replace"))
        stats = {i: BufferStats(L.bytes_loaded[i], L.bytes_stored[i], L.unique_bytes[i], L.tg_footprint[i])
                 for i in bound}
        total = groups[0] * groups[1] * groups[2]
        nthreads = (L.threads[0] * L.threads[1] * L.threads[2])
        return DispatchStats(name, int(nthreads), int(total), seconds, count, stats)

    def _constant_values(self, function_constants) -> dict:
        """{index: bytes} of the given constants the library declares, each converted to its
        declared type; values for undeclared indices are ignored, as Metal does."""
        declared = {f["index"]: f["type"] for f in self._fcs.values()}
        values = {}
        for key, v in (function_constants or {}).items():
            if isinstance(key, str):
                if key not in self._fcs:
                    raise KeyError(f"function constant {key!r} not declared; known: {', '.join(self._fcs)}")
                idx = self._fcs[key]["index"]
            else:
                idx = int(key)
                if not 0 <= idx < MAX_FC:
                    raise ValueError(f"function constant index {idx} out of range 0..{MAX_FC - 1}")
                if idx not in declared:
                    continue
            typ = declared[idx]
            if typ in _FC_DTYPES:
                values[idx] = np.asarray(v, dtype=_FC_DTYPES[typ]).tobytes()
            else:
                values[idx] = _bytes_of(v, f"function_constants[{key!r}]")
        return values

    def __repr__(self) -> str:
        return f"<metalsim.Library {len(self._index)} kernels: {', '.join(self._index)}>"


_cache: dict = {}
_cache_lock = threading.Lock()


_EMPTY = np.zeros(64, dtype=np.uint8)


def compile(source_or_path: Union[str, os.PathLike], defines: Optional[Mapping[str, Any]] = None,
            include_dirs: Sequence[Union[str, os.PathLike]] = (), lazy: Optional[bool] = None) -> Library:
    """Compile MSL source (a string, or a path to a .metal file) into a Library.

    Args:
        source_or_path: MSL source text, or the path of a .metal file (its directory is
            searched for #include "..." files).
        defines: {name: value or None} preprocessor definitions.
        include_dirs: extra include directories.
        lazy: compile each kernel when it is first dispatched (the library is parsed and
            checked now); None: lazily when the library has more than LAZY_THRESHOLD kernels.
    Builds are cached on disk by content hash (source after preprocessing, shim version),
    under TORCH_QMM_METALSIM_CACHE or ~/.cache/torch_qmm/metalsim.
    """
    filename = None
    if isinstance(source_or_path, os.PathLike) or (
            isinstance(source_or_path, str) and "\n" not in source_or_path and source_or_path.endswith(
                (".metal", ".h", ".hpp", ".msl")) and os.path.exists(source_or_path)):
        filename = str(Path(source_or_path).resolve())
        source = Path(filename).read_text()
    else:
        source = str(source_or_path)
    defines = dict(defines or {})
    include_dirs = tuple(str(Path(d).resolve()) for d in include_dirs)
    key = (source, filename, tuple(sorted((k, str(v)) for k, v in defines.items())), include_dirs, lazy)
    with _cache_lock:
        lib = _cache.get(key)
    if lib is not None:
        return lib
    staged = _build.stage(source, filename, defines, include_dirs)
    if lazy is None:
        lazy = len(staged.meta["kernels"]) > LAZY_THRESHOLD
    lib = Library(staged, bool(lazy))
    with _cache_lock:
        _cache[key] = lib
    return lib
