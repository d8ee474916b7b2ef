"""Benchmark output: machine facts, the table, the JSON file and the plot."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from .kernels import OURS, Result


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """Size of the largest CPU cache (Linux sysfs; the default elsewhere, e.g. Apple's 32 MB SLC)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            pass
    return max(sizes) if sizes else default


def copy_bandwidth_gbps(device: str, nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Measured device copy bandwidth (bytes read + written per second) of one large tensor copy."""
    from ..devices import synchronize

    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(device: str, copy_gbps: float | None) -> dict:
    """Facts saved with every result; copy_gbps None where no copy bandwidth applies (metalsim)."""
    info = {
        "device": device,
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_gbps": None if copy_gbps is None else round(copy_gbps, 2),
        "load_average": _load_average(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import mlx.core as mx

        info["mlx"] = mx.__version__
    except ImportError:
        info["mlx"] = None
    return info


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def result_record(r: Result, copy_gbps: float) -> dict:
    gbps = r.gbps()
    return {
        **dataclasses.asdict(r.config),
        "times_ms": {k: round(v, 4) for k, v in r.times_ms.items()},
        "min_ms": {k: round(v, 4) for k, v in r.min_ms.items()},
        "samples": r.samples,
        "weight_bytes": r.weight_bytes,
        "gbps": round(gbps, 3),
        "pct_of_copy_bandwidth": round(100 * gbps / copy_gbps, 1),
        "speedup_vs": {k: round(v, 3) for k, v in r.speedups().items()},
        "skipped": r.skipped,
    }


def format_table(results: list[Result], copy_gbps: float) -> str:
    peers = sorted({p for r in results for p in r.times_ms if p != OURS})
    head = ["N x K", "M", "bits", "dtype", "ms", "GB/s", "%copy"] + [f"x {p}" for p in peers]
    rows = [head]
    for r in results:
        c = r.config
        sp = r.speedups()
        rows.append([f"{c.n}x{c.k}", str(c.m), c.label, c.dtype, f"{r.times_ms[OURS]:.3f}", f"{r.gbps():.1f}",
                     f"{100 * r.gbps() / copy_gbps:.0f}"] + [f"{sp[p]:.2f}" if p in sp else "-" for p in peers])
    note = (f"ms: median torch_qmm time; GB/s: its weight bytes (packed + scales + biases) per second; "
            f"%copy: of the measured copy bandwidth {copy_gbps:.1f} GB/s; x peer: peer time / torch_qmm time "
            f"(> 1: torch_qmm faster)")
    return text_table(rows, note)


def text_table(rows: list[list[str]], note: str = "") -> str:
    """Right-aligned columns, a rule under the first (header) row, the note below."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + ([note] if note else []))


def save_json(path: Path, info: dict, results: list[Result], extra: dict | None = None) -> None:
    doc = {"machine": info, "results": [result_record(r, info["copy_gbps"]) for r in results]}
    write_json(path, {**doc, **(extra or {})})


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def save_plot(path: Path, results: list[Result], info: dict) -> str:
    """GB/s vs M and speed-up over the fastest F.linear vs M, one line per shape/bits/dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    series: dict[str, list[Result]] = {}
    for r in results:
        c = r.config
        series.setdefault(f"{c.n}x{c.k} {c.label} {c.dtype}", []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.config.m)
        ms = [r.config.m for r in rs]
        ax1.plot(ms, [r.gbps() for r in rs], marker="o", label=label)
        lin = [min((t for p, t in r.times_ms.items() if p.startswith("linear_")), default=math.nan) / r.times_ms[OURS]
               for r in rs]
        ax2.plot(ms, lin, marker="o", label=label)
    ax1.axhline(info["copy_gbps"] / 2, color="gray", ls="--", lw=1, label="copy bandwidth / 2 (read only)")
    for ax, title in ((ax1, "torch_qmm weight GB/s"), (ax2, "speed-up over the fastest F.linear")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows of x)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.axhline(1.0, color="gray", lw=1)
    ax1.legend(fontsize=7)
    fig.suptitle(f"torch_qmm on {info['device']} ({info['processor']}, torch {info['torch']}, {info['commit']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def default_result_path(device: str, tag: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(os.environ.get("TORCH_QMM_BENCH_DIR", Path.cwd() / "benchmarks" / "results"))
    return root / f"{tag}-{device}-{stamp}.json"
