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

from ..devices import load_average
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
        "load_average": load_average(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import mlx.core as mx

        info["mlx"] = mx.__version__
    except ImportError:
        info["mlx"] = None
    return info



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
    config = dataclasses.asdict(r.config)
    if r.config.gguf:  # the type says it all
        config.update(bits=None, group_size=None)
    return {
        **config,
        "times_ms": {k: round(v, 4) for k, v in r.times_ms.items()},
        "min_ms": {k: round(v, 4) for k, v in r.min_ms.items()},
        "samples": r.samples,
        "weight_bytes": r.weight_bytes,
        "gbps": round(gbps, 3),
        "pct_of_copy_bandwidth": round(100 * gbps / copy_gbps, 1),
        "speedup_vs": {k: round(v, 3) for k, v in r.speedups().items()},
        "skipped": r.skipped,
        "load_average": r.load_average,
        **({"round_times_ms": [{k: round(v, 4) for k, v in t.items()} for t in r.round_times_ms]}
           if r.round_times_ms else {}),
        **({"threads": r.threads} if r.threads else {}),
    }


def format_table(results: list[Result], copy_gbps: float) -> str:
    peers = sorted({p for r in results for p in r.times_ms if p != OURS})
    # Threads per call, where a peer's count is known: a ratio compares calls on these threads.
    counted = [p for p in peers if any(p in r.threads for r in results)]
    shown = any(OURS in r.threads for r in results) and counted
    head = (["N x K", "M", "bits", "dtype", "ms", "GB/s", "%copy"] + [f"x {p}" for p in peers]
            + ([f"threads ({'/'.join([OURS, *counted])})"] if shown else []))
    rows = [head]
    for r in results:
        c = r.config
        sp = r.speedups()
        rows.append([f"{c.n}x{c.k}", str(c.m), c.label, c.dtype, f"{r.times_ms[OURS]:.3f}", f"{r.gbps():.1f}",
                     f"{100 * r.gbps() / copy_gbps:.0f}"] + [f"{sp[p]:.2f}" if p in sp else "-" for p in peers]
                    + (["/".join(str(r.threads.get(p, "-")) for p in [OURS, *counted])] if shown else []))
    note = (f"ms: median torch_qmm time; GB/s: its weight bytes (packed + scales + biases) per second; "
            f"%copy: of the measured copy bandwidth {copy_gbps:.1f} GB/s; x peer: peer time / torch_qmm time "
            f"(> 1: torch_qmm faster)"
            + ("; threads: each call's threads (torch_qmm runs a small call on fewer than torch's count)"
               if shown else ""))
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
    plt = _pyplot()
    if plt is None:
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
        fastest = [fastest_linear(r) for r in rs]
        lin = [t / r.times_ms[OURS] if name else math.nan for r, (name, t) in zip(rs, fastest)]
        ax2.plot(ms, lin, marker="o", label=label)
        for m, v, (name, _) in zip(ms, lin, fastest):  # which F.linear dtype was the fastest there
            if name:
                ax2.annotate(_SHORT_DTYPE[name], (m, v), textcoords="offset points", xytext=(3, 3), fontsize=6)
    ax1.axhline(info["copy_gbps"] / 2, color="gray", ls="--", lw=1, label="copy bandwidth / 2 (read only)")
    for ax, title in ((ax1, "torch_qmm weight GB/s"),
                      (ax2, "speed-up over the fastest F.linear (its dtype at each point: f32/f16/bf16)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows of x)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.axhline(1.0, color="gray", lw=1)
    ax1.legend(fontsize=7)
    fig.suptitle(_plot_title(info))
    return _save(fig, plt, path)


_SHORT_DTYPE = {"linear_float32": "f32", "linear_float16": "f16", "linear_bfloat16": "bf16"}


def fastest_linear(r: Result) -> tuple[str | None, float]:
    """(name, median ms) of the fastest F.linear peer of `r` (None when none ran)."""
    times = {p: t for p, t in r.times_ms.items() if p.startswith("linear_")}
    if not times:
        return None, math.nan
    name = min(times, key=times.get)
    return name, times[name]


def _plot_title(info: dict) -> str:
    load = info.get("load_average")
    end = info.get("load_average_end")
    loads = f"load average {load}" + (f" -> {end}" if end is not None else "") if load is not None else ""
    return (f"torch_qmm on {info['device']} ({info['processor']}, torch {info['torch']}, {info['commit']})"
            + (f"; {loads}" if loads else ""))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig, plt, path: Path) -> str:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def save_model_plot(path: Path, results: list[dict], info: dict) -> str:
    """Model benchmark: forward ms float vs quantized per M, one group per dtype, with the relative
    output error (quantized logits against the same model unquantized) above each pair."""
    plt = _pyplot()
    if plt is None:
        return "plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    tokens = sorted({int(m) for r in results for m in r["by_tokens"]})
    fig, axes = plt.subplots(1, len(tokens), figsize=(5 * len(tokens), 4.5), squeeze=False)
    for ax, m in zip(axes[0], tokens):
        labels = [r["dtype"] for r in results]
        rows = [r["by_tokens"].get(m, r["by_tokens"].get(str(m))) for r in results]
        xs = range(len(results))
        ax.bar([x - 0.2 for x in xs], [t["float_ms"] for t in rows], width=0.4, label="float")
        ax.bar([x + 0.2 for x in xs], [t["quantized_ms"] for t in rows], width=0.4,
               label=f"torch_qmm {results[0]['bits']}-bit gs{results[0]['group_size']}")
        for x, t in zip(xs, rows):
            ax.annotate(f"{t['float_ms'] / t['quantized_ms']:.2f}x, err {t['rel_error']:.3f}",
                        (x, max(t["float_ms"], t["quantized_ms"])), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("forward ms (median)")
        ax.set_title(f"M={m} tokens")
        ax.legend(fontsize=7)
    fig.suptitle(f"model {results[0]['config']}\nerr: ||y_q - y|| / ||y|| of the logits vs the unquantized model; "
                 + _plot_title(info), fontsize=8)
    return _save(fig, plt, path)


def default_result_path(device: str, tag: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(os.environ.get("TORCH_QMM_BENCH_DIR", Path.cwd() / "benchmarks" / "results"))
    return root / f"{tag}-{device}-{stamp}.json"
