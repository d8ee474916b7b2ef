"""Which device to run on (the best present: mps > cuda > cpu), whether a named one is usable here, and
timing on it."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from .cli_errors import UsageError


def best_device() -> str:
    if torch.backends.mps.is_available():
        return "mps"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def check_usable(device: str) -> None:
    """UsageError naming argument --device when torch cannot make a tensor on `device` here (an
    unknown name, a backend this torch was built without: torch raises RuntimeError, ValueError or,
    for CUDA in a CPU-only build, AssertionError)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, ValueError, AssertionError) as e:
        raise UsageError(f"argument --device: {device!r} is not a usable device here ({' '.join(str(e).split()).split('. ')[0][:300]})") from None


def load_average() -> float | None:
    """The 1-minute load average (None where the OS gives none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def busy_cpu_warning(device: str, load: float | None) -> str | None:
    """A warning line when CPU timings will be noisy: a load average above half the CPUs means other
    processes share the cores (and the threads of a CPU op start late on them)."""
    cpus = os.cpu_count() or 1
    if device != "cpu" or load is None or load <= 0.5 * cpus:
        return None
    return f"warning: load average {load} on {cpus} CPUs: other processes share the cores and times will be noisy"


def synchronize(device: str) -> None:
    if device == "mps":
        torch.mps.synchronize()
    elif device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], device: str, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of fn() in milliseconds, after warm-up, the device synchronized each time."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
