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
