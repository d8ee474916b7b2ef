"""Shared pieces of the tests/test_metal_*.py files: problems, one per route, and a runner."""

from __future__ import annotations

import json

import pytest
import torch

import torch_qmm
from torch_qmm import reference

from tolerance import assert_matches_reference  # noqa: E402,F401  (tests/tolerance.py)


BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# One problem per row of the routing table (csrc/plan.cpp): op, M, N, K, transpose.
# N and K are odd where the format allows (N for transpose=True, K for transpose=False).
ROUTE_PROBLEMS = {
    "qmv_fast": ("qmm", 1, 64, 512, True),
    "qmv_bounded": ("qmm", 1, 37, 192, True),
    "qmm_t_bm2": ("qmm", 2, 37, 192, True),
    "qmm_t_bm4": ("qmm", 3, 37, 192, True),
    "qmm_t_bm8": ("qmm", 7, 37, 192, True),
    "qmm_t_mma16": ("qmm", 13, 37, 192, True),
    "qmm_t_mma32": ("qmm", 33, 37, 192, True),
    "qvm_bounded": ("qmm", 3, 192, 45, False),
    "qmm_n_mma32": ("qmm", 33, 192, 45, False),
    "dequantize": ("dequantize", 0, 37, 192, True),
    "quantize": ("quantize", 0, 37, 192, True),
}


def routes() -> list[dict]:
    return json.loads(torch.ops.torch_qmm._routes())


def plan(op: str, M: int, N: int, K: int, bits: int, group_size: int, dtype, transpose: bool = True,
         mode: str = "affine") -> list[dict]:
    from torch_qmm.formats import FORMATS

    if mode not in FORMATS:  # the planner serves it, the op layer (csrc/format_spec.cpp) not yet
        pytest.skip(f"mode {mode!r} is not in the format table (torch_qmm.formats.FORMATS) yet")
    return json.loads(torch.ops.torch_qmm._plan(op, M, N, K, bits, group_size, dtype, transpose, mode))


# MLX's fp modes with Metal kernels, and their (bits, group size) (torch_qmm/reference_fp.py).
FP_MODES = ("mxfp4", "nvfp4", "mxfp8")


def fp_mode_params(mode: str) -> tuple[int, int]:
    from torch_qmm import reference_fp

    spec = reference_fp.MODES[mode]
    return spec.bits, spec.group_size


def metal_run(launches: list[dict], operands: dict, check=None, count=False):
    """Runs planned launches on metalsim (the executor's path after planning); returns the runs."""
    from torch_qmm import metalsim_backend

    metalsim_backend._execute(launches, operands, check, count)
    return metalsim_backend.last_launches()


def require_clang():
    from torch_qmm.metalsim import _build

    try:
        _build.find_clang()
    except RuntimeError as e:  # CI installs clang-19 (.ci/run); say how to get it elsewhere
        pytest.skip(str(e))


def weights(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * (0.5 + torch.rand(rows, 1, generator=g))).to(dtype)


def qmm_case(M: int, N: int, K: int, bits: int, group_size: int, dtype, transpose: bool, seed: int):
    """Packed W (quantized by the CPU op) and x for y[M, N] = x[M, K] @ W."""
    rows, cols = (N, K) if transpose else (K, N)
    wq, scales, biases = torch_qmm.quantize(weights(rows, cols, dtype, seed), group_size=group_size, bits=bits)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, K, generator=g).to(dtype)
    return x, wq, scales, biases


def reference_and_magnitude(x, wq, scales, biases, bits, group_size, transpose):
    y_ref = reference.qmm(x, wq, scales, biases, bits, group_size, transpose)
    magnitude = reference.qmm_magnitude(x, wq, scales, biases, bits, group_size, transpose)
    return y_ref, magnitude
