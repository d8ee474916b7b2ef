"""Per-rank memory and step time of a quantized llama (or, with --moe, a Qwen3-MoE model) under
tensor parallelism over gloo on CPU.

    nice -n 10 python3 benchmarks/distributed_tp.py --worlds 1,2,4 \
        --output benchmarks/results/cpu-tp-llama-affine4.json
    nice -n 10 python3 benchmarks/distributed_tp.py --moe --worlds 1,2,4 \
        --output benchmarks/results/cpu-tp-moe.json

--moe: Qwen3MoeForCausalLM with --experts experts of intermediate size --moe-inter, --top-k per
token; its experts quantized (QuantFusedExperts), saved as mlx_lm's switch_mlp tensors and split
by QuantExpertsParallel.

The parent builds a llama (LlamaForCausalLM, random weights), quantizes it (torch_qmm.quantize_model,
the embedding as QuantEmbedding) and saves it as an MLX folder. For each world size, that many
processes load it with torch_qmm.distributed.load_mlx_sharded (each reading only its slices) and
parallelize it with tp_plan, then time forward steps (a 1-token step and a prompt, no KV cache).
Per rank: peak RSS while loading (VmHWM reset before the load, minus the RSS before it), RSS
after, the bytes of the model's tensors it holds and the bytes it read; per step: the median of
the slowest rank's time over the repeats (ranks start each repeat together). A last row loads
the same folder with torch_qmm.interop.load_mlx in one process (the float model built first), for
comparison. The machine's load average goes into the JSON: on a shared machine step times are
set by the scheduler.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def model_class(args):
    import transformers

    return transformers.Qwen3MoeForCausalLM if args.moe else transformers.LlamaForCausalLM


def config_of(args):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if args.moe:
        return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, moe_intermediate_size=args.moe_inter,
                              intermediate_size=args.inter, num_experts=args.experts, num_experts_per_tok=args.top_k,
                              num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.heads, head_dim=args.hidden // args.heads,
                              tie_word_embeddings=False, max_position_embeddings=4096, norm_topk_prob=True)
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       head_dim=args.hidden // args.heads, tie_word_embeddings=False, max_position_embeddings=4096)


def save_model(args, folder: str) -> dict:
    import torch_qmm
    from torch_qmm.interop import QuantEmbedding, save_mlx
    torch.manual_seed(0)
    model = model_class(args)(config_of(args)).eval()
    params = sum(p.numel() for p in model.parameters())
    torch_qmm.quantize_model(model, bits=args.bits, group_size=args.group_size, mode=args.mode)
    model.model.embed_tokens = QuantEmbedding.from_embedding(model.model.embed_tokens, bits=args.bits,
                                                             group_size=args.group_size, mode=args.mode)
    save_mlx(model, folder)
    return {"float_params": params,
            "file_bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))}


def _time_steps(model, ids, repeats: int, distributed: bool) -> float:
    times = []
    with torch.no_grad():
        model(ids, use_cache=False)  # warm-up
        for _ in range(repeats):
            if distributed:
                dist.barrier()
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            if distributed:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times.append(dt.item())
    return statistics.median(times) * 1e3


def _held_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def rank_main(rank: int, world: int, store: str, folder: str, args, out: str) -> None:
    torch.set_num_threads(args.threads)
    LlamaForCausalLM = model_class(args)  # noqa: N806  (the model class of the run)

    config = config_of(args)
    ids_step = torch.randint(0, args.vocab, (1, 1), generator=torch.Generator().manual_seed(1))
    ids_prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    if world == 0:  # the one-process reference: load_mlx into a float model
        from torch_qmm.interop import load_mlx

        rss_before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        model = LlamaForCausalLM(config).eval()
        report = load_mlx(model, folder)
        load_s = time.perf_counter() - t0
        bytes_read, distributed = report.bytes_read, False
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan

        mesh = init_device_mesh("cpu", (world,))
        rss_before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        with empty_parameters():
            model = LlamaForCausalLM(config).eval()
        report = load_mlx_sharded(model, folder, mesh, tp_plan(model))
        load_s = time.perf_counter() - t0
        bytes_read, distributed = report.bytes_read, True
    peak = _status("VmHWM")
    row = {
        "rank": rank, "load_s": load_s, "rss_before_load_mib": rss_before / 2**20,
        "load_peak_rss_delta_mib": (peak - rss_before) / 2**20, "rss_after_load_mib": _status("VmRSS") / 2**20,
        "held_tensor_mib": _held_bytes(model) / 2**20, "read_mib": bytes_read / 2**20,
        "step_1_token_ms": _time_steps(model, ids_step, args.repeats, distributed),
        f"step_{args.prompt}_tokens_ms": _time_steps(model, ids_prompt, args.repeats, distributed),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    if distributed:
        dist.destroy_process_group()


def run_world(world: int, folder: str, args) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix=f"tp{world}-")
    nprocs = max(world, 1)
    mp.start_processes(rank_main, args=(world, os.path.join(tmp, "store"), folder, args, tmp), nprocs=nprocs,
                       start_method="spawn")
    return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(nprocs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--mode", default="affine")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model instead of a llama")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--moe-inter", type=int, default=512, help="each expert's intermediate size (--moe)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--output", default=None,
                   help="default benchmarks/results/cpu-tp-llama-affine4.json (cpu-tp-moe.json with --moe)")
    args = p.parse_args()
    if args.output is None:
        name = "cpu-tp-moe.json" if args.moe else "cpu-tp-llama-affine4.json"
        args.output = os.path.join(ROOT, "benchmarks", "results", name)
    load_at_start = os.getloadavg()
    folder = tempfile.mkdtemp(prefix="tp-mlx-")
    model_info = save_model(args, folder)
    runs = []
    for world in [int(w) for w in args.worlds.split(",")] + [0]:
        ranks = run_world(world, folder, args)
        runs.append({"world_size": world if world else 1,
                     "loader": "load_mlx_sharded" if world else "load_mlx (float model built first)", "ranks": ranks})
        print(json.dumps(runs[-1]), flush=True)
    result = {
        "benchmark": f"tensor-parallel {'Qwen3-MoE' if args.moe else 'llama'} over gloo (CPU)",
        "command": " ".join(sys.argv),
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "model": model_info,
        "load_average_at_start": load_at_start,
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(args.output)


if __name__ == "__main__":
    main()
