"""Shared fixtures (the tolerance rule is in tests/tolerance.py).

`device`: every op test runs on each backend present: "cpu" (the C++ kernels), "metalsim" (our
Metal kernels on the Metal-on-CPU emulator, through the same planner and bindings as on a Mac;
the test sees device "cpu" inside `torch_qmm.metalsim.backend()`; x86-64 only), and "mps" where
torch.backends.mps.is_available() (a Mac; `.github/workflows/macos-mps.yml` runs these there).
"""

from __future__ import annotations

import os
import platform

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: the workers already fill the cores, and OpenMP threads
    # that spin-wait on an oversubscribed machine make small ops ~100x slower. Multi-threaded
    # kernels are still exercised by tests that raise the count themselves (see `threads`).
    torch.set_num_threads(1)


@pytest.fixture
def threads():
    """Runs a test with two intra-op threads, restoring the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def available_devices() -> list[str]:
    devices = ["cpu"]
    if platform.machine() in ("x86_64", "AMD64"):  # metalsim's runtime is x86-64 only
        devices.append("metalsim")
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


@pytest.fixture(params=available_devices())
def device(request):
    if request.param == "metalsim":
        from torch_qmm.metalsim import backend

        with backend():
            yield "cpu"
    else:
        yield request.param


@pytest.fixture
def backend_name(request, device) -> str:
    """Which backend `device` runs the ops on: "cpu" (the C++ kernels), "metalsim" or "mps"."""
    return request.node.callspec.params["device"]
