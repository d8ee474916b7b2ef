"""What each rank of tests/test_distributed.py runs (in spawned processes: one gloo group per world
size). Every check returns a dict of facts that the test functions assert on; a check that raises
is reported as its error. References are float64 (torch_qmm/reference.py, reference_fp.py) or the
same model run in one process."""

from __future__ import annotations

import copy
import datetime
import importlib
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from torch_qmm import reference, reference_fp, tolerance
from torch_qmm.formats import FORMATS
from torch_qmm.nn import QuantLinear

TIMEOUT = datetime.timedelta(seconds=90)
# A hang (a rank stuck in a collective) fails the test instead of blocking CI.
SPAWN_TIMEOUT_S = 600


def spawn(world: int, tmp: str, module: str = "distributed_checks") -> list[dict]:
    """Runs every check of `module` (its CHECKS) on `world` gloo ranks; each rank's report."""
    import torch.multiprocessing as mp

    names = list(importlib.import_module(module).CHECKS)
    ctx = mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), tmp, names, module), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:  # only the processes started here
            if p.is_alive():
                p.terminate()
    return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def layer_reference(layer: QuantLinear, x: torch.Tensor, transpose: bool = True):
    """float64 (x @ W.T or x @ W, |x| @ |W|-style magnitude) of a full QuantLinear's weight."""
    wq, s, b = layer.qweight, layer.scales, layer.biases
    if layer.mode == "affine":
        return (reference.qmm(x, wq, s, b, layer.bits, layer.group_size, transpose),
                reference.qmm_magnitude(x, wq, s, b, layer.bits, layer.group_size, transpose))
    return (reference_fp.qmm_fp(x, wq, s, layer.mode, layer.group_size, layer.bits, transpose),
            reference_fp.qmm_fp_magnitude(x, wq, s, layer.mode, layer.group_size, layer.bits, transpose))


def quant_linear(k: int, n: int, mode: str, dtype: torch.dtype, bias: bool, seed: int) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g))
    gs = 32 if mode == "affine" else None
    return QuantLinear.from_linear(linear, bits=None, group_size=gs, dtype=dtype, mode=mode)


def gather(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def worst(y, y_ref, bound) -> float:
    err = (gather(y).detach().to(torch.float64) - y_ref).abs()
    return (err / bound).max().item()


def check_layers(rank: int, world: int, mesh) -> dict:
    """Each mode: one QuantLinear colwise and one rowwise (with bias), output and dx against float64."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize

    out = {}
    cases = [(m, torch.float32) for m in FORMATS] + [("affine", torch.bfloat16), ("mxfp4", torch.float16)]
    for mode, dtype in cases:
        k, n = 4 * 32 * world // 2, 16 * world  # K: whole groups per rank for every mode
        for style_name, style in (("colwise", QuantColwiseParallel), ("rowwise", QuantRowwiseParallel)):
            layer = quant_linear(k, n, mode, dtype, bias=True, seed=k + n)
            full = copy.deepcopy(layer)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(3, k, generator=g).to(dtype)
            dy = torch.randn(3, n, generator=g).to(dtype)
            tp = parallelize(nn.Sequential(layer), mesh, {"0": style(use_local_output=False)})[0]
            float_linear = nn.Linear(k, n, dtype=dtype)
            with torch.no_grad():
                float_linear.weight.copy_((full(torch.eye(k, dtype=dtype)) - full.bias).T)  # W = layer(I) - bias
                float_linear.bias.copy_(full.bias)
            torch_style = ColwiseParallel if style_name == "colwise" else RowwiseParallel
            theirs = parallelize_module(nn.Sequential(float_linear), mesh, {"0": torch_style(use_local_output=False)})[0]
            xs = x.clone().requires_grad_()
            x_in = xs if style_name == "colwise" else xs.chunk(world, -1)[rank]
            y = tp(x_in)
            y_theirs = theirs(x_in.detach())
            dy_local = dy.chunk(world, -1)[rank] if style_name == "colwise" else dy
            y.to_local().backward(dy_local)
            y_ref, mag = layer_reference(full, x)
            b = full.bias.to(torch.float64)
            roundings = 1 if style_name == "colwise" else 2 * world  # the bias add (+ 2S-1 for the split)
            bound = tolerance.sharded_error_bound(y_ref + b, mag + b.abs(), dtype, roundings)
            dx_ref, dx_mag = layer_reference(full, dy, transpose=False)
            dx_roundings = 2 * world - 1 if style_name == "colwise" else 0  # dx = dy @ W sums over the N split
            dx_bound = tolerance.sharded_error_bound(dx_ref, dx_mag, dtype, dx_roundings)
            dx = xs.grad if style_name == "colwise" else xs.grad.chunk(world, -1)[rank]
            dx_full = dx if style_name == "colwise" else torch.cat(
                [t for t in _all_gather(dx.contiguous(), world)], dim=-1)
            words, groups = full.qweight.shape[1], full.scales.shape[1]
            local = {name: list(getattr(tp, name).to_local().shape) for name in ("qweight", "scales")}
            out[f"{mode}/{dtype}/{style_name}"] = {
                "y_ratio": worst(y, y_ref + b, bound),
                "dx_ratio": worst(dx_full, dx_ref, dx_bound),
                "placement": [str(y.placements), str(y_theirs.placements)],
                "local_shape": [list(y.to_local().shape), list(y_theirs.to_local().shape)],
                "local": local,
                "expected_local": ({"qweight": [n // world, words], "scales": [n // world, groups]}
                                   if style_name == "colwise" else
                                   {"qweight": [n, words // world], "scales": [n, groups // world]}),
                "biases_local": None if tp.biases is None else list(tp.biases.to_local().shape),
                "bias_placement": str(tp.bias.placements[0]),
            }
    return out


def _all_gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return parts


class MLP(nn.Module):
    """A llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, mode: str, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = quant_linear(hidden, inter, mode, dtype, bias=False, seed=1)
        self.up_proj = quant_linear(hidden, inter, mode, dtype, bias=True, seed=2)
        self.down_proj = quant_linear(inter, hidden, mode, dtype, bias=True, seed=3)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def check_mlp(rank: int, world: int, mesh, stage: bool | None = None) -> dict:
    """Two stacked MLPs (colwise, colwise, rowwise each) against the same model in one process."""
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize

    out = {}
    for mode in ("affine", "mxfp4"):
        dtype = torch.float32
        hidden, inter = 64, 64 * world
        model = nn.Sequential(MLP(hidden, inter, mode, dtype), MLP(hidden, inter, mode, dtype))
        single = copy.deepcopy(model)
        plan = {}
        for i in range(2):
            plan[f"{i}.gate_proj"] = QuantColwiseParallel(stage=stage)
            plan[f"{i}.up_proj"] = QuantColwiseParallel(stage=stage)
            plan[f"{i}.down_proj"] = QuantRowwiseParallel(stage=stage)
        tp = parallelize(model, mesh, plan)
        x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(7))
        dy = torch.randn(5, hidden, generator=torch.Generator().manual_seed(8))
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_single = single(x1)
        y_single.backward(dy)
        # the input of the last down_proj, in both runs: the last layer's error is bounded against it
        seen = {}
        hook = lambda name: (lambda m, args, res: seen.__setitem__(name, gather(args[0]).detach()))
        handles = [tp[1].down_proj.register_forward_hook(hook("tp")),
                   single[1].down_proj.register_forward_hook(hook("single"))]
        y_tp = tp(x2)
        y_tp.backward(dy)
        with torch.no_grad():
            single(x)
        for h in handles:
            h.remove()
        layer = single[1].down_proj
        ref_tp, mag_tp = layer_reference(layer, seen["tp"].to(torch.float32))
        b = layer.bias.to(torch.float64)
        bound = tolerance.sharded_error_bound(ref_tp + b, mag_tp + b.abs(), dtype, 2 * world)
        out[mode] = {
            "y_type": type(y_tp).__name__,
            "down_input_max_diff": (seen["tp"] - seen["single"]).abs().max().item(),
            "down_input_scale": seen["single"].abs().max().item(),
            "y_ratio_vs_reference": worst(y_tp, ref_tp + b, bound),
            "y_max_diff": (y_tp - y_single).abs().max().item(),
            "y_scale": y_single.abs().max().item(),
            "dx_max_diff": (x2.grad - x1.grad).abs().max().item(),
            "dx_scale": x1.grad.abs().max().item(),
            "local_bytes": sum(t.to_local().numel() * t.element_size() for m in tp.modules() if isinstance(m, QuantLinear)
                               for t in (m.qweight, m.scales)),
            "full_bytes": sum(t.numel() * t.element_size() for m in single.modules() if isinstance(m, QuantLinear)
                              for t in (m.qweight, m.scales)),
        }
        out[mode]["y"] = y_tp.tolist()
        out[mode]["dx"] = x2.grad.tolist()
    return out


def check_sequence_parallel(rank: int, world: int, mesh) -> dict:
    """A norm under PyTorch's SequenceParallel before a llama MLP: colwise layers take the sequence
    shards (input_layouts=Shard(1)), the rowwise layer reduce-scatters back to them."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize

    hidden, inter, seq = 64, 64 * world, 2 * world
    model = nn.Sequential(nn.RMSNorm(hidden), MLP(hidden, inter, "affine", torch.float32))
    single = copy.deepcopy(model)
    tp = parallelize(model, mesh, {
        "0": SequenceParallel(),
        "1.gate_proj": QuantColwiseParallel(input_layouts=Shard(1)),
        "1.up_proj": QuantColwiseParallel(input_layouts=Shard(1)),
        "1.down_proj": QuantRowwiseParallel(output_layouts=Shard(1)),
    })
    x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(11))
    want = single(x).chunk(world, 1)[rank]
    got = tp(x.chunk(world, 1)[rank])
    return {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "shape": [list(got.shape), list(want.shape)]}


def check_refusals(rank: int, world: int, mesh) -> dict:
    from torch_qmm.distributed import QuantRowwiseParallel, QuantColwiseParallel, parallelize
    from torch_qmm.interop.modules import QuantEmbedding, TiedQuantLinear

    out = {}
    k = world * 32 + 32  # whole groups, but not a whole number of them per rank
    model = nn.Sequential()
    model.add_module("down_proj", quant_linear(k, 8, "affine", torch.float32, bias=False, seed=0))
    try:
        parallelize(model, mesh, {"down_proj": QuantRowwiseParallel()})
        out["rowwise"] = None
    except ValueError as e:
        out["rowwise"] = str(e)
    emb = QuantEmbedding(16, 64, group_size=32 if world == 4 else 64)
    try:
        parallelize(nn.ModuleDict({"embed": emb}), mesh, {"embed": QuantColwiseParallel()})
        out["embedding_colwise"] = None if world * emb.group_size <= 64 else "accepted"
    except ValueError as e:
        out["embedding_colwise"] = str(e)
    tied_model = nn.ModuleDict({"emb": QuantEmbedding(16, 128, group_size=32)})
    tied_model["head"] = TiedQuantLinear(tied_model["emb"])
    try:
        parallelize(tied_model, mesh, {"head": QuantColwiseParallel()})
        out["tied"] = None
    except NotImplementedError as e:
        out["tied"] = str(e)
    return out


def check_embedding(rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize
    from torch_qmm.interop.modules import QuantEmbedding

    out = {}
    for mode in ("affine", "nvfp4"):
        table = torch.randn(8 * world, 32 * world, generator=torch.Generator().manual_seed(3))
        emb = QuantEmbedding.from_embedding(nn.Embedding.from_pretrained(table), group_size=None if mode != "affine" else 32,
                                            mode=mode)
        ids = torch.randint(0, 8 * world, (2, 5), generator=torch.Generator().manual_seed(4))
        want = emb(ids)
        float_emb = nn.Embedding.from_pretrained(emb(torch.arange(8 * world)))  # the dequantized table
        styles = (("colwise", QuantColwiseParallel, ColwiseParallel, {}),
                  ("rowwise", QuantRowwiseParallel, RowwiseParallel, {"input_layouts": Replicate()}))
        for name, style, torch_style, kwargs in styles:
            for layout in (Replicate(), None):  # None: the style's default (colwise Shard(-1), rowwise Replicate)
                kw = dict(kwargs, output_layouts=layout, use_local_output=False)
                tp = parallelize(nn.ModuleDict({"e": copy.deepcopy(emb)}), mesh, {"e": style(**kw)})
                theirs = parallelize_module(nn.ModuleDict({"e": copy.deepcopy(float_emb)}), mesh, {"e": torch_style(**kw)})
                got, want_tp = tp["e"](ids), theirs["e"](ids)
                out[f"{mode}/{name}/{layout}"] = {
                    "equal": bool(torch.equal(got.full_tensor(), want)),
                    "equal_torch": bool(torch.equal(got.to_local(), want_tp.to_local())),
                    "placements": [str(got.placements), str(want_tp.placements)],
                    "local": list(tp["e"].qweight.to_local().shape), "full": list(emb.qweight.shape)}
    return out


def check_embedding_ids(rank: int, world: int, mesh) -> dict:
    """A row-split QuantEmbedding given ids outside [0, num_embeddings): the error of the whole
    embedding, before any rank looks up its rows (the ids are checked against the whole table,
    not against a rank's rows, where num_embeddings itself falls outside every rank's)."""
    from torch.distributed.tensor import Replicate
    from torch_qmm.distributed import QuantRowwiseParallel, parallelize
    from torch_qmm.interop.modules import QuantEmbedding

    num = 8 * world
    table = torch.randn(num, 64, generator=torch.Generator().manual_seed(7))
    emb = QuantEmbedding.from_embedding(nn.Embedding.from_pretrained(table), group_size=32)
    tp = parallelize(nn.ModuleDict({"e": copy.deepcopy(emb)}), mesh,
                     {"e": QuantRowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
    out = {"num_embeddings": num}
    for bad in (num, num + 3, -1):
        ids = torch.tensor([[0, bad, num - 1]])
        errors = []
        for layer in (tp["e"], emb):
            try:
                layer(ids)
                errors.append(None)
            except IndexError as e:
                errors.append(str(e))
        out[str(bad)] = {"sharded": errors[0], "whole": errors[1]}
    return out


def tiny_llama(world: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64 * world, hidden_size=128, intermediate_size=64 * world * 2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                         tie_word_embeddings=False, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def check_llama(rank: int, world: int, mesh) -> dict:
    import torch_qmm
    from torch_qmm.distributed import parallelize, tp_plan

    model = tiny_llama(world)
    torch_qmm.quantize_model(model, bits=4, group_size=32)
    single = copy.deepcopy(model)
    tp = parallelize(model, mesh, tp_plan(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    embeds = single.model.embed_tokens(ids).detach()
    e1, e2 = embeds.clone().requires_grad_(), embeds.clone().requires_grad_()
    logits_single = single(inputs_embeds=e1).logits
    logits_tp = tp(inputs_embeds=e2).logits
    dy = torch.randn(logits_single.shape, generator=torch.Generator().manual_seed(6))
    logits_single.backward(dy)
    logits_tp.backward(dy)
    q = tp.model.layers[0].self_attn.q_proj
    o = tp.model.layers[0].self_attn.o_proj
    return {
        "quantized": sum(isinstance(m, QuantLinear) for m in tp.modules()),
        "logits_max_diff": (logits_tp - logits_single).abs().max().item(),
        "logits_scale": logits_single.abs().max().item(),
        "argmax_equal": bool(torch.equal(logits_tp.argmax(-1), logits_single.argmax(-1))),
        "dx_max_diff": (e2.grad - e1.grad).abs().max().item(),
        "dx_scale": e1.grad.abs().max().item(),
        "q_local": list(q.qweight.to_local().shape), "q_full": list(q.qweight.shape),
        "o_local": list(o.qweight.to_local().shape), "o_full": list(o.qweight.shape),
        "ids_logits_max_diff": (tp(ids).logits - single(ids).logits).abs().max().item(),
        "generate_equal": bool(torch.equal(  # greedy, through the KV cache
            tp.generate(ids[:1, :5], max_new_tokens=6, do_sample=False),
            single.generate(ids[:1, :5], max_new_tokens=6, do_sample=False))),
    }


def check_tied_quant_embedding(rank: int, world: int, mesh) -> dict:
    """A model whose output layer is tied to a QuantEmbedding's table (TiedQuantLinear, as
    load_gguf_llama and load_mlx build a tied model): tp_plan leaves both replicated and the rest
    split; a plan that splits the embedding alone is refused before any split, naming both."""
    import torch_qmm
    from torch.distributed.tensor import Replicate
    from torch_qmm.distributed import QuantRowwiseParallel, parallelize, tp_plan
    from torch_qmm.interop.modules import QuantEmbedding, TiedQuantLinear

    model = tiny_llama(world)
    model.config.tie_word_embeddings = True
    torch_qmm.quantize_model(model, bits=4, group_size=32)
    table = model.model.embed_tokens.weight.detach()
    emb = QuantEmbedding(table.shape[0], table.shape[1], 4, 32)
    emb.qweight.copy_(torch_qmm.quantize(table, group_size=32, bits=4)[0])
    emb.scales.copy_(torch_qmm.quantize(table, group_size=32, bits=4)[1])
    emb.biases.copy_(torch_qmm.quantize(table, group_size=32, bits=4)[2])
    model.model.embed_tokens = emb
    model.lm_head = TiedQuantLinear(emb)
    single = copy.deepcopy(model)
    plan = tp_plan(model)
    out = {"head_in_plan": "lm_head" in plan, "embedding_in_plan": "model.embed_tokens" in plan,
           "layers_in_plan": sum(k.startswith("model.layers.") for k in plan)}
    try:
        parallelize(copy.deepcopy(model), mesh, {**plan, "model.embed_tokens": QuantRowwiseParallel(
            input_layouts=Replicate())})
        out["refused"] = None
    except NotImplementedError as e:
        out["refused"] = str(e)
    tp = parallelize(model, mesh, plan)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = tp(ids).logits, single(ids).logits
    out.update(max_diff=(got - want).abs().max().item(), scale=want.abs().max().item(),
               q_local=list(tp.model.layers[0].self_attn.q_proj.qweight.to_local().shape))
    return out


def check_load_pretrained(rank: int, world: int, mesh) -> dict:
    """transformers' save_pretrained of a torch_qmm-quantized tiny llama (its linear layers; or
    also its embedding, tied to the head), loaded into each rank's slices, against from_pretrained
    of the same folder in one process."""
    from transformers import LlamaForCausalLM
    from torch.distributed.tensor import DTensor
    from torch_qmm.distributed import empty_parameters, load_pretrained_sharded, tp_plan
    from torch_qmm.interop.modules import QuantEmbedding, TiedQuantLinear
    from torch_qmm.interop.transformers import TorchQmmConfig

    out = {}
    for case, embeddings in (("linears", None), ("tied-embedding", ["model.embed_tokens"])):
        folder = os.path.join(SCRATCH, f"hf-llama-{case}")
        if rank == 0:
            float_model = tiny_llama(world)
            float_model.config.tie_word_embeddings = embeddings is not None
            float_model.tie_weights()
            float_model.save_pretrained(folder + "-float")
            LlamaForCausalLM.from_pretrained(folder + "-float", quantization_config=TorchQmmConfig(
                bits=4, group_size=32, embeddings=embeddings)).save_pretrained(folder)
        dist.barrier()
        single = LlamaForCausalLM.from_pretrained(folder).eval()
        with empty_parameters():
            model = LlamaForCausalLM(single.config).eval()
        report = load_pretrained_sharded(model, folder, mesh, tp_plan(model))
        ids = torch.randint(0, single.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            want, got = single(ids).logits, model(ids).logits
        replicated = sum(t.numel() * t.element_size() for k, t in model.state_dict().items()
                         if not isinstance(t, DTensor) and not k.endswith("_extra_state"))
        out[case] = {
            "max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "quantized": len(report.quantized), "bytes_read": report.bytes_read, "bytes_total": report.bytes_total,
            "replicated_bytes": replicated,
            "single_quantized": sum(isinstance(m, (QuantLinear, QuantEmbedding, TiedQuantLinear))
                                    for m in single.modules()),
            "embedding": type(model.model.embed_tokens).__name__, "head": type(model.lm_head).__name__}
    return out


def check_load_mlx_other_folders(rank: int, world: int, mesh) -> str | None:
    """Rank 0 given a folder of group size 32, the others one of group size 64 (of the same
    model): every rank refuses the load, naming the folders, instead of computing wrong numbers."""
    import torch_qmm
    from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan
    from torch_qmm.interop import save_mlx

    folders = [os.path.join(SCRATCH, f"mlx-llama-gs{gs}") for gs in (32, 64)]
    if rank == 0:
        for folder, gs in zip(folders, (32, 64)):
            model = tiny_llama(world)
            torch_qmm.quantize_model(model, bits=4, group_size=gs)
            save_mlx(model, folder, config=model.config.to_dict())
    dist.barrier()
    with empty_parameters():
        model = tiny_llama(world)
    try:
        load_mlx_sharded(model, folders[0] if rank == 0 else folders[1], mesh, tp_plan(model))
    except ValueError as e:
        return str(e)
    return None


def check_gguf(rank: int, world: int, mesh) -> dict:
    """GGUFLinear (Q4_K, Q6_K, and the lattice IQ2_XXS, IQ1_M blocks) colwise and rowwise against
    gguf.quants.dequantize in float64."""
    import numpy as np
    from gguf import quants
    from gguf_helpers import IQ1_M, IQ2_XXS, Q4_K, Q6_K, random_k_blocks
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize
    from torch_qmm.interop.modules import GGUFLinear

    out = {}
    n, k = 4 * world, 256 * world
    for ggml_type in (Q4_K, Q6_K, IQ2_XXS, IQ1_M):
        blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(0))
        w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
        layer = GGUFLinear(k, n, int(ggml_type), bias=True)
        with torch.no_grad():
            layer.blocks.copy_(torch.from_numpy(blocks))
            layer.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(2)))
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
        b = layer.bias.double()
        for name, style in (("colwise", QuantColwiseParallel), ("rowwise", QuantRowwiseParallel)):
            tp = parallelize(nn.Sequential(copy.deepcopy(layer)), mesh, {"0": style(output_layouts=
                                                                                  torch.distributed.tensor.Replicate())})
            y = tp(x if name == "colwise" else x.chunk(world, -1)[rank])
            mag = x.double().abs() @ w.abs().T + b.abs()
            roundings = 1 if name == "colwise" else 2 * world
            bound = tolerance.sharded_error_bound(x.double() @ w.T + b, mag, torch.float32, roundings)
            out[f"{ggml_type.name}/{name}"] = {"ratio": worst(y, x.double() @ w.T + b, bound),
                                               "local": list(tp[0].blocks.to_local().shape),
                                               "full": list(layer.blocks.shape)}
    return out


def check_load_mlx(rank: int, world: int, mesh) -> dict:
    """An MLX folder (save_mlx of a quantized tiny llama) loaded into each rank's slices, against
    load_mlx of the same folder in one process."""
    import torch_qmm
    from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan
    from torch_qmm.interop import load_mlx, save_mlx

    folder = os.path.join(SCRATCH, "mlx-llama")
    if rank == 0:
        model = tiny_llama(world)
        torch_qmm.quantize_model(model, bits=4, group_size=32)
        model.model.embed_tokens = torch_qmm.interop.QuantEmbedding.from_embedding(model.model.embed_tokens,
                                                                                   group_size=32)
        save_mlx(model, folder)
    dist.barrier()
    config = tiny_llama(world).config
    from transformers import LlamaForCausalLM

    single = LlamaForCausalLM(config).eval()
    load_mlx(single, folder)
    with empty_parameters():
        model = LlamaForCausalLM(config).eval()
    report = load_mlx_sharded(model, folder, mesh, tp_plan(model))
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want, got = single(ids).logits, model(ids).logits
    from torch.distributed.tensor import DTensor
    replicated = sum(t.numel() * t.element_size() for k, t in model.state_dict().items()
                     if not isinstance(t, DTensor) and not k.endswith("_extra_state"))
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    # built wholly on meta (buffers too): the rotary frequencies are computed after the load
    with torch.device("meta"):
        meta_built = LlamaForCausalLM(config).eval()
    load_mlx_sharded(meta_built, folder, mesh, tp_plan(meta_built))
    with torch.no_grad():
        meta_built_equal = torch.equal(meta_built(ids).logits, got)
    return {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "meta_built_equal": meta_built_equal,
            "bytes_read": report.bytes_read, "bytes_total": report.bytes_total, "quantized": len(report.quantized),
            "replicated_bytes": replicated, "meta_left": meta,
            "embed_local": list(model.model.embed_tokens.qweight.to_local().shape),
            "embed_full": list(model.model.embed_tokens.qweight.shape)}


def check_load_mlx_tied(rank: int, world: int, mesh) -> dict:
    """MLX folders of a llama whose output layer is tied to the embedding (stored once, as the
    embedding; Llama-3.2-1B and SmolLM2 are such models), the embedding quantized (a tied
    QuantLinear head) or float, loaded into each rank's slices, against mlx_lm's logits of the
    same folder."""
    from pathlib import Path

    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    import torch_qmm
    from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan
    from torch_qmm.interop import QuantEmbedding, TiedQuantLinear, save_mlx
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64 * world, hidden_size=128, intermediate_size=64 * world * 2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                         tie_word_embeddings=True, max_position_embeddings=64)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
    out = {}
    for embedding in ("quantized", "float"):
        folder = os.path.join(SCRATCH, f"mlx-llama-tied-{embedding}")
        if rank == 0:
            torch.manual_seed(0)
            source = LlamaForCausalLM(copy.deepcopy(config)).eval()  # quantize_model records its format in the config
            torch_qmm.quantize_model(source, bits=4, group_size=32)  # the tied head stays float, tied
            if embedding == "quantized":
                source.model.embed_tokens = QuantEmbedding.from_embedding(source.model.embed_tokens, group_size=32)
                source.lm_head = TiedQuantLinear(source.model.embed_tokens)
            save_mlx(source, folder)
        dist.barrier()
        peer, _ = load_model(Path(folder))
        want = torch.from_numpy(np.array(peer(mx.array(ids.numpy())).astype(mx.float32)))
        with empty_parameters():
            model = LlamaForCausalLM(copy.deepcopy(config)).eval()
        load_mlx_sharded(model, folder, mesh, tp_plan(model))
        with torch.no_grad():
            got = model(ids).logits
        out[embedding] = {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                          "head": type(model.lm_head).__name__,
                          "head_local": list((model.lm_head.qweight if embedding == "quantized"
                                              else model.lm_head.weight).to_local().shape)}
    # transformers' save_pretrained of the tied model quantized by TorchQmmConfig (the head float and
    # tied, stored once as the embedding), against transformers' from_pretrained in one process.
    from torch_qmm.distributed import load_pretrained_sharded
    from torch_qmm.interop.transformers import TorchQmmConfig

    folder = os.path.join(SCRATCH, "hf-llama-tied")
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(copy.deepcopy(config)).eval().save_pretrained(folder + "-float")
        LlamaForCausalLM.from_pretrained(folder + "-float", quantization_config=TorchQmmConfig(
            bits=4, group_size=32)).save_pretrained(folder)
    dist.barrier()
    single = LlamaForCausalLM.from_pretrained(folder).eval()
    with empty_parameters():
        model = LlamaForCausalLM(copy.deepcopy(config)).eval()
    load_pretrained_sharded(model, folder, mesh, tp_plan(model))
    with torch.no_grad():
        want, got = single(ids).logits, model(ids).logits
    out["pretrained"] = {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                         "head": type(model.lm_head).__name__,
                         "head_local": list(model.lm_head.weight.to_local().shape)}
    return out


CHECKS = {
    "layers": check_layers,
    "mlp": check_mlp,
    "mlp_staged": lambda r, w, m: check_mlp(r, w, m, stage=True),
    "refusals": check_refusals,
    "sequence_parallel": check_sequence_parallel,
    "embedding": check_embedding,
    "embedding_ids": check_embedding_ids,
    "llama": check_llama,
    "load_mlx": check_load_mlx,
    "load_mlx_tied": check_load_mlx_tied,
    "gguf": check_gguf,
    "load_pretrained": check_load_pretrained,
    "tied_quant_embedding": check_tied_quant_embedding,
    "load_mlx_other_folders": check_load_mlx_other_folders,
}
SCRATCH = ""  # a folder all ranks share (the worker's out_dir)


def worker(rank: int, world: int, store: str, out_dir: str, names: list[str],
           module: str = "distributed_checks") -> None:
    global SCRATCH
    SCRATCH = out_dir
    checks = importlib.import_module(module)
    checks.SCRATCH = out_dir
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    try:
        for name in names:
            try:
                results[name] = {"ok": True, "value": checks.CHECKS[name](rank, world, mesh)}
            except Exception:
                results[name] = {"ok": False, "error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
