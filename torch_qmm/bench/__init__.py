"""`python -m torch_qmm bench`: affine_qmm against its peers, saved as JSON (+ a plot).

    python -m torch_qmm bench --quick                     # small subset, < 1 min
    python -m torch_qmm bench --shapes 14336x5120 --m 1,4,16,64,256 --bits 4,8 --dtype bfloat16
    python -m torch_qmm bench --model [PATH]               # small transformer (or a transformers folder), M=1 and M=128
    python -m torch_qmm bench --device metalsim [--full]   # simulated traffic of the Metal kernels
    python -m torch_qmm bench --moe [--m 1,8,128]          # gather_qmm on MoE expert layers (moe.py)

Kernel rows: kernels.py (Config -> Result, method); output: report.py; model: model.py;
metalsim traffic (bytes per buffer vs compulsory, no time): metalsim_traffic.py.
Peers in the same run: F.linear float32/float16/bfloat16, torch._weight_int8pack_mm,
PyTorch's int4 weight-only matmul where the device has it (all timed in this process, interleaved),
and mlx.core.quantized_matmul when importable, timed in a child process of its own after the
others (mlx_peer.py: MLX's spinning worker threads would slow them). Performance is reported,
never asserted.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..cli_errors import UsageError, output_file
from ..devices import best_device, busy_cpu_warning, check_usable
from ..formats import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from ..interop.gguf_types import NATIVE_TYPES, type_name
from . import llamacpp_peer, metalsim_traffic, mlx_peer
from .kernels import FP_MODES, Config, merge_rounds, run_config
from .model import format_model, run_model
from .report import (copy_bandwidth_gbps, default_result_path, format_table, last_level_cache_bytes, machine_info,
                     save_json, save_model_plot, save_plot, write_json)

# Default shapes: the projections of 8B-32B llama-class models, out x in (N x K).
SHAPES = ["4096x4096", "5120x5120", "14336x5120", "5120x14336", "27648x5120"]
MS = [1, 2, 4, 8, 16, 32, 128, 512]
BITS = [4, 8]
DTYPES = ["float32", "float16", "bfloat16"]
QUICK = {"shapes": ["4096x4096"], "m": [1, 16, 128], "bits": [4], "dtype": ["bfloat16"]}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _choices(allowed: list[str]):
    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return values
    return parse


def _bit_list(text: str) -> list[int]:
    values = _ints(text)
    if any(v not in SUPPORTED_BITS for v in values):
        raise argparse.ArgumentTypeError(f"expected bit widths among {', '.join(map(str, SUPPORTED_BITS))}, got {text!r}")
    return values


def _shapes(text: str) -> list[str]:
    shapes = [v for v in text.split(",") if v]
    for shape in shapes:
        parts = shape.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected N x K shapes like 4096x4096, got {shape!r}")
    if not shapes:
        raise argparse.ArgumentTypeError("expected at least one N x K shape")
    return shapes


def _positive(text: str) -> int:
    value = _ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return value[0]


PEERS = ["linear_float32", "linear_float16", "linear_bfloat16", "int8pack", "int4pack", "mlx", "no_avx2_chunks",
         "int8_activations", "llamacpp"]
# Run only when named in --peers: torch_qmm with its AVX2 chunk kernels set aside (an A/B),
# torch_qmm with x quantized to int8 (torch_qmm.activation_quantization, affine only), and
# llama.cpp's ggml (built from source on first use: llamacpp_peer.py).
EXPLICIT_PEERS = {"no_avx2_chunks", "int8_activations", "llamacpp"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, mps, cuda, metalsim (default: the best present)")
    parser.add_argument("--quick", action="store_true",
                        help="a small subset: shape 4096x4096, M 1/16/128, 4-bit, bfloat16")
    parser.add_argument("--shapes", type=_shapes, default=None, help=f"N x K list (default: {','.join(SHAPES)})")
    parser.add_argument("--m", type=_ints, default=None,
                        help=f"rows of x, comma-separated (default: {','.join(map(str, MS))})")
    parser.add_argument("--bits", type=_bit_list, default=None,
                        help=f"bit widths, comma-separated, of {','.join(map(str, SUPPORTED_BITS))} "
                             f"(default: {','.join(map(str, BITS))}; --model: the first, default 4)")
    parser.add_argument("--dtype", type=_choices(DTYPES), default=None,
                        help=f"dtypes of x, scales and biases, comma-separated (default: {','.join(DTYPES)}; "
                             "--model: float32)")
    parser.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=64,
                        help="weights per scale/bias (default: %(default)s)")
    parser.add_argument("--mode", type=_choices(["affine", *FP_MODES]), default=None,
                        help="quantization modes, comma-separated, of affine, " + ", ".join(FP_MODES) + " (default: "
                             "affine; the fp modes use MLX's group size and bits, --bits and --group-size "
                             "apply to affine)")
    parser.add_argument("--hot", action="store_true",
                        help="one weight copy per implementation, reused call after call (as ggml's perf mode "
                             "does: use it with --peers llamacpp); default: copies cycled past the last-level cache")
    parser.add_argument("--activations", choices=["int8"], default=None,
                        help="time torch_qmm's calls inside torch_qmm.activation_quantization(ACTIVATIONS): "
                             "the opt-in approximate path (affine and GGUF, CPU) in the torch_qmm column, "
                             "so that every peer ratio (e.g. llamacpp's) is against it (default: exact)")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch.set_num_threads for the run; the llamacpp peer uses as many (default: as is)")
    gguf_names = [type_name(t) for t in NATIVE_TYPES]
    parser.add_argument("--gguf", type=_choices(gguf_names), default=None,
                        help=f"native GGUF types ({', '.join(gguf_names)}): time gguf_qmm on random blocks instead of "
                             "affine_qmm (--bits ignored)")
    parser.add_argument("--peers", type=_choices(PEERS), default=None,
                        help=f"only these peers, comma-separated, of {', '.join(PEERS)} (default: all)")
    parser.add_argument("--float32-precision", choices=["highest", "high", "medium"], default=None,
                        help="torch.set_float32_matmul_precision for the run (all implementations; "
                             "default: leave as is). torch_qmm's CPU 4-bit M=1 kernel then keeps float32 x "
                             "as 2 (high) or 1 (medium) bfloat16 terms instead of 3")
    parser.add_argument("--repeats", type=_positive, default=10,
                        help="timed rounds per config (fewer for calls slower than 2 s; default: %(default)s)")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="passes over all configs, one after the other, every second pass in reverse order; "
                             "each cell is then the median of its rounds' medians (the JSON keeps each round's, in "
                             "the order run), so that one slow minute of a shared machine moves no cell alone; the "
                             "llamacpp peer is timed again in every round (default: %(default)s)")
    parser.add_argument("--mlx-max-m", type=_positive, default=16,
                        help="time MLX only up to this M: its CPU quantized_matmul takes seconds per call beyond "
                             "(default: %(default)s)")
    parser.add_argument("--model", nargs="?", const="tiny", default=None, metavar="CONFIG_OR_PATH",
                        help="model benchmark instead: 'tiny' (the default when no value is given), a JSON file of "
                             "ModelConfig fields, or a transformers folder of float weights (not one torch_qmm "
                             "quantized: there is no float model to compare with); reports forward times at M=1 and "
                             "M=128, weight memory, and the relative error ||y_q - y|| / ||y|| of the quantized "
                             "model's logits against the same model unquantized in the same dtype")
    parser.add_argument("--moe", action="store_true",
                        help="mixture-of-experts benchmark instead (moe.py): gather_qmm on the expert matrices of "
                             "Qwen3-30B-A3B and gpt-oss-20b at 1, 8 and 128 tokens (--m to choose) against loops of "
                             "dense calls and MLX's gather_qmm; JSON to benchmarks/results/cpu-moe-gather-qmm.json")
    parser.add_argument("--output", type=output_file, default=None,
                        help="JSON path (default: benchmarks/results/<tag>-<device>-<time>.json; the plot is "
                             "written next to it as .png)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the .png plot")
    parser.add_argument("--full", action="store_true",
                        help=f"--device metalsim: the default shapes at full size (default: N, K / {metalsim_traffic.SCALE})")


def configs(args: argparse.Namespace, device: str) -> list[Config]:
    quick = QUICK if args.quick else {}
    shapes = args.shapes or quick.get("shapes") or SHAPES
    ms = args.m or quick.get("m") or MS
    bits = args.bits or quick.get("bits") or BITS
    dtypes = args.dtype or quick.get("dtype") or DTYPES
    modes = args.mode or ["affine"]
    formats = [(m, FP_MODES[m][1]) for m in modes if m in FP_MODES]
    if "affine" in modes:
        formats = [("affine", b) for b in bits] + formats
    if args.gguf:
        formats = [(f, 4) for f in args.gguf]
    out = []
    for shape in shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        for fmt, b in formats:
            _check_k(shape, k, fmt, args.group_size)
            for d in dtypes:
                gs = FP_MODES[fmt][0] if fmt in FP_MODES else args.group_size
                out += [Config(n, k, m, b, d, gs, device, fmt) for m in ms]
    return out


def _check_k(shape: str, k: int, fmt: str, group_size: int) -> None:
    """UsageError naming --shapes when K is not a whole number of the format's groups (blocks)."""
    if fmt in FP_MODES:
        group, what = FP_MODES[fmt][0], f"{fmt}'s group size"
    elif fmt == "affine":
        group, what = group_size, "--group-size"
    else:
        group, what = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]][0], f"{fmt}'s block size"
    if k % group:
        raise UsageError(f"argument --shapes: K = {k} of {shape} is not a multiple of {what} ({group})")


def run(args: argparse.Namespace) -> int:
    device = args.device or best_device()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.float32_precision:
        torch.set_float32_matmul_precision(args.float32_precision)
    if args.moe:  # gather_qmm on MoE layers: moe.py (CPU)
        from . import moe

        return moe.run(args)
    if device == "metalsim":  # byte counts instead of time: metalsim_traffic.py
        return metalsim_traffic.run(args, SHAPES, MS, QUICK)
    check_usable(device)
    cfgs = configs(args, device) if args.model is None else []  # its argument errors before any timing
    copy_gbps = copy_bandwidth_gbps(device)
    info = machine_info(device, copy_gbps)
    print(f"{info['processor']} ({info['cpu_threads']} threads), {info['os']}, torch {info['torch']}, "
          f"commit {info['commit']}; copy bandwidth {copy_gbps:.1f} GB/s; "
          f"float32 matmul precision {info['float32_matmul_precision']}")
    if warning := busy_cpu_warning(device, info["load_average"]):
        print(f"{warning} (see min_ms and load_average in the JSON)")

    if args.model is not None:
        return _run_model(args, device, info)

    cache = 0 if args.hot else last_level_cache_bytes()  # 0: one weight copy (kernels.copies_for)
    info["hot"] = bool(args.hot)
    info["activations"] = args.activations  # torch_qmm's calls: None exact, "int8" quantized x
    info["rounds"] = args.rounds
    info["round_order"] = "configs in order in rounds 1, 3, ...; reversed in rounds 2, 4, ..."
    peer_ok = (lambda p: p in args.peers) if args.peers else (lambda p: True)
    llamacpp = _LlamaCpp() if args.peers and "llamacpp" in args.peers else None
    rounds: list[list] = [[] for _ in cfgs]
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}", flush=True)
        if llamacpp is not None:
            llamacpp.new_round()
        # Every other round runs the configurations in reverse, so that a slowdown tied to a place
        # in a long run (seen, cause unknown: benchmarks/README.md) falls on each configuration alike.
        order = range(len(cfgs)) if i % 2 == 0 else range(len(cfgs) - 1, -1, -1)
        for cfg, timed in ((cfgs[j], rounds[j]) for j in order):
            r = run_config(cfg, args.repeats, cache, peer_ok,
                           explicit=lambda p: bool(args.peers) and p in args.peers and p in EXPLICIT_PEERS,
                           activations=args.activations)
            if llamacpp is not None:
                llamacpp.add(r)
            timed.append(r)
            print(f"  {cfg.n}x{cfg.k} M={cfg.m} {cfg.label} {cfg.dtype}: {r.times_ms['torch_qmm']:.3f} ms "
                  f"({r.gbps():.1f} GB/s); {_speedups(r)}", flush=True)
    results = [merge_rounds(timed) for timed in rounds]
    if peer_ok("mlx"):
        _add_mlx(results, args, cache)
    skipped = {p: why for r in results for p, why in r.skipped.items()}
    print()
    print(format_table(results, copy_gbps))
    for p, why in skipped.items():
        print(f"  peer {p} not run: {why}")
    path = Path(args.output) if args.output else default_result_path(device, "quick" if args.quick else "kernels")
    info["load_average_end"] = machine_info(device, copy_gbps)["load_average"]
    isolation = {"in_process": "torch_qmm and the F.linear / int8pack / int4pack peers, interleaved round by round in "
                               "balanced orders (kernels.balanced_orders), peers timed in every config",
                 "mlx": mlx_peer.ISOLATION}
    extra = {"isolation": isolation}
    if llamacpp is not None:
        isolation["llamacpp"] = llamacpp_peer.ISOLATION
        extra["llamacpp"] = llamacpp.record()
    save_json(path, info, results, extra=extra)
    print(f"saved {path}")
    if not args.no_plot:
        print(save_plot(path.with_suffix(".png"), results, info))
    return 0


def _speedups(r) -> str:
    return ", ".join(f"{p} {v:.2f}x" for p, v in r.speedups().items())


def _add_mlx(results: list, args: argparse.Namespace, cache: int) -> None:
    """Times MLX for the eligible configs in a child process (mlx_peer.py) and merges the times."""
    eligible = []
    for r in results:
        c = r.config
        if c.fmt != "affine":
            continue
        if c.m > args.mlx_max_m:
            r.skipped["mlx"] = f"M > {args.mlx_max_m} (--mlx-max-m): MLX's CPU quantized_matmul takes seconds per call"
        else:
            eligible.append(r)
    if not eligible:
        return
    print(f"timing mlx for {len(eligible)} configs in a separate process ...", flush=True)
    for r, out in zip(eligible, mlx_peer.time_in_child([r.config for r in eligible], args.repeats, cache)):
        if "skipped" in out:
            r.skipped["mlx"] = out["skipped"]
            continue
        r.times_ms["mlx"], r.min_ms["mlx"] = out["stats"]["median"], out["stats"]["min"]
        r.samples["mlx"], r.weight_bytes["mlx"] = out["stats"]["samples"], out["bytes"]
        print(f"  {r.config.n}x{r.config.k} M={r.config.m} {r.config.label} {r.config.dtype}: mlx "
              f"{r.times_ms['mlx']:.3f} ms ({r.speedups()['mlx']:.2f}x)", flush=True)


class _LlamaCpp:
    """The llamacpp peer of one run (llamacpp_peer.py): ggml's MUL_MAT for each config with a ggml
    counterpart, timed right after torch_qmm's config (same load), at torch's thread count."""

    def __init__(self):
        self.error = None
        self.binary = None
        try:
            self.binary = llamacpp_peer.ensure_binary(log=lambda m: print(m, flush=True))
        except llamacpp_peer.LlamaCppUnavailable as e:
            self.error = str(e)
            print(f"peer llamacpp not run: {e}")
        self.threads = torch.get_num_threads()
        self.done: dict = {}  # case -> ggml's output, this round (its x is float32 for every dtype row)
        self.cases: dict = {}

    def new_round(self) -> None:
        self.done = {}

    def add(self, r) -> None:
        c = r.config
        if self.error is not None:
            r.skipped["llamacpp"] = self.error.splitlines()[0]
            return
        case = llamacpp_peer.case_for(c.fmt, c.bits, c.n, c.k, c.m) if c.device == "cpu" else None
        if case is None:
            r.skipped["llamacpp"] = "no ggml counterpart of this format on this device"
            return
        if case not in self.done:
            try:
                self.done[case] = llamacpp_peer.time_case(self.binary, case, self.threads)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                self.done[case] = {"error": str(e).splitlines()[0][:200]}
        out = self.done[case]
        if "error" in out:
            r.skipped["llamacpp"] = out["error"]
            return
        r.times_ms["llamacpp"] = r.min_ms["llamacpp"] = out["us_per_run"] / 1e3
        r.samples["llamacpp"], r.weight_bytes["llamacpp"] = out["runs"], case.weight_bytes()
        r.threads["llamacpp"] = self.threads
        self.cases[f"{c.n}x{c.k} M={c.m} {c.label}"] = {"ggml_type": case.ggml_type, "how": out["how"],
                                                        "params": out["params"]}

    def record(self) -> dict:
        if self.error is not None:
            return {"error": self.error}
        return {"binary": str(self.binary), "threads": self.threads, "cases": self.cases,
                "note": "ggml's x is float32 for every torch_qmm x dtype (one ggml time per shape, format and M); "
                        "ggml quantizes x to 8 bits (q8_0 / q8_K) before its dot products; min_ms = the mean "
                        "ggml reports"}


def _run_model(args: argparse.Namespace, device: str, info: dict) -> int:
    dtypes = args.dtype or ["float32"]
    bits = (args.bits or [4])[0]
    results = [run_model(args.model, device, getattr(torch, d), bits, args.group_size, max(1, args.repeats // 2))
               for d in dtypes]
    for r in results:
        print(format_model(r))
    path = Path(default_result_path(device, "model") if args.output is None else args.output)
    info["load_average_end"] = machine_info(device, info["copy_gbps"])["load_average"]
    write_json(path, {"machine": info, "models": results})
    print(f"saved {path}")
    if not args.no_plot:
        print(save_model_plot(path.with_suffix(".png"), results, info))
    return 0
