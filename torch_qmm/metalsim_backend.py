"""metalsim executor: run the torch_qmm ops' Metal kernels on metalsim, through the planner.

    from torch_qmm.metalsim import backend, last_launches   # re-exported from this module
    with backend():                       # or backend(check=True) for checked mode
        y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4)   # CPU tensors
        y = torch_qmm.quantized_matmul(x, wq, scales, mode="mxfp4")                     # any mode
    last_launches()                       # [Launch(kernel, route, threadgroups, ..., stats)]

Inside the context, calls of torch.ops.torch_qmm.{qmm, dequantize, quantize, gguf_qmm, gather_qmm} (the
affine_* aliases decompose into the first three) on CPU tensors are executed exactly as the MPS
executor (csrc/mps/) executes them on a Mac:
  1. `_plan_for` / `_plan_for_gguf` run the C++ argument checks (csrc/validate.*,
     csrc/gguf_validate.*: the same errors as the CPU ops) and the planner (csrc/plan.cpp)
     -> launches {kernel, grid, buffer bindings, constant bytes};
  2. each tensor is bound like setBuffer(storage buffer, storage_offset * element_size + offset);
  3. the kernels of metal/quant.metal or metal/gguf.metal run on metalsim.
This module sits next to, not inside, torch_qmm/metalsim/: a submodule named `backend` would
shadow the function `metalsim.backend`, and the emulator core stays free of torch.
Each kernel is compiled on first use from its own source (torch_qmm/metal_source.py: the library's
flattened headers + the kernel's one instantiation line), the text the MPS executor compiles on a
Mac, and kept per process (metalsim also caches builds on disk by content hash).
compiled_kernels() lists what this process compiled, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import metal_source
from .formats import format_of
from .metalsim import _api as metalsim

__all__ = ["backend", "last_launches", "library", "gguf_library", "kernel_library", "compiled_kernels",
           "metal_dir", "Launch"]

_ops = torch.ops.torch_qmm


def metal_dir() -> Path:
    """The directory holding metal/quant.metal: package data when installed, else the checkout."""
    return metal_source.metal_dir()


_libs: dict[tuple, Any] = {}
_libs_lock = threading.Lock()
_kernel_locks: dict[str, threading.Lock] = {}
_compiled: list[str] = []


def _compile(source: str, defines: Optional[dict] = None):
    with _libs_lock:
        key = (source, tuple(sorted((defines or {}).items())))
        lib = _libs.get(key)
        if lib is None:
            d = metal_dir()
            lib = metalsim.compile(d / source, defines=defines, include_dirs=(str(d),))
            _libs[key] = lib
        return lib


def library(bits: int):
    """The whole affine library of one bit width (every kernel; for tests that list names)."""
    return _compile("quant.metal", {"TORCH_QMM_ONLY_BITS": str(bits)})


def gguf_library():
    """The whole GGUF library, metal/gguf.metal (every kernel; for tests that list names)."""
    return _compile("gguf.metal")


def kernel_library(name: str):
    """The metalsim library of kernel `name` alone, compiled from metal_source.kernel_source(name)
    on first use (once per process and name; concurrent first uses of one name wait for one
    compile, different names compile in parallel)."""
    with _libs_lock:
        lib = _libs.get(("kernel", name))
        if lib is not None:
            return lib
        lock = _kernel_locks.setdefault(name, threading.Lock())
    with lock:
        with _libs_lock:
            lib = _libs.get(("kernel", name))
        if lib is None:
            lib = metalsim.compile(metal_source.kernel_source(name))
            with _libs_lock:
                _libs[("kernel", name)] = lib
                _compiled.append(name)
        return lib


def compiled_kernels() -> list[str]:
    """The kernels kernel_library() compiled in this process, in order."""
    with _libs_lock:
        return list(_compiled)


@dataclasses.dataclass
class Launch:
    """One kernel launch as run: what the planner chose and metalsim's statistics."""

    kernel: str
    route: str
    threadgroups: tuple
    threads_per_threadgroup: tuple
    buffers: dict  # index -> operand name
    tile: tuple  # (rows of x, columns of y) per threadgroup; (0, 0) for (de)quantize
    stats: Any  # metalsim DispatchStats (byte counters filled when counting or checking)


_local = threading.local()


def last_launches() -> list[Launch]:
    """The launches of the last op run under backend() in this thread (empty list if none)."""
    return list(getattr(_local, "last", []))


def _storage_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the whole storage as uint8, byte offset of t's first element): setBuffer's view of t."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage, t.storage_offset() * t.element_size()


def _plan_for(op: str, tensors: list, mode: str, bits: int, group_size: int, transpose: bool = True,
              dtype=None) -> list:
    """The C++ argument checks of the op (the CPU ops' errors), then the planner's launches."""
    return json.loads(_ops._plan_for(op, tensors, bits, group_size, transpose, mode, dtype))


def _execute(plan: list, operands: dict, check: Optional[bool], count: bool) -> None:
    """Runs planned launches: the family-independent part (what csrc/mps/metal_executor.mm does)."""
    done = []
    for launch in plan:
        buffers = {}
        for b in launch["buffers"]:
            storage, offset = _storage_view(operands[b["operand"]])
            buffers[b["index"]] = (storage, offset + b["byte_offset"])
        consts = {c["index"]: np.array(c["u32"], dtype=np.uint32) for c in launch["bytes"]}
        stats = kernel_library(launch["kernel"]).dispatch(
            launch["kernel"],
            buffers=buffers,
            threadgroups=tuple(launch["threadgroups"]),
            threads_per_threadgroup=tuple(launch["threads_per_threadgroup"]),
            bytes=consts,
            check=check,
            count=count,
        )
        done.append(
            Launch(
                kernel=launch["kernel"],
                route=launch["route"],
                threadgroups=tuple(launch["threadgroups"]),
                threads_per_threadgroup=tuple(launch["threads_per_threadgroup"]),
                buffers={b["index"]: b["operand"] for b in launch["buffers"]},
                tile=tuple(launch["tile"]),
                stats=stats,
            )
        )
    _local.last = done


def _qmm(x, wq, scales, biases, mode, bits, group_size, transpose=True, *, check=None, count=False):
    plan = _plan_for("qmm", [x, wq, scales, biases], mode, bits, group_size, transpose)  # validates first
    K = x.shape[-1]
    N = wq.shape[0] if transpose else wq.shape[1] * 32 // bits
    x2 = x.reshape(-1, K).contiguous()
    y = torch.zeros(x2.shape[0], N, dtype=x.dtype)
    operands = {"x": x2, "wq": wq.contiguous(), "scales": scales.contiguous(), "y": y}
    if biases is not None:  # the fp modes have none (the plan binds none)
        operands["biases"] = biases.contiguous()
    _execute(plan, operands, check, count)
    return y.reshape(*x.shape[:-1], N)


def _dequantize(wq, scales, biases, mode, bits, group_size, dtype=None, *, check=None, count=False):
    plan = _plan_for("dequantize", [wq, scales, biases], mode, bits, group_size, True, dtype)
    out_dtype = dtype if dtype is not None else (scales.dtype if format_of(mode).has_biases else torch.bfloat16)
    out = torch.zeros(wq.shape[:-1] + (wq.shape[-1] * 32 // bits,), dtype=out_dtype)
    operands = {"wq": wq.contiguous(), "scales": scales.contiguous(), "w": out}
    if biases is not None:
        operands["biases"] = biases.contiguous()
    _execute(plan, operands, check, count)
    return out


def _aligned(t: torch.Tensor, alignment: int = 4) -> torch.Tensor:
    """t contiguous, at a byte offset that is a multiple of `alignment` (a copy when it is not)."""
    t = t.contiguous()
    if (t.storage_offset() * t.element_size()) % alignment:
        t = t.clone()
    return t


def _gguf_qmm(x, blocks, ggml_type, N, K, *, check=None, count=False):
    plan = json.loads(_ops._plan_for_gguf(x, blocks, ggml_type, N, K))  # validates first
    x2 = x.reshape(-1, K).contiguous()
    y = torch.zeros(x2.shape[0], N, dtype=x.dtype)
    # The kernels read Q2_K, Q4_K, Q5_K and IQ4_XS words as uint32, Q3_K, Q6_K and the lattice i-quants' as uint16
    # (metal/gguf_qmm.h).
    operands = {"x": x2, "blocks": _aligned(blocks), "y": y}
    _execute(plan, operands, check, count)
    return y.reshape(*x.shape[:-1], N)


def _gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, mode, bits, group_size, transpose=True,
                sorted_indices=False, *, check=None, count=False):
    # The op's checks (the CPU op's errors, incl. the indices' range), the plan, and the index
    # operands as the MPS executor binds them (csrc/plan_torch.h gather_qmm_operands, gather_order).
    text, lhs, rhs, order = _ops._gather_operands(x, w, scales, biases, lhs_indices, rhs_indices, mode, bits,
                                                  group_size, transpose, sorted_indices)
    plan = json.loads(text)
    M, K = x.shape[-2], x.shape[-1]
    N = w.shape[-2] if transpose else w.shape[-1] * 32 // bits
    batch = torch.broadcast_shapes(tuple(lhs_indices.shape) if lhs_indices is not None else tuple(x.shape[:-2]),
                                   tuple(rhs_indices.shape) if rhs_indices is not None else tuple(w.shape[:-2]))
    y = torch.zeros(lhs.numel() * M, N, dtype=x.dtype)
    operands = {"x": x.reshape(-1, K).contiguous(), "wq": w.contiguous(), "scales": scales.contiguous(), "y": y,
                "lhs": lhs, "rhs": rhs, "order": order}
    if biases is not None:
        operands["biases"] = biases.contiguous()
    _execute(plan, operands, check, count)
    return y.reshape(*batch, M, N)


def _quantize(w, mode, bits, group_size, *, check=None, count=False):
    plan = _plan_for("quantize", [w], mode, bits, group_size)  # validates, incl. NaN/Inf
    K = w.shape[-1]
    w2 = w.reshape(-1, K).contiguous()
    rows, lead = w2.shape[0], tuple(w.shape[:-1])
    # The layout of the outputs is the format's (csrc/format_spec.h, read by torch_qmm/formats.py):
    # scales in w's dtype and biases for affine, uint8 scale codes and no biases for the fp modes.
    f = format_of(mode)
    has_biases = f.has_biases
    wq = torch.zeros(rows, K * bits // 32, dtype=torch.uint32)
    scales = torch.zeros(rows, K // group_size, dtype=f.scale_dtype or w.dtype)
    operands = {"w": w2, "wq": wq, "scales": scales}
    if has_biases:
        operands["biases"] = torch.zeros(rows, K // group_size, dtype=w.dtype)
    _execute(plan, operands, check, count)
    outs = [wq.reshape(lead + (K * bits // 32,)), scales.reshape(lead + (K // group_size,))]
    if has_biases:
        outs.append(operands["biases"].reshape(lead + (K // group_size,)))
    return outs


class _MetalsimMode(TorchDispatchMode):
    """Routes the torch_qmm ops on CPU tensors to the Metal kernels on metalsim."""

    def __init__(self, check: Optional[bool], count: bool):
        super().__init__()
        self.check = check
        self.count = count
        self.handlers = {
            _ops.qmm.default: _qmm,
            _ops.dequantize.default: _dequantize,
            _ops.quantize.default: _quantize,
            _ops.gguf_qmm.default: _gguf_qmm,
            _ops.gather_qmm.default: _gather_qmm,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self.handlers.get(func)
        if handler is not None and all(
            a.device.type == "cpu" for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)
        ):
            return handler(*args, **kwargs, check=self.check, count=self.count)
        return func(*args, **kwargs)


@contextlib.contextmanager
def backend(check: Optional[bool] = None, count: bool = False) -> Iterator[None]:
    """Run torch_qmm's ops (every quantized mode, and GGUF) on CPU tensors through the Metal kernels on
    metalsim.

    Args:
        check: metalsim checked mode (out-of-bounds, races, uninitialized threadgroup reads,
            barrier divergence raise metalsim.KernelFault); None: the TORCH_QMM_METALSIM_CHECK
            environment variable decides.
        count: fill the per-buffer byte counters of last_launches()[i].stats.
    """
    with _MetalsimMode(check, count):
        yield
