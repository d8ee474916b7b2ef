"""Shared fixtures (the tolerance rule is in tests/tolerance.py).

`device`: every op test runs on each backend present: "cpu" always, "mps" on a Mac.
(The Metal kernels on metalsim join here through torch_qmm.metalsim.backend(), see issue 4.)
"""

from __future__ import annotations

import pytest
import torch


def available_devices() -> list[str]:
    devices = ["cpu"]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


@pytest.fixture(params=available_devices())
def device(request) -> str:
    return request.param
