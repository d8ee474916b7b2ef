"""Simulated device traffic of gather_qmm's Metal kernels (metal/quant_gather.h) on metalsim.

No Apple GPU here: instead of time, the bytes of W (packed codes, scales, biases) the launch
fetches, summed over threadgroups (metalsim's tg_footprint: the traffic when caches give no reuse
between threadgroups), against
  distinct  the bytes of the distinct experts the pairs use (each read once: the goal),
  per_pair  pairs x one expert's bytes (a kernel that reads W once per (token, expert) pair),
  all       the whole stacked W.
Decode: tokens x top-k experts of E, rhs as a router gives them (unsorted, distinct per token);
prefill: the same pairs sorted by expert (sorted_indices, mlx-lm's order for many tokens).
Only the experts the pairs use hold data; the others are zeros (the kernels never read them).

    PYTHONPATH=. python benchmarks/metalsim_gather_traffic.py [--scale 4] [--json benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import torch_qmm
from torch_qmm import metalsim_backend

# (name, tokens, top-k, experts, N, K, sorted): N x K of one expert, a Qwen3-30B-A3B-like MoE
# layer (128 experts of 768 x 2048, k = 8), N and K divided by --scale.
CONFIGS = [
    ("decode-k8-E128", 1, 8, 128, 768, 2048, False),
    ("decode-4tok-k8-E128", 4, 8, 128, 768, 2048, False),
    ("prefill-64tok-k8-E128-sorted", 64, 8, 128, 768, 2048, True),
]


def measure(name, tokens, k, experts, N, K, sorted_indices, bits=4, gs=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rhs = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    used = sorted(set(rhs.reshape(-1).tolist()))
    w_used = torch.randn(len(used), N, K, generator=g).to(torch.float16)
    wq_u, s_u, b_u = torch_qmm.quantize(w_used, group_size=gs, bits=bits)
    wq = torch.zeros(experts, *wq_u.shape[1:], dtype=wq_u.dtype)
    scales = torch.zeros(experts, *s_u.shape[1:], dtype=s_u.dtype)
    biases = torch.zeros_like(scales)
    for j, e in enumerate(used):
        wq[e], scales[e], biases[e] = wq_u[j], s_u[j], b_u[j]
    if sorted_indices:
        rhs = rhs.reshape(-1).sort().values
        x, lhs = torch.randn(rhs.numel(), 1, K, generator=g).to(torch.float16), None
    else:
        x = torch.randn(tokens, 1, K, generator=g).to(torch.float16)
        lhs = torch.arange(tokens, dtype=torch.int32).reshape(tokens, 1).expand(tokens, k)
    t0 = time.time()
    metalsim_backend._gather_qmm(x, wq, scales, biases, lhs, rhs, "affine", bits, gs, True, sorted_indices,
                                 count=True)
    (launch,) = metalsim_backend.last_launches()
    stats = {launch.buffers[i]: b for i, b in launch.stats.buffers.items() if i in launch.buffers}
    expert_bytes = wq[0].numel() * 4 + 2 * scales[0].numel() * scales.element_size()
    fetched = sum(stats[b].tg_footprint for b in ("wq", "scales", "biases"))
    pairs = rhs.numel()
    return {
        "name": name, "tokens": tokens, "k": k, "experts": experts, "N": N, "K": K, "bits": bits,
        "group_size": gs, "sorted_indices": sorted_indices, "route": launch.route, "kernel": launch.kernel,
        "threadgroups": list(launch.threadgroups), "pairs": pairs, "distinct_experts": len(used),
        "w_fetched_bytes": fetched, "w_distinct_bytes": len(used) * expert_bytes,
        "w_per_pair_bytes": pairs * expert_bytes, "w_all_bytes": experts * expert_bytes,
        "fetched_over_distinct": fetched / (len(used) * expert_bytes),
        "emulation_s": round(time.time() - t0, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=4, help="divide N and K by this (1: as named)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = [measure(n, t, k, e, N // args.scale, K // args.scale, s) for n, t, k, e, N, K, s in CONFIGS]
    print(f"{'config':30} {'route':18} {'pairs':>5} {'distinct':>8} {'fetched/distinct':>16} "
          f"{'per_pair/distinct':>17} {'all/distinct':>12}")
    for r in rows:
        d = r["w_distinct_bytes"]
        print(f"{r['name']:30} {r['route']:18} {r['pairs']:5d} {r['distinct_experts']:8d} "
              f"{r['w_fetched_bytes'] / d:16.3f} {r['w_per_pair_bytes'] / d:17.3f} {r['w_all_bytes'] / d:12.3f}")
    if args.json:
        doc = {"what": "gather_qmm W bytes fetched per launch on metalsim (tg_footprint of wq+scales+biases)",
               "command": "python benchmarks/metalsim_gather_traffic.py " + " ".join(argv or sys.argv[1:]),
               "scale": args.scale, "machine": platform.machine(), "results": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
