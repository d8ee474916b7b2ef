"""Kernel benchmark: torch_qmm's affine_qmm against its peers on one device, in one run.

One `Config` (shape, M, bits, dtype) -> one `Result` holding the median time of every
implementation. Method:
  * every implementation gets several copies of its weights, cycled call by call, so the weights
    in play exceed the last-level cache (a weight read comes from memory, as in a real model);
  * outputs are checked against a reference before timing (torch_qmm's against the float64
    reference on a slice of output columns, with the tests' tolerance rule);
  * warm-up, then rounds in which every implementation runs once (interleaved, so background load
    hits all of them alike), device synchronized around each call; the median is reported. The
    order changes from round to round (balanced_orders): every implementation follows each other
    one equally often, so what a call inherits from the one before it (threads a peer left spinning
    or asleep, caches it filled) is spread over all of them alike;
  * MLX runs in a child process of its own after the others (mlx_peer.py): its worker threads
    keep spinning after a call and would slow whatever is timed next to them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .. import reference, reference_fp
from ..activations import GGUF_INT8_TYPES, activation_quantization
from ..gguf_blocks import f16_scales, set_f16_scales
from ..devices import synchronize
from ..formats import FORMATS
from ..ops import gguf_matmul, quantized_matmul
from ..tolerance import route_precision, worst_ratio

OURS = "torch_qmm"


@dataclasses.dataclass(frozen=True)
class Config:
    n: int  # out features (rows of W)
    k: int  # in features
    m: int  # rows of x
    bits: int
    dtype: str  # of x, scales, biases
    group_size: int = 64
    device: str = "cpu"
    fmt: str = "affine"  # an fp mode ("mxfp4", "nvfp4": FP_MODES), or a native GGUF type (gguf_types.NATIVE_TYPES by name)

    @property
    def label(self) -> str:
        return f"{self.bits}-bit" if self.fmt == "affine" else self.fmt

    @property
    def gguf(self) -> bool:
        """A GGUF type: its blocks fix their own bits and groups (bits / group_size are unused)."""
        return self.fmt in GGMLQuantizationType.__members__


@dataclasses.dataclass
class Result:
    config: Config
    times_ms: dict[str, float]  # implementation -> median ms (missing: unsupported here)
    min_ms: dict[str, float]  # implementation -> fastest sample (less sensitive to background load)
    samples: dict[str, int]
    weight_bytes: dict[str, int]  # implementation -> bytes of weights read per call
    skipped: dict[str, str]  # implementation -> why it did not run
    load_average: float | None = None  # 1-minute load average when the config was timed
    # With --rounds R > 1: each round's median times (implementation -> ms), in the order run.
    round_times_ms: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # implementation -> the threads its call ran on, where known (torch_qmm on CPU: the count of its
    # work split, csrc/cpu/work_split.h, by which a small call runs on fewer threads than torch's
    # count; its GEMM routes of large M take torch's count whatever the size; llamacpp: the count
    # it was given)
    threads: dict[str, int] = dataclasses.field(default_factory=dict)

    def gbps(self, impl: str = OURS) -> float:
        return self.weight_bytes[impl] / (self.times_ms[impl] * 1e-3) / 1e9

    def speedups(self) -> dict[str, float]:
        """Peer time / torch_qmm time (> 1: torch_qmm is faster)."""
        ours = self.times_ms[OURS]
        return {p: t / ours for p, t in self.times_ms.items() if p != OURS}


def merge_rounds(rounds: list[Result]) -> Result:
    """One config's Results from several passes over the run (--rounds) as one: each
    implementation's time is the median of its rounds' medians, min_ms its fastest call of all,
    samples their sum, load_average the highest; an implementation skipped in any round is skipped (with that round's
    reason). The rounds' medians stay in round_times_ms."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    skipped = {k: v for r in rounds for k, v in r.skipped.items()}
    impls = [k for k in first.times_ms if k not in skipped and all(k in r.times_ms for r in rounds)]
    loads = [r.load_average for r in rounds if r.load_average is not None]
    return Result(first.config, {k: statistics.median(r.times_ms[k] for r in rounds) for k in impls},
                  {k: min(r.min_ms[k] for r in rounds) for k in impls},
                  {k: sum(r.samples[k] for r in rounds) for k in impls},
                  {k: first.weight_bytes[k] for k in impls}, skipped, max(loads) if loads else None,
                  [{k: r.times_ms[k] for k in impls} for r in rounds],
                  {k: n for k, n in first.threads.items() if k in impls})


# An implementation prepared for one config: a call using weight copy i, its weight bytes.
Impl = tuple[Callable[[int], object], int]


def _rand_affine(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    words = torch.randint(0, 2**32, (n, k * bits // 32), generator=gen, dtype=torch.int64)
    wq = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.001).to(dtype)
    biases = (torch.randn(n, k // group_size, generator=gen) * 0.05).to(dtype)
    return wq.to(device), scales.to(device), biases.to(device)


def copies_for(nbytes: int, cache_bytes: int, max_copies: int = 16) -> int:
    """Weight copies so that the set cycled through is at least twice the last-level cache."""
    return max(1, min(max_copies, math.ceil(2 * cache_bytes / max(nbytes, 1))))


def random_gguf_blocks(n: int, k: int, fmt: str, device: str, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * block bytes] of random blocks with small finite f16 super-block scales."""
    ggml_type = GGMLQuantizationType[fmt]
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    blocks = torch.randint(0, 256, (n, k // 256, block_bytes), generator=gen, dtype=torch.uint8)
    count = f16_scales(blocks[:1, :1], int(ggml_type)).shape[-1]  # d (and dmin)
    set_f16_scales(blocks, int(ggml_type), torch.rand(n, k // 256, count, generator=gen) * 2e-3 + 1e-4)
    return blocks.reshape(n, -1).to(device)


def _ours_gguf(cfg: Config, x: torch.Tensor, cache_bytes: int, gen: torch.Generator) -> Impl:
    first = random_gguf_blocks(cfg.n, cfg.k, cfg.fmt, cfg.device, gen)
    nbytes = first.numel()
    sets = [first] + [random_gguf_blocks(cfg.n, cfg.k, cfg.fmt, cfg.device, gen)
                      for _ in range(copies_for(nbytes, cache_bytes) - 1)]
    ggml_type = int(GGMLQuantizationType[cfg.fmt])
    cols = min(64, cfg.n)
    y = gguf_matmul(x, first[:cols], ggml_type, cols, cfg.k).cpu()
    w = torch.from_numpy(gguf_quants.dequantize(first[:cols].cpu().numpy(), ggml_type)).double()
    xd = x.cpu().double()
    worst = worst_ratio(y, xd @ w.T, xd.abs() @ w.abs().T, getattr(torch, cfg.dtype), torch.get_float32_matmul_precision())
    if not worst <= 1.0:
        raise AssertionError(f"torch_qmm output differs from the reference for {cfg} (worst error/bound {worst:.2f})")
    return (lambda i: gguf_matmul(x, sets[i % len(sets)], ggml_type, cfg.n, cfg.k)), nbytes


# The fp modes of the format table: mode -> (group size, bits), MLX's defaults (its only ones).
FP_MODES = {m: (f.default_group_size, f.default_bits) for m, f in FORMATS.items() if not f.has_biases}


def _rand_fp(n: int, k: int, mode: str, device: str, gen: torch.Generator):
    """(wq, scales) of random codes (e4m3: the NaN codes 0x7F / 0xFF replaced by 0x7E / 0xFE) and
    small scale bytes: e8m0 2^-8 .. 2^-5, e4m3 2^-6 .. 0.03."""
    gs, bits = FP_MODES[mode]
    words = torch.randint(0, 2**32, (n, k * bits // 32), generator=gen, dtype=torch.int64)
    wq = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    if FORMATS[mode].element == "e4m3":
        b = wq.view(torch.uint8)
        b[(b & 0x7F) == 0x7F] -= 1
    wq = wq.view(torch.uint32)
    lo, hi = (127 - 8, 127 - 4) if FORMATS[mode].scale == "e8m0" else (8, 3 * 8)
    scales = torch.randint(lo, hi, (n, k // gs), generator=gen, dtype=torch.int64).to(torch.uint8)
    return wq.to(device), scales.to(device)


def _ours_fp(cfg: Config, x: torch.Tensor, cache_bytes: int, gen: torch.Generator) -> Impl:
    gs, bits = FP_MODES[cfg.fmt]
    first = _rand_fp(cfg.n, cfg.k, cfg.fmt, cfg.device, gen)
    nbytes = sum(t.numel() * t.element_size() for t in first)
    sets = [first] + [_rand_fp(cfg.n, cfg.k, cfg.fmt, cfg.device, gen)
                      for _ in range(copies_for(nbytes, cache_bytes) - 1)]
    cols = min(64, cfg.n)
    wq, scales = first[0][:cols].cpu(), first[1][:cols].cpu()
    y = quantized_matmul(x, wq.to(x.device), scales.to(x.device), None, group_size=gs, bits=bits, mode=cfg.fmt).cpu()
    y_ref = reference_fp.qmm_fp(x.cpu(), wq, scales, cfg.fmt, gs, bits)
    mag = reference_fp.qmm_fp_magnitude(x.cpu(), wq, scales, cfg.fmt, gs, bits)
    precision = _precision(x, wq, scales, None, bits, gs, cfg.fmt)
    worst = worst_ratio(y, y_ref, mag, getattr(torch, cfg.dtype), precision)
    if not worst <= 1.0:
        raise AssertionError(f"torch_qmm output differs from the reference for {cfg} (worst error/bound {worst:.2f})")
    mode = cfg.fmt
    return (lambda i: quantized_matmul(x, *sets[i % len(sets)], None, group_size=gs, bits=bits, mode=mode)), nbytes


def _ours(cfg: Config, x: torch.Tensor, cache_bytes: int, gen: torch.Generator) -> Impl:
    if cfg.fmt in FP_MODES:
        return _ours_fp(cfg, x, cache_bytes, gen)
    if cfg.fmt != "affine":
        return _ours_gguf(cfg, x, cache_bytes, gen)
    dtype = getattr(torch, cfg.dtype)
    first = _rand_affine(cfg.n, cfg.k, cfg.bits, cfg.group_size, dtype, cfg.device, gen)
    nbytes = sum(t.numel() * t.element_size() for t in first)
    sets = [first] + [
        _rand_affine(cfg.n, cfg.k, cfg.bits, cfg.group_size, dtype, cfg.device, gen)
        for _ in range(copies_for(nbytes, cache_bytes) - 1)
    ]
    _check_ours(cfg, x, *first)
    gs, bits = cfg.group_size, cfg.bits
    return (lambda i: quantized_matmul(x, *sets[i % len(sets)], group_size=gs, bits=bits)), nbytes


def _precision(x: torch.Tensor, wq, scales, biases, bits: int, group_size: int, mode: str) -> str:
    """The tolerance precision of torch_qmm's result: the float32 matmul precision in force, or
    that of the CPU route the call takes (tolerance.route_precision)."""
    precision = torch.get_float32_matmul_precision()
    if x.device.type != "cpu":
        return precision
    route = torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, bits, group_size, True, mode)
    return route_precision(route, precision)


def _check_ours(cfg: Config, x: torch.Tensor, wq, scales, biases, cols: int = 64) -> None:
    """torch_qmm vs the float64 reference on the first `cols` outputs (torch_qmm/tolerance.py, at
    the precision of _precision)."""
    cols = min(cols, cfg.n)
    wq, scales, biases = wq[:cols].cpu(), scales[:cols].cpu(), biases[:cols].cpu()
    y = quantized_matmul(x, wq.to(x.device), scales.to(x.device), biases.to(x.device),
                         group_size=cfg.group_size, bits=cfg.bits).cpu()
    y_ref = reference.qmm(x.cpu(), wq, scales, biases, cfg.bits, cfg.group_size, True)
    mag = reference.qmm_magnitude(x.cpu(), wq, scales, biases, cfg.bits, cfg.group_size, True)
    precision = _precision(x, wq, scales, biases, cfg.bits, cfg.group_size, "affine")
    worst = worst_ratio(y, y_ref, mag, getattr(torch, cfg.dtype), precision)
    if not worst <= 1.0:
        raise AssertionError(f"torch_qmm output differs from the reference for {cfg} (worst error/bound {worst:.2f})")


def _linear(cfg: Config, dtype: torch.dtype, cache_bytes: int, gen: torch.Generator) -> Impl:
    x = torch.randn(cfg.m, cfg.k, generator=gen).to(device=cfg.device, dtype=dtype)
    nbytes = cfg.n * cfg.k * dtype.itemsize
    ws = [(torch.randn(cfg.n, cfg.k, generator=gen) * 0.02).to(device=cfg.device, dtype=dtype)
          for _ in range(copies_for(nbytes, cache_bytes))]
    return (lambda i: F.linear(x, ws[i % len(ws)])), nbytes


def _int8pack(cfg: Config, dtype: torch.dtype, cache_bytes: int, gen: torch.Generator) -> Impl:
    x = torch.randn(cfg.m, cfg.k, generator=gen).to(device=cfg.device, dtype=dtype)
    nbytes = cfg.n * cfg.k + cfg.n * dtype.itemsize
    sets = [(torch.randint(-128, 128, (cfg.n, cfg.k), generator=gen, dtype=torch.int8).to(cfg.device),
             (torch.rand(cfg.n, generator=gen) * 0.01).to(device=cfg.device, dtype=dtype))
            for _ in range(copies_for(nbytes, cache_bytes))]
    return (lambda i: torch._weight_int8pack_mm(x, *sets[i % len(sets)])), nbytes


def _int4pack(cfg: Config, dtype: torch.dtype, cache_bytes: int, gen: torch.Generator) -> Impl:
    """PyTorch's int4 weight-only matmul (w = (q - 8) * scale + zero per group of 64)."""
    if cfg.k % cfg.group_size:
        raise RuntimeError("K not a multiple of the group size")
    on_cpu = cfg.device == "cpu"
    convert = torch._convert_weight_to_int4pack_for_cpu if on_cpu else torch._convert_weight_to_int4pack
    mm = torch._weight_int4pack_mm_for_cpu if on_cpu else torch._weight_int4pack_mm
    x = torch.randn(cfg.m, cfg.k, generator=gen).to(device=cfg.device, dtype=dtype)

    def one_set():
        q = torch.randint(0, 16, (cfg.n, cfg.k), generator=gen, dtype=torch.int32).to(cfg.device)
        packed = convert(q, 1) if on_cpu else convert(q.to(torch.uint8), 8)
        sz = (torch.rand(cfg.k // cfg.group_size, cfg.n, 2, generator=gen) * 0.01).to(device=cfg.device, dtype=dtype)
        return packed, sz

    first = one_set()
    nbytes = first[0].numel() * first[0].element_size() + first[1].numel() * first[1].element_size()
    sets = [first] + [one_set() for _ in range(copies_for(nbytes, cache_bytes) - 1)]
    gs = cfg.group_size
    return (lambda i: mm(x, sets[i % len(sets)][0], gs, sets[i % len(sets)][1])), nbytes


def _without_avx2_chunks(cfg: Config, x: torch.Tensor, cache_bytes: int, gen: torch.Generator) -> Impl:
    """torch_qmm itself with its AVX2 chunk kernels set aside (TORCH_QMM_CPU_NO_AVX2_CHUNKS=1 around
    each call): the fused / generic routes they replace, for an A/B in the same run."""
    if cfg.device != "cpu":
        raise RuntimeError("CPU only")
    call, nbytes = _ours(cfg, x, cache_bytes, gen)

    def without(i: int):
        os.environ["TORCH_QMM_CPU_NO_AVX2_CHUNKS"] = "1"
        try:
            return call(i)
        finally:
            del os.environ["TORCH_QMM_CPU_NO_AVX2_CHUNKS"]

    return without, nbytes


def _quantizing(call: Callable[[int], torch.Tensor], kind: str) -> Callable[[int], torch.Tensor]:
    """call under torch_qmm.activation_quantization(kind)."""

    def quantized(i: int):
        with activation_quantization(kind):
            return call(i)

    return quantized


def _has_int8_kernels(fmt: str) -> bool:
    return fmt == "affine" or (fmt in GGMLQuantizationType.__members__ and int(GGMLQuantizationType[fmt]) in GGUF_INT8_TYPES)


def _with_int8_activations(cfg: Config, x: torch.Tensor, cache_bytes: int, gen: torch.Generator) -> Impl:
    """torch_qmm itself with x quantized to int8 (torch_qmm.activation_quantization("int8") around
    each call): the opt-in approximate path against the exact one, in the same run."""
    if cfg.device != "cpu" or not _has_int8_kernels(cfg.fmt):
        raise RuntimeError("CPU, affine or GGUF Q4_K / Q6_K only")
    call, nbytes = _ours(cfg, x, cache_bytes, gen)
    return _quantizing(call, "int8"), nbytes


# Peers that are torch_qmm itself under another setting (run only when named in --peers).
OURS_VARIANTS = ("no_avx2_chunks", "int8_activations")


def peers(cfg: Config, x: torch.Tensor | None = None) -> dict[str, Callable[[int, torch.Generator], Impl]]:
    """Peer name -> builder(cache_bytes, generator). Builders raise when the peer is unavailable."""
    dtype = getattr(torch, cfg.dtype)
    out: dict[str, Callable[[int, torch.Generator], Impl]] = {}
    if x is not None:
        out["no_avx2_chunks"] = lambda c, g: _without_avx2_chunks(cfg, x, c, g)
    if x is not None and _has_int8_kernels(cfg.fmt):
        out["int8_activations"] = lambda c, g: _with_int8_activations(cfg, x, c, g)
    for d in (torch.float32, torch.float16, torch.bfloat16):
        out[f"linear_{str(d)[6:]}"] = lambda c, g, d=d: _linear(cfg, d, c, g)
    if cfg.fmt != "affine":  # the other peers are affine-format counterparts
        return out
    out["int8pack"] = lambda c, g: _int8pack(cfg, dtype, c, g)
    out["int4pack"] = lambda c, g: _int4pack(cfg, dtype, c, g)
    return out  # MLX is timed in its own process: mlx_peer.py


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n implementations, one per round, cycled: a balanced Latin square (Williams), in
    which each implementation takes each position once and, within a round, follows every other
    one exactly once (n even; n odd: 2n orders, each with its mirror, twice)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(i + r) % n for i in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def time_impls(impls: dict[str, Impl], device: str, repeats: int, budget_s: float = 2.0) -> dict[str, dict]:
    """Per implementation: median and min ms over interleaved rounds, and the number of samples.

    The warm-up call is timed too: an implementation slower than `budget_s` per call keeps that
    one sample (e.g. MLX's CPU kernels at large M); others run min(repeats, budget_s / t) rounds.
    Round r calls the implementations in balanced_orders' order r (cycled).
    """
    samples: dict[str, list[float]] = {}
    rounds: dict[str, int] = {}
    for name, (call, _) in impls.items():
        synchronize(device)
        t0 = time.perf_counter()
        call(0)
        synchronize(device)
        t = time.perf_counter() - t0
        rounds[name] = max(0, min(repeats, int(budget_s / max(t, 1e-9))))
        samples[name] = [] if rounds[name] else [t * 1e3]
    names = list(impls)
    orders = balanced_orders(len(names))
    for r in range(max(rounds.values(), default=0)):
        for name in (names[i] for i in orders[r % len(orders)]):
            call = impls[name][0]
            if r >= rounds[name]:
                continue
            synchronize(device)
            t0 = time.perf_counter()
            call(r + 1)
            synchronize(device)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: {"median": statistics.median(s), "min": min(s), "samples": len(s)} for name, s in samples.items()}


def run_config(cfg: Config, repeats: int, cache_bytes: int, peer_filter: Callable[[str], bool] = lambda p: True,
               seed: int = 0, explicit: Callable[[str], bool] = lambda p: False,
               activations: str | None = None) -> Result:
    """Times torch_qmm and its in-process peers for one config (MLX: mlx_peer.py), all in the same
    rounds: every config's ratios come from peers timed next to it, and every config of a run is
    timed under the same interleaving. `activations` ("int8"): torch_qmm's own calls are timed
    inside torch_qmm.activation_quantization(activations) (its output checked exact before)."""
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.m, cfg.k, generator=gen).to(device=cfg.device, dtype=getattr(torch, cfg.dtype))
    ours = _ours(cfg, x, cache_bytes, gen)
    if activations is not None:
        ours = (_quantizing(ours[0], activations), ours[1])
    impls: dict[str, Impl] = {OURS: ours}
    skipped: dict[str, str] = {}
    for name, build in peers(cfg, x).items():
        if not peer_filter(name) or (name in OURS_VARIANTS and not explicit(name)):
            continue
        try:
            impl = build(cache_bytes, gen)
            impl[0](0)
            impls[name] = impl
        except Exception as e:  # noqa: BLE001 - a peer missing on this device/version is reported
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    stats = time_impls(impls, cfg.device, repeats)
    nbytes = {name: impl[1] for name, impl in impls.items()}
    threads = {OURS: int(torch.ops.torch_qmm._cpu_threads(x, cfg.n, cfg.k))} if cfg.device == "cpu" else {}
    return Result(cfg, {k: v["median"] for k, v in stats.items()}, {k: v["min"] for k, v in stats.items()},
                  {k: v["samples"] for k, v in stats.items()}, nbytes, skipped, load, threads=threads)
