"""metalsim: run Metal Shading Language compute kernels on a CPU, with Metal's execution model.

    from torch_qmm import metalsim
    lib = metalsim.compile(source_or_path, defines=None, include_dirs=())
    stats = lib.dispatch("kernel_name", buffers={0: x, 1: (y, byte_offset)},
                         threadgroups=(gx, gy, gz), threads_per_threadgroup=(tx, ty, tz),
                         bytes={2: np.uint32(n)})

No torch needed (numpy arrays in; CPU torch tensors are accepted by duck typing).
See README.md in this directory for the supported MSL and the differences from Metal.
"""
from __future__ import annotations

from ._api import BufferStats, DispatchStats, KernelFault, Library, compile, check_enabled
from ._build import CompileError
from ._staging import StageError

__all__ = ["compile", "Library", "DispatchStats", "BufferStats", "KernelFault", "CompileError", "StageError",
           "check_enabled"]

_BACKEND_NAMES = ("backend", "last_launches")


def __getattr__(name: str):
    # The torch executor (`with torch_qmm.metalsim.backend(): ...`) lives in
    # torch_qmm/metalsim_backend.py; re-exported here lazily so the
    # emulator core stays torch-free.
    if name in _BACKEND_NAMES:
        import importlib

        try:
            mod = importlib.import_module("torch_qmm.metalsim_backend")
        except ImportError as e:
            raise AttributeError(f"metalsim.{name} is provided by torch_qmm/metalsim_backend.py, which could not be "
                                 f"imported: {e}") from e
        return getattr(mod, name)
    raise AttributeError(f"module 'metalsim' has no attribute {name!r}")
