"""`python -m torch_qmm bench --device metalsim`: simulated device traffic of the Metal kernels.

No Apple GPU here, so instead of time this reports what the kernel the planner picks would move:
each Config runs once on metalsim with byte counters (torch_qmm.metalsim.backend(count=True)),
and for every buffer the launch binds (wq, scales, biases, x, y):
  compulsory    the buffer's size: the traffic of a perfect kernel;
  tg_footprint  sum over threadgroups of the distinct bytes each one touches: the device traffic
                when caches give no reuse between threadgroups (how often a byte is fetched);
  loaded        bytes as the kernel's loads ask (no cache at all); stored likewise.
The bounds: at M = 1, wq/scales/biases tg_footprint <= 1.02x compulsory (each weight
byte fetched once); at M >= 2, wq <= ceil(M / tile rows)x and x <= ceil(N / tile cols)x for the
tile (rows of x, columns of y per threadgroup) of the chosen kernel.

Emulating the default shapes takes minutes per cell, so by default N and K are divided by
SCALE (same aspect; every K stays a multiple of 128 so all group sizes apply); --full runs them
as they are. Shapes given with --shapes run as given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from .kernels import Config

SCALE = 8
# Must match the buffer names the planner binds (csrc/plan.cpp, Launch.buffers).
BUFFERS = ("wq", "scales", "biases", "x", "y")
M1_BOUND = 1.02


@dataclasses.dataclass
class BufferTraffic:
    compulsory: int
    tg_footprint: int
    loaded: int
    stored: int
    bound: float | None  # tg_footprint / compulsory must stay <= bound; None: no bound stated

    @property
    def tg_ratio(self) -> float:
        return self.tg_footprint / self.compulsory

    @property
    def loaded_ratio(self) -> float:
        return self.loaded / self.compulsory

    @property
    def holds(self) -> bool | None:
        return None if self.bound is None else self.tg_ratio <= self.bound + 1e-9


@dataclasses.dataclass
class Traffic:
    config: Config
    scale: int  # N and K were divided by this from the named shape (1: as named)
    transpose: bool
    kernel: str
    route: str
    tile: tuple  # (rows of x, columns of y) per threadgroup
    threadgroups: tuple
    buffers: dict[str, BufferTraffic]
    emulation_s: float
    mode: str = "affine"  # quantization mode of W

    @property
    def holds(self) -> bool:
        return all(b.holds is not False for b in self.buffers.values())

    def failures(self) -> list[str]:
        return [f"{self.kernel}: {name} tg_footprint {b.tg_ratio:.3f}x compulsory > bound {b.bound:g}x "
                f"(M={self.config.m}, N={self.config.n}, tile {self.tile})"
                for name, b in self.buffers.items() if b.holds is False]


def bounds(m: int, n: int, tile: tuple) -> dict[str, float]:
    """The stated bound on tg_footprint / compulsory per buffer (buffers without one are absent;
    the fp modes bind no biases)."""
    if m == 1:
        return {"wq": M1_BOUND, "scales": M1_BOUND, "biases": M1_BOUND}
    rows, cols = tile
    return {"wq": math.ceil(m / rows), "x": math.ceil(n / cols)}


def measure(cfg: Config, transpose: bool = True, scale: int = 1, mode: str = "affine") -> Traffic:
    """Runs quantized_matmul for cfg once on metalsim with byte counters.

    x is [M, K] in cfg.dtype; W is [N, K] (transpose=True) or [K, N], quantized in `mode` (the fp
    modes take their own bits and group size); one launch is expected.
    """
    import torch_qmm
    from torch_qmm.metalsim import backend, last_launches

    dtype = getattr(torch, cfg.dtype)
    rows, cols = (cfg.n, cfg.k) if transpose else (cfg.k, cfg.n)
    g = torch.Generator().manual_seed(cfg.m + cfg.n + cfg.k)
    gs, bits = (cfg.group_size, cfg.bits) if mode == "affine" else (None, None)
    wq, s, *rest = torch_qmm.quantize(torch.randn(rows, cols, generator=g).to(dtype), group_size=gs, bits=bits,
                                      mode=mode)
    b = rest[0] if rest else None
    x = torch.randn(cfg.m, cfg.k, generator=g).to(dtype)
    t0 = time.perf_counter()
    with backend(count=True):
        y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=gs, bits=bits, mode=mode)
    seconds = time.perf_counter() - t0
    launches = last_launches()
    if len(launches) != 1:
        raise RuntimeError(f"expected one kernel launch for {cfg}, got {[lc.kernel for lc in launches]}")
    (launch,) = launches
    tensors = {"wq": wq, "scales": s, "biases": b, "x": x, "y": y}
    stats = {name: launch.stats.buffers[i] for i, name in launch.buffers.items()}
    limit = bounds(cfg.m, cfg.n, launch.tile)
    per = {}
    for name in BUFFERS:
        if name not in stats:  # biases: not bound in the fp modes
            continue
        st = stats[name]
        per[name] = BufferTraffic(compulsory=tensors[name].numel() * tensors[name].element_size(),
                                  tg_footprint=st.tg_footprint, loaded=st.bytes_loaded, stored=st.bytes_stored,
                                  bound=limit.get(name))
    return Traffic(cfg, scale, transpose, launch.kernel, launch.route, tuple(launch.tile),
                   tuple(launch.threadgroups), per, seconds, mode)


def shapes(args: argparse.Namespace, seed_shapes: list[str], quick: dict) -> list[tuple[int, int, int]]:
    """(N, K, scale) to run: the default shapes divided by SCALE unless --full; --shapes as given."""
    if args.shapes:
        return [(*_nk(s), 1) for s in args.shapes]
    scale = 1 if args.full else SCALE
    return [(n // scale, k // scale, scale) for n, k in map(_nk, quick.get("shapes") or seed_shapes)]


def _nk(shape: str) -> tuple[int, int]:
    n, k = (int(v) for v in shape.lower().split("x"))
    return n, k


def record(t: Traffic) -> dict:
    """The JSON record of one cell."""
    return {
        **dataclasses.asdict(t.config),
        "mode": t.mode,
        "scale": t.scale,
        "shape_named": f"{t.config.n * t.scale}x{t.config.k * t.scale}",
        "transpose": t.transpose,
        "kernel": t.kernel,
        "route": t.route,
        "tile": list(t.tile),
        "threadgroups": list(t.threadgroups),
        "buffers": {name: {"compulsory": b.compulsory, "tg_footprint": b.tg_footprint,
                           "tg_ratio": round(b.tg_ratio, 4), "loaded": b.loaded,
                           "loaded_ratio": round(b.loaded_ratio, 4), "stored": b.stored,
                           "bound": b.bound, "holds": b.holds}
                    for name, b in t.buffers.items()},
        "bounds_hold": t.holds,
        "emulation_s": round(t.emulation_s, 3),
    }


def table_rows(results: list[Traffic]) -> list[list[str]]:
    """One row per buffer; the cell's columns only on its first row."""
    rows = [["N x K", "M", "bits", "dtype", "kernel", "tile", "buffer", "compulsory", "tg_footprint", "tg/comp",
             "loaded", "ld/comp", "stored", "bound", "holds"]]
    for t in results:
        c = t.config
        first = [f"{c.n}x{c.k}", str(c.m), str(c.bits), c.dtype, t.kernel, f"{t.tile[0]}x{t.tile[1]}"]
        for i, (name, b) in enumerate(t.buffers.items()):
            lead = first if i == 0 else [""] * len(first)
            rows.append(lead + [name, str(b.compulsory), str(b.tg_footprint), f"{b.tg_ratio:.3f}", str(b.loaded),
                                f"{b.loaded_ratio:.2f}", str(b.stored), "-" if b.bound is None else f"<={b.bound:g}",
                                {None: "-", True: "yes", False: "NO"}[b.holds]])
    return rows


def table_note(results: list[Traffic]) -> str:
    scales = sorted({t.scale for t in results})
    shrink = ("N and K divided by " + "/".join(map(str, scales)) + " from the default shapes (same aspect; --full for "
              "the real sizes)") if scales != [1] else "shapes as named"
    return (f"metalsim byte counters, one launch per cell; {shrink}. compulsory: buffer size; tg_footprint: traffic "
            f"with no reuse between threadgroups; loaded/stored: as the kernel's loads/stores ask (no cache); "
            f"bound on tg/comp: M=1 wq/scales/biases <= {M1_BOUND}, M>=2 wq <= ceil(M/tile rows), "
            f"x <= ceil(N/tile cols); tile = rows of x x columns of y per threadgroup.")


def emulator_info() -> dict:
    from ..metalsim import _build

    return {"clang": _build.find_clang(), "opt": _build.opt_flag()}


def run(args: argparse.Namespace, seed_shapes: list[str], seed_ms: list[int], quick: dict) -> int:
    """The --device metalsim branch of `bench`: every shape x bits x dtype x M; table + JSON.

    Default bits/dtype are 4-bit float16 only (emulation is slow); --bits/--dtype widen the sweep.
    Returns 1 when a bound does not hold (the table says which)."""
    from pathlib import Path

    from .report import default_result_path, machine_info, text_table, write_json

    quick = quick if args.quick else {}
    ms = args.m or quick.get("m") or seed_ms
    bits = args.bits or [4]
    dtypes = args.dtype or ["float16"]
    modes = getattr(args, "mode", None) or ["affine"]  # bench --mode: the fp modes take their own bits
    info = {**machine_info("metalsim", None), "metalsim": emulator_info()}
    results = []
    for n, k, scale in shapes(args, seed_shapes, quick):
        for mode in modes:
            for b in bits if mode == "affine" else [0]:
                for d in dtypes:
                    for m in ms:
                        t = measure(Config(n, k, m, b, d, args.group_size, "metalsim"), scale=scale, mode=mode)
                        results.append(t)
                        print(f"  {n}x{k} M={m} {mode} {b or ''}{'-bit ' if b else ''}{d}: {t.kernel} tile "
                              f"{t.tile[0]}x{t.tile[1]}, wq {t.buffers['wq'].tg_ratio:.3f}x, "
                              f"scales {t.buffers['scales'].tg_ratio:.3f}x, x {t.buffers['x'].tg_ratio:.2f}x "
                              f"({t.emulation_s:.1f} s emulated)", flush=True)
    print()
    print(text_table(table_rows(results), table_note(results)))
    failures = [f for t in results for f in t.failures()]
    for f in failures:
        print(f"  bound does not hold: {f}")
    path = Path(args.output) if args.output else default_result_path("metalsim", "traffic")
    write_json(path, {"machine": info, "kind": "metalsim_traffic", "note": table_note(results),
                      "results": [record(t) for t in results]})
    print(f"saved {path}")
    return 1 if failures else 0
