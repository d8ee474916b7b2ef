"""bench --moe (torch_qmm/bench/moe.py) on a tiny layer: the routing it promises, the output check,
and the record it writes. Times are not asserted (benchmarks/README.md has them)."""

from __future__ import annotations

import math

import torch

from torch_qmm.bench import moe


def test_routing_gives_distinct_experts_per_token_and_cycles_through_all():
    cfg = moe.MoeConfig("tiny", "w", experts=16, top_k=4, n=64, k=128, tokens=1)
    routes = moe.routing(cfg, calls=4)
    assert all(len(set(r[0].tolist())) == 4 for r in routes)
    seen = torch.cat([r.reshape(-1) for r in routes])
    assert sorted(seen.tolist()) == list(range(16)), "four decode calls of 4 experts read all 16 once"


def test_run_config_checks_the_output_and_times_every_implementation():
    for mode, bits, gs in (("affine", 4, 64), ("mxfp4", 4, 32)):
        cfg = moe.MoeConfig("tiny", "w", experts=8, top_k=2, n=128, k=256, tokens=3, mode=mode, bits=bits,
                            group_size=gs)
        r = moe.run_config(cfg, repeats=1)
        assert r["check_worst_ratio"] <= 1.0
        gguf = {"gguf_q4k"} if mode == "affine" else set()  # Q4_K blocks of the affine 4-bit shapes
        assert set(r["median_ms"]) == {"torch_qmm", "loop_qmm", "loop_linear"} | gguf
        assert all(math.isfinite(v) and v > 0 for v in r["median_ms"].values())
