"""`python -m torch_qmm bench --moe`: gather_qmm on mixture-of-experts layers, against its peers.

Expert matrices of two models at 1, 8 and 128 tokens:
  qwen3-30b-a3b  128 experts, top-8: gate/up [E, 768, 2048], down [E, 2048, 768], affine 4-bit
                 (group 64, bfloat16 scales), as MLX-LM quantizes it;
  gpt-oss-20b    32 experts, top-4: [E, 2880, 2880], mxfp4 (the format its checkpoint ships in).
Each call computes y[t, j] = x[t] @ W[experts[t, j]].T for every token t and its k experts.

Implementations, timed in this process round by round (kernels.time_impls):
  torch_qmm            one gather_qmm call (MLX-LM's SwitchGLU call: x [T, 1, 1, K], indices [T, k]);
  loop_qmm             a Python loop over the selected experts, one dense quantized_matmul per expert
                       on the rows of the tokens that chose it (index_select / index_copy_ around it;
                       which pairs use which expert is worked out before the timing);
  loop_linear          the same loop with F.linear over the experts dequantized to bfloat16 beforehand
                       (the unquantized model's cost, only the selected experts read);
  gguf_q4k             (affine 4-bit configs) the experts as GGUF Q4_K blocks of the same shape (4.5 bits
                       per weight, as affine 4-bit group 64 with bfloat16 scales and biases) through
                       gguf_gather_matmul, the op of a GGUF file's experts (one gguf_qmm per expert);
and mlx.core.gather_qmm on the CPU stream, timed afterwards in a child process (as mlx_peer.py;
MLX's spinning worker threads would slow the others).

Expert choice: call i routes token t to experts perm[(i*T*k + t*k + j) % E] of one fixed random
permutation, so the k experts of a token differ, load is even, and an expert comes back only after
all E were read (E * expert bytes >= 2x the last-level cache for every matrix here: the weights
come from memory, for every implementation alike).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reference, reference_fp
from ..interop.gguf_gather import gguf_gather_matmul
from ..interop.gguf_types import Q4_K
from ..ops import dequantize, gather_qmm, quantized_matmul
from ..tolerance import worst_ratio
from .kernels import FP_MODES, _rand_affine, _rand_fp, time_impls
from .report import last_level_cache_bytes, machine_info, write_json

RESULT_PATH = Path("benchmarks/results/cpu-moe-gather-qmm.json")
TOKENS = (1, 8, 128)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    model: str
    matrix: str  # which projection
    experts: int
    top_k: int
    n: int  # rows of each expert matrix (out features)
    k: int  # in features
    tokens: int
    mode: str = "affine"
    bits: int = 4
    group_size: int = 64
    dtype: str = "bfloat16"


def model_configs(tokens=TOKENS) -> list[MoeConfig]:
    gs4, b4 = FP_MODES["mxfp4"]
    shapes = [("qwen3-30b-a3b", "gate/up", 128, 8, 768, 2048, "affine", 4, 64),
              ("qwen3-30b-a3b", "down", 128, 8, 2048, 768, "affine", 4, 64),
              ("gpt-oss-20b", "expert", 32, 4, 2880, 2880, "mxfp4", b4, gs4)]
    return [MoeConfig(m, w, e, k, n, kk, t, mode, bits, gs) for (m, w, e, k, n, kk, mode, bits, gs) in shapes
            for t in tokens]


def _experts(cfg: MoeConfig, gen: torch.Generator):
    """(wq [E, N, words], scales, biases or None) of random codes and small scales."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.mode == "affine":
        wq, s, b = _rand_affine(cfg.experts * cfg.n, cfg.k, cfg.bits, cfg.group_size, dtype, "cpu", gen)
    else:
        (wq, s), b = _rand_fp(cfg.experts * cfg.n, cfg.k, cfg.mode, "cpu", gen), None
    shape = lambda t: t.reshape(cfg.experts, cfg.n, -1)  # noqa: E731
    return shape(wq), shape(s), None if b is None else shape(b)


def routing(cfg: MoeConfig, calls: int, seed: int = 1) -> list[torch.Tensor]:
    """The expert indices [T, k] (int32) of each call (module docstring)."""
    perm = torch.randperm(cfg.experts, generator=torch.Generator().manual_seed(seed))
    per_call = cfg.tokens * cfg.top_k
    pos = torch.arange(per_call)
    return [perm[(i * per_call + pos) % cfg.experts].reshape(cfg.tokens, cfg.top_k).to(torch.int32)
            for i in range(calls)]


def _impls(cfg: MoeConfig, x: torch.Tensor, w, calls: int) -> dict:
    wq, scales, biases = w
    kw = dict(group_size=cfg.group_size, bits=cfg.bits, mode=cfg.mode)
    routes = routing(cfg, calls)
    T, k, E = cfg.tokens, cfg.top_k, cfg.experts
    expert_bytes = sum(t[0].numel() * t.element_size() for t in (wq, scales, biases) if t is not None)
    x4 = x[:, None, None, :]

    def ours(i):
        return gather_qmm(x4, wq, scales, biases, rhs_indices=routes[i % calls], **kw)

    # The loops' grouping (which pairs use which expert) is computed here, outside the timing, so
    # the loops pay only for their matmuls and the row copies around them.
    plans = []
    for r in routes:
        idx = r.reshape(-1).long()
        plans.append([(e, pairs, pairs // k) for e in idx.unique().tolist() for pairs in [(idx == e).nonzero()[:, 0]]])

    def loop(matmul):
        def call(i):
            y = torch.empty(T * k, cfg.n, dtype=x.dtype)
            for e, pairs, rows in plans[i % calls]:
                y.index_copy_(0, pairs, matmul(x if T == 1 else x.index_select(0, rows), e))
            return y.reshape(T, k, 1, cfg.n)
        return call

    def dense_qmm(xs, e):
        return quantized_matmul(xs, wq[e], scales[e], None if biases is None else biases[e], **kw)

    # The dequantized experts (bfloat16, as F.linear's weights in the unquantized model).
    dense = dequantize(wq.reshape(E * cfg.n, -1), scales.reshape(E * cfg.n, -1),
                       None if biases is None else biases.reshape(E * cfg.n, -1), dtype=x.dtype, **kw)
    dense = dense.reshape(E, cfg.n, cfg.k)

    def dense_linear(xs, e):
        return F.linear(xs, dense[e])

    used = T * k if T * k < E else E  # distinct experts a call reads (at most E)
    impls = {
        "torch_qmm": (ours, used * expert_bytes),
        "loop_qmm": (loop(dense_qmm), used * expert_bytes),
        "loop_linear": (loop(dense_linear), used * cfg.n * cfg.k * x.element_size()),
    }
    if cfg.mode == "affine" and cfg.bits == 4 and cfg.k % 256 == 0:
        blocks = _q4k_blocks(E, cfg.n, cfg.k, torch.Generator().manual_seed(2))

        def gguf(i):
            return gguf_gather_matmul(x4, blocks, Q4_K, cfg.n, cfg.k, routes[i % calls])

        impls["gguf_q4k"] = (gguf, used * blocks[0].numel())
    return impls, dense


def _q4k_blocks(experts: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random Q4_K blocks uint8 [E, N, K/256 * 144]: random codes and scale bytes, the float16 d and
    dmin of every super-block small and positive."""
    blocks = torch.randint(0, 256, (experts * n * (k // 256), 144), dtype=torch.uint8, generator=gen)
    d = (torch.rand(blocks.shape[0], 2, generator=gen) * 1e-3 + 1e-4).to(torch.float16)
    blocks[:, :4] = d.view(torch.uint8)
    return blocks.reshape(experts, n, -1)


def _check(cfg: MoeConfig, impls: dict, w, x: torch.Tensor) -> float:
    """Worst error / bound (torch_qmm/tolerance.py) of gather_qmm's first call against the float64
    reference (reference.py / reference_fp.py) on the first 64 rows of each selected expert."""
    wq, scales, biases = w
    route = routing(cfg, 1)[0]
    y = impls["torch_qmm"][0](0)[..., :64].reshape(cfg.tokens, cfg.top_k, 64)
    y_ref, mag = torch.empty(y.shape, dtype=torch.float64), torch.empty(y.shape, dtype=torch.float64)
    for t in range(cfg.tokens):
        for j, e in enumerate(route[t].tolist()):
            xt = x[t:t + 1]
            if cfg.mode == "affine":
                args = (wq[e, :64], scales[e, :64], biases[e, :64], cfg.bits, cfg.group_size)
                y_ref[t, j], mag[t, j] = reference.qmm(xt, *args)[0], reference.qmm_magnitude(xt, *args)[0]
            else:
                args = (wq[e, :64], scales[e, :64], cfg.mode, cfg.group_size, cfg.bits)
                y_ref[t, j], mag[t, j] = reference_fp.qmm_fp(xt, *args)[0], reference_fp.qmm_fp_magnitude(xt, *args)[0]
    return worst_ratio(y, y_ref, mag, x.dtype, torch.get_float32_matmul_precision())


def run_config(cfg: MoeConfig, repeats: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.tokens, cfg.k, generator=gen).to(getattr(torch, cfg.dtype))
    w = _experts(cfg, gen)
    impls, dense = _impls(cfg, x, w, calls=repeats + 1)
    worst = _check(cfg, impls, w, x)
    stats = time_impls(impls, "cpu", repeats)
    return {"config": dataclasses.asdict(cfg), "check_worst_ratio": worst,
            "median_ms": {n: s["median"] for n, s in stats.items()}, "min_ms": {n: s["min"] for n, s in stats.items()},
            "samples": {n: s["samples"] for n, s in stats.items()},
            "weight_bytes": {n: b for n, (_, b) in impls.items()}}


# ---- MLX in a child process ---------------------------------------------------------------------


def _mlx_call(cfg: MoeConfig, repeats: int, seed: int = 0):
    import mlx.core as mx

    mx.set_default_device(mx.cpu)

    def to_mx(t: torch.Tensor):
        if t.dtype == torch.uint32:
            return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
        if t.dtype == torch.bfloat16:
            return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
        return mx.array(t.numpy())

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.tokens, cfg.k, generator=gen).to(getattr(torch, cfg.dtype))
    wq, scales, biases = (None if t is None else to_mx(t) for t in _experts(cfg, gen))
    xm = to_mx(x)[:, None, None, :]
    routes = [mx.array(r.numpy()).astype(mx.uint32) for r in routing(cfg, repeats + 1)]
    mx.eval(wq, scales, xm, routes, *(() if biases is None else (biases,)))

    def call(i):
        y = mx.gather_qmm(xm, wq, scales, biases, rhs_indices=routes[i % len(routes)], transpose=True,
                          group_size=cfg.group_size, bits=cfg.bits, mode=cfg.mode)
        mx.eval(y)
        return y

    return call


def _mlx_child() -> None:
    request = json.loads(sys.stdin.read())
    torch.set_num_threads(request["threads"])
    out = []
    for c in request["configs"]:
        cfg = MoeConfig(**c)
        try:
            call = _mlx_call(cfg, request["repeats"])
            out.append(time_impls({"mlx": (call, 0)}, "cpu", request["repeats"])["mlx"])
        except Exception as e:  # noqa: BLE001 - reported as a skipped peer
            out.append({"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"})
    sys.stdout.write(json.dumps(out))


def _mlx_in_child(configs: list[MoeConfig], repeats: int) -> list[dict]:
    request = {"configs": [dataclasses.asdict(c) for c in configs], "repeats": repeats,
               "threads": torch.get_num_threads()}
    try:
        p = subprocess.run([sys.executable, "-m", "torch_qmm.bench.moe"], input=json.dumps(request),
                           capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as e:
        return [{"skipped": f"MLX child process failed: {e}"}] * len(configs)
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return [{"skipped": f"MLX child process exited with {p.returncode}: {why}"}] * len(configs)
    return json.loads(p.stdout)


def run(args) -> int:
    tokens = tuple(args.m) if args.m else TOKENS
    repeats = args.repeats
    info = machine_info("cpu", None)
    cache = last_level_cache_bytes()
    print(f"{info['processor']} ({info['cpu_threads']} threads), torch {info['torch']}, commit {info['commit']}; "
          f"load average {info['load_average']}; last-level cache {cache / 2**20:.0f} MB", flush=True)
    rows = []
    path = Path(args.output) if args.output else RESULT_PATH

    def save():  # after every config, so an interrupted run keeps what it measured
        info["load_average_end"] = machine_info("cpu", None)["load_average"]
        write_json(path, {"machine": info, "isolation": "torch_qmm, loop_qmm, loop_linear interleaved round by "
                                                        "round in one process; mlx in a child process afterwards",
                          "results": rows})

    for cfg in model_configs(tokens):
        r = run_config(cfg, repeats)
        rows.append(r)
        t = r["median_ms"]
        print(f"  {cfg.model} {cfg.matrix} [{cfg.experts}, {cfg.n}, {cfg.k}] {cfg.mode} T={cfg.tokens} "
              f"top-{cfg.top_k}: torch_qmm {t['torch_qmm']:.3f} ms, loop_qmm {t['loop_qmm']:.3f} ms "
              f"({t['loop_qmm'] / t['torch_qmm']:.2f}x), loop_linear {t['loop_linear']:.3f} ms "
              f"({t['loop_linear'] / t['torch_qmm']:.2f}x)"
              + (f", gguf_q4k {t['gguf_q4k']:.3f} ms ({t['gguf_q4k'] / t['torch_qmm']:.2f}x)" if "gguf_q4k" in t else "")
              + f"; check {r['check_worst_ratio']:.2f}", flush=True)
        save()
    if not args.peers or "mlx" in args.peers:
        print("timing mlx.core.gather_qmm in a separate process ...", flush=True)
        for r, out in zip(rows, _mlx_in_child([MoeConfig(**r["config"]) for r in rows], repeats)):
            if "skipped" in out:
                r.setdefault("skipped", {})["mlx"] = out["skipped"]
                continue
            r["median_ms"]["mlx"], r["min_ms"]["mlx"], r["samples"]["mlx"] = out["median"], out["min"], out["samples"]
            print(f"  {r['config']['model']} {r['config']['matrix']} T={r['config']['tokens']}: mlx "
                  f"{out['median']:.3f} ms ({out['median'] / r['median_ms']['torch_qmm']:.2f}x)", flush=True)
    save()
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    _mlx_child()
