"""The MLX peer of the kernel benchmark, timed in a process of its own.

MLX's CPU worker threads keep spinning after a call, so timing MLX in the benchmark's process
would slow every other implementation timed next to it. The benchmark therefore never imports mlx: it times everything else first, then runs this module as
a child process (`python -m torch_qmm.bench.mlx_peer`, JSON on stdin and stdout) while it waits
idle, and merges the times. Each config is timed as in the parent (weight copies cycled past the
last-level cache, warm-up, median of rounds, kernels.time_impls).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

ISOLATION = ("mlx is timed in a separate child process (torch_qmm.bench.mlx_peer), started after all "
             "in-process implementations were timed and while the benchmark process waits idle, so MLX's "
             "spinning worker threads never share the CPU with another implementation's timing")


def _mlx_impl(cfg, cache_bytes: int, gen: torch.Generator):
    """mlx.core.quantized_matmul on the affine format (CPU stream unless on a Mac GPU)."""
    import mlx.core as mx

    from .kernels import _rand_affine, copies_for

    if cfg.device not in ("cpu", "mps"):
        raise RuntimeError(f"MLX runs on cpu/mps, not {cfg.device}")
    mx.set_default_device(mx.gpu if cfg.device == "mps" else mx.cpu)
    mdtype = getattr(mx, cfg.dtype)

    def to_mx(t: torch.Tensor):
        if t.dtype == torch.uint32:
            return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
        return mx.array(t.float().numpy()).astype(mdtype)

    dtype = getattr(torch, cfg.dtype)
    x = to_mx(torch.randn(cfg.m, cfg.k, generator=gen))
    first = _rand_affine(cfg.n, cfg.k, cfg.bits, cfg.group_size, dtype, "cpu", gen)
    nbytes = sum(t.numel() * t.element_size() for t in first)
    sets = [first] + [_rand_affine(cfg.n, cfg.k, cfg.bits, cfg.group_size, dtype, "cpu", gen)
                      for _ in range(copies_for(nbytes, cache_bytes) - 1)]
    sets = [tuple(to_mx(t) for t in s) for s in sets]
    mx.eval(sets)
    gs, bits = cfg.group_size, cfg.bits

    def call(i: int):
        y = mx.quantized_matmul(x, *sets[i % len(sets)], transpose=True, group_size=gs, bits=bits)
        mx.eval(y)
        return y

    return call, nbytes


def time_in_child(configs: list, repeats: int, cache_bytes: int, seed: int = 0, timeout_s: float = 3600) -> list[dict]:
    """[{"stats": {median, min, samples}, "bytes": n} or {"skipped": why}] for each config, from a
    child process; every entry is {"skipped": why} when the child cannot run."""
    import dataclasses

    request = {"configs": [dataclasses.asdict(c) for c in configs], "repeats": repeats, "cache_bytes": cache_bytes,
               "seed": seed, "threads": torch.get_num_threads(),
               "float32_matmul_precision": torch.get_float32_matmul_precision()}
    try:
        p = subprocess.run([sys.executable, "-m", "torch_qmm.bench.mlx_peer"], input=json.dumps(request),
                           capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        return [{"skipped": f"MLX child process failed: {type(e).__name__}: {e}"}] * len(configs)
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return [{"skipped": f"MLX child process exited with {p.returncode}: {why}"}] * len(configs)
    return json.loads(p.stdout)


def _child() -> None:
    from .kernels import Config, time_impls

    request = json.loads(sys.stdin.read())
    torch.set_num_threads(request["threads"])
    torch.set_float32_matmul_precision(request["float32_matmul_precision"])
    out = []
    for c in request["configs"]:
        cfg = Config(**c)
        gen = torch.Generator().manual_seed(request["seed"])
        try:
            impl = _mlx_impl(cfg, request["cache_bytes"], gen)
            impl[0](0)
        except Exception as e:  # noqa: BLE001 - reported as a skipped peer
            out.append({"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"})
            continue
        stats = time_impls({"mlx": impl}, cfg.device, request["repeats"])["mlx"]
        out.append({"stats": stats, "bytes": impl[1]})
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    _child()
