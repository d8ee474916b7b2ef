"""What each rank of tests/test_distributed_moe.py runs: quantized MoE experts under tensor
parallelism (QuantExpertsParallel, QuantSwitchLinear in the colwise / rowwise styles), in spawned
gloo processes (distributed_checks.worker). Each check returns facts the tests assert on.
References: float64 dequantizations of the layers' own packed weights (torch_qmm/reference.py,
reference_fp.py) and the same model in one process."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import moe_helpers
from torch_qmm import reference, reference_fp, tolerance

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe")
_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
SCRATCH = ""  # a folder all ranks share (set by the worker)


def tiny_moe(family: str, inter: int, world: int):
    """moe_helpers' tiny model of `family` (its initialisation) sized for `world` ranks: hidden
    size and attention width 32 * world (o_proj's input in whole groups of 32 on every rank; OLMoE's
    q_norm spans the hidden size), 4 key/value heads (whole heads on every rank), intermediate
    size `inter`."""
    config_cls, model_cls, fields = moe_helpers.FAMILIES[family]
    fields = {k: inter if k in _SIZES else v for k, v in fields.items()}
    saved = moe_helpers.FAMILIES[family], dict(moe_helpers._ATTN), moe_helpers.HIDDEN
    moe_helpers.FAMILIES[family] = (config_cls, model_cls, fields)
    moe_helpers._ATTN.update(num_key_value_heads=4, head_dim=8 * world)
    moe_helpers.HIDDEN = 32 * world
    try:
        return moe_helpers.tiny_moe(family)
    finally:
        moe_helpers.FAMILIES[family], moe_helpers._ATTN, moe_helpers.HIDDEN = saved


def quantized_moe(family: str, world: int, mode: str = "affine", inter: int | None = None):
    from torch_qmm.convert import quantize_model

    model = tiny_moe(family, inter or 32 * world, world)
    quantize_model(model, group_size=32 if mode == "affine" else None, mode=mode)
    return model


def dequantized(layer) -> torch.Tensor:
    """float64 W [E, out, in] of a full QuantSwitchLinear."""
    ws = []
    for e in range(layer.num_experts):
        if layer.mode == "affine":
            ws.append(reference.dequantize(layer.qweight[e], layer.scales[e], layer.biases[e], layer.bits,
                                           layer.group_size))
        else:
            ws.append(reference_fp.dequantize_fp(layer.qweight[e], layer.scales[e], layer.mode, layer.group_size,
                                                 layer.bits, dtype=torch.float64))
    return torch.stack(ws).to(torch.float64)


def my_gate_up_rows(full: torch.Tensor, interleaved: bool, rank: int, world: int) -> torch.Tensor:
    """The rows of a full gate_up tensor [E, 2I, ...] rank must hold: gate rows then up rows, each
    its n = I/S intermediate features; with alternating rows, rows [2 r n, 2 (r + 1) n)."""
    n = full.shape[1] // 2 // world
    if interleaved:
        return full[:, 2 * rank * n:2 * (rank + 1) * n]
    inter = full.shape[1] // 2
    return torch.cat((full[:, rank * n:(rank + 1) * n], full[:, inter + rank * n:inter + (rank + 1) * n]), 1)


def holds_my_rows(sharded, whole, rank: int, world: int) -> bool:
    """Every tensor of a sharded experts module's gate_up_proj is rank's rows of the whole module's
    (gloo gathers no uint32, so each rank compares its own part)."""
    layer, full = sharded.gate_up_proj, whole.gate_up_proj
    return all(torch.equal(getattr(layer, n).to_local(), my_gate_up_rows(getattr(full, n), whole.interleaved, rank,
                                                                          world))
               for n in ("qweight", "scales", "biases", "bias") if getattr(full, n) is not None)


def packed_bytes(model, full: bool) -> int:
    from torch_qmm.nn_moe import QuantSwitchLinear

    def size(t):
        t = t if full or not hasattr(t, "to_local") else t.to_local()
        return t.numel() * t.element_size()
    return sum(size(t) for m in model.modules() if isinstance(m, QuantSwitchLinear)
               for t in (m.qweight, m.scales, m.biases) if t is not None)


def parameter_grads(tp, single) -> dict:
    """Each float parameter's gradient in the parallelized model (gathered when it is split)
    against the one-process model's: {name: [max |difference|, max |single's|]}. A parameter kept
    whole on every rank that sees only its rank's heads (Qwen3's q_norm / k_norm under
    ReplicatedGradAllReduce) has its gradient summed over the ranks."""
    from torch.distributed.tensor import DTensor

    theirs = dict(single.named_parameters())
    out = {}
    for name, p in tp.named_parameters():
        if p.grad is None and theirs[name].grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = theirs[name].grad
        out[name] = [(g - want).abs().max().item(), want.abs().max().item()]
    return out


def check_models(rank: int, world: int, mesh) -> dict:
    """Each family quantized, parallelized by tp_plan, against the same model in one process:
    logits, and gradients w.r.t. the input embeddings and the float parameters."""
    from torch_qmm.distributed import parallelize, tp_plan

    out = {}
    for family, mode in [(f, "affine") for f in FAMILIES] + [("gpt_oss", "mxfp4")]:
        model = quantized_moe(family, world, mode)
        single = copy.deepcopy(model)
        full_bytes = packed_bytes(model, full=True)
        tp = parallelize(model, mesh, tp_plan(model))
        ids = torch.randint(0, moe_helpers.VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
        embeds = single.model.embed_tokens(ids).detach()
        e1, e2 = embeds.clone().requires_grad_(), embeds.clone().requires_grad_()
        logits_single, logits_tp = single(inputs_embeds=e1).logits, tp(inputs_embeds=e2).logits
        dy = torch.randn(logits_single.shape, generator=torch.Generator().manual_seed(6))
        logits_single.backward(dy)
        logits_tp.backward(dy)
        experts = tp.model.layers[0].mlp.experts
        out[f"{family}/{mode}"] = {
            "grads": parameter_grads(tp, single),
            "logits_max_diff": (logits_tp - logits_single).abs().max().item(),
            "logits_scale": logits_single.abs().max().item(),
            "argmax_equal": bool(torch.equal(logits_tp.argmax(-1), logits_single.argmax(-1))),
            "dx_max_diff": (e2.grad - e1.grad).abs().max().item(), "dx_scale": e1.grad.abs().max().item(),
            "local_bytes": packed_bytes(tp, full=False), "full_bytes": full_bytes,
            "gate_up_local": list(experts.gate_up_proj.qweight.to_local().shape),
            "gate_up_full": list(experts.gate_up_proj.qweight.shape),
            "down_local": list(experts.down_proj.qweight.to_local().shape),
            "down_full": list(experts.down_proj.qweight.shape),
            "gate_up_rows": holds_my_rows(experts, single.model.layers[0].mlp.experts, rank, world),
        }
    return out


def check_block(rank: int, world: int, mesh) -> dict:
    """One experts block with the routing given: its output against float64 of the down
    projection of the block's actual intermediate activations (gathered from the ranks), weighted
    by the routing weights; those activations, and the gradients w.r.t. hidden_states and
    top_k_weights, against the block in one process."""
    from torch_qmm.distributed import QuantExpertsParallel, parallelize

    out = {}
    for family, mode in (("qwen3_moe", "affine"), ("gpt_oss", "affine"), ("gpt_oss", "mxfp4")):
        model = quantized_moe(family, world, mode)
        single = copy.deepcopy(model.model.layers[0].mlp.experts)
        staged = copy.deepcopy(single)
        tp = parallelize(model, mesh, {"model.layers.0.mlp.experts": QuantExpertsParallel()}).model.layers[0].mlp.experts
        g = torch.Generator().manual_seed(7)
        tokens, k = 40, moe_helpers.TOP_K  # 80 (token, expert) pairs: the sorted path of switch()
        x = torch.randn(tokens, model.config.hidden_size, generator=g)
        index = torch.rand(tokens, moe_helpers.EXPERTS, generator=g).argsort(-1)[:, :k]
        weights = torch.rand(tokens, k, generator=g).softmax(-1)
        seen = {}
        tp.down_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("tp", a[0].detach()))
        single.down_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("single", a[0].detach()))
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        w1, w2 = weights.clone().requires_grad_(), weights.clone().requires_grad_()
        y_single, y_tp = single(x1, index, w1), tp(x2, index, w2)
        dy = torch.randn(y_single.shape, generator=g)
        y_single.backward(dy)
        y_tp.backward(dy)
        parts = [torch.empty_like(seen["tp"]) for _ in range(world)]
        dist.all_gather(parts, seen["tp"].contiguous())
        h = torch.cat(parts, -1).to(torch.float64)  # [pairs, 1, I]: the ranks' features in order
        down = single.down_proj
        wd = dequantized(down)
        bd = down.bias.double() if down.bias is not None else torch.zeros(wd.shape[:2], dtype=torch.float64)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the rows of h follow switch()'s sort by expert
        e = flat[order]
        prod = torch.einsum("pi,phi->ph", h[:, 0], wd[e]) + bd[e]
        mag = torch.einsum("pi,phi->ph", h[:, 0].abs(), wd[e].abs()) + bd[e].abs()
        w_pairs = weights.reshape(-1)[order].double().unsqueeze(-1)
        y_ref = torch.zeros(tokens * k, prod.shape[-1], dtype=torch.float64).index_copy_(0, order, w_pairs * prod)
        m_ref = torch.zeros_like(y_ref).index_copy_(0, order, w_pairs.abs() * mag)
        y_ref, m_ref = y_ref.reshape(tokens, k, -1).sum(1), m_ref.reshape(tokens, k, -1).sum(1)
        # Roundings past the down product's own (error_bound): each rank's partial sum, its bias,
        # the routing weight's product and the k-term sum, then S - 1 additions of the all-reduce.
        roundings = 2 * world + k + 1
        bound = tolerance.sharded_error_bound(y_ref, m_ref, torch.float32, roundings)
        # The same block with its collectives staged through CPU (the MPS path): the same numbers.
        staged = parallelize(staged, mesh, QuantExpertsParallel(stage=True))
        x3, w3 = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y_staged = staged(x3, index, w3)
        y_staged.backward(dy)
        out[f"{family}/{mode}"] = {
            "staged_equal": bool(torch.equal(y_staged, y_tp) and torch.equal(x3.grad, x2.grad)
                                 and torch.equal(w3.grad, w2.grad)),
            "y_ratio": ((y_tp.double() - y_ref).abs() / bound).max().item(),
            "h_max_diff": (h - seen["single"].double()).abs().max().item(),
            "h_scale": seen["single"].abs().max().item(),
            "dx_max_diff": (x2.grad - x1.grad).abs().max().item(), "dx_scale": x1.grad.abs().max().item(),
            "dw_max_diff": (w2.grad - w1.grad).abs().max().item(), "dw_scale": w1.grad.abs().max().item(),
        }
    return out


def check_switch_linear(rank: int, world: int, mesh) -> dict:
    """A lone QuantSwitchLinear (mlx_lm's SwitchLinear) colwise and rowwise, output and dx against
    float64 of its dequantized experts."""
    from torch.distributed.tensor import Replicate
    from torch import nn
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, parallelize
    from torch_qmm.nn_moe import QuantSwitchLinear

    g = torch.Generator().manual_seed(3)
    e, n, kdim, tokens, k = 3, 8 * world, 64 * world, 5, 2
    layer = QuantSwitchLinear.from_float(torch.randn(e, n, kdim, generator=g) / kdim**0.5,
                                         torch.randn(e, n, generator=g), group_size=32)
    w, b = dequantized(layer), layer.bias.double()
    x = torch.randn(tokens, 1, 1, kdim, generator=g)
    index = torch.randint(0, e, (tokens, k), generator=g)
    dy = torch.randn(tokens, k, 1, n, generator=g)
    y_ref = torch.einsum("ti,tkoi->tko", x[:, 0, 0].double(), w[index]).unsqueeze(-2) + b[index].unsqueeze(-2)
    y_mag = torch.einsum("ti,tkoi->tko", x[:, 0, 0].double().abs(), w[index].abs()).unsqueeze(-2) + b[index].abs().unsqueeze(-2)
    dx_ref = torch.einsum("tko,tkoi->ti", dy[:, :, 0].double(), w[index])
    dx_mag = torch.einsum("tko,tkoi->ti", dy[:, :, 0].double().abs(), w[index].abs())
    out = {}
    for name, style in (("colwise", QuantColwiseParallel), ("rowwise", QuantRowwiseParallel)):
        tp = parallelize(nn.ModuleDict({"s": copy.deepcopy(layer)}), mesh, {"s": style(output_layouts=Replicate())})
        xi = (x if name == "colwise" else x.chunk(world, -1)[rank]).clone().requires_grad_()
        y = tp["s"](xi, index)
        y.backward(dy)
        dx = xi.grad[:, 0, 0]
        ref_dx = dx_ref if name == "colwise" else dx_ref.chunk(world, -1)[rank]
        ref_mag = dx_mag if name == "colwise" else dx_mag.chunk(world, -1)[rank]
        y_roundings = 1 if name == "colwise" else 2 * world  # a bias; rowwise: partial sums and the all-reduce
        dx_roundings = 2 * world + k if name == "colwise" else k  # the k experts' parts (colwise: over ranks too)
        out[name] = {
            "y_ratio": ((y.double() - y_ref).abs() / tolerance.sharded_error_bound(
                y_ref, y_mag, torch.float32, y_roundings)).max().item(),
            "dx_ratio": ((dx.double() - ref_dx).abs() / tolerance.sharded_error_bound(
                ref_dx, ref_mag, torch.float32, dx_roundings)).max().item(),
            "local": list(tp["s"].qweight.to_local().shape), "full": list(layer.qweight.shape),
            "bias_placement": str(tp["s"].bias.placements[0]),
        }
    return out


def check_refusals(rank: int, world: int, mesh) -> dict:
    from torch import nn
    from torch_qmm.convert import quantize_model
    from torch_qmm.distributed import QuantExpertsParallel, QuantRowwiseParallel, parallelize, tp_plan
    from torch_qmm.interop.modules import GGUFSwitchLinear
    from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

    out = {}
    inter = 32 * world + 32  # whole groups, not a whole number of them per rank
    model = quantized_moe("qwen3_moe", world, inter=inter)
    try:
        parallelize(model, mesh, tp_plan(model))
        out["experts"] = None
    except ValueError as e:
        out["experts"] = str(e)
    float_experts = tiny_moe("qwen3_moe", 32 * world, world)
    quantize_model(float_experts, group_size=32, experts=False)
    try:
        parallelize(float_experts, mesh, tp_plan(float_experts))
        out["float_experts"] = None
    except NotImplementedError as e:
        out["float_experts"] = str(e)
    switch = QuantSwitchLinear.from_float(torch.randn(2, 8, inter), group_size=32)
    try:
        parallelize(nn.ModuleDict({"switch": switch}), mesh, {"switch": QuantRowwiseParallel()})
        out["switch_rowwise"] = None
    except ValueError as e:
        out["switch_rowwise"] = str(e)
    # experts of a GGUF file (Q4_K gate_up, Q6_K down blocks): not split
    gguf = QuantFusedExperts(GGUFSwitchLinear(2, 256, 512, 12), GGUFSwitchLinear(2, 256, 256, 14), nn.Identity())
    try:
        parallelize(nn.ModuleDict({"experts": gguf}), mesh, {"experts": QuantExpertsParallel()})
        out["gguf_experts"] = None
    except NotImplementedError as e:
        out["gguf_experts"] = str(e)
    return out


def check_load_mlx(rank: int, world: int, mesh) -> dict:
    """An MLX folder (save_mlx of a quantized tiny MoE model: mlx_lm's switch_mlp tensors) loaded
    into each rank's slices, against load_mlx of the same folder in one process."""
    from torch.distributed.tensor import DTensor
    from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan
    from torch_qmm.interop import load_mlx, save_mlx
    from torch_qmm.nn_moe import QuantFusedExperts

    out = {}
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        folder = os.path.join(SCRATCH, f"mlx-{family}")
        if rank == 0:
            save_mlx(quantized_moe(family, world), folder)
        dist.barrier()
        config = tiny_moe(family, 32 * world, world).config
        model_cls = moe_helpers.FAMILIES[family][1]
        single = model_cls(config).eval()
        load_mlx(single, folder)
        with empty_parameters():
            model = model_cls(config).eval()
        report = load_mlx_sharded(model, folder, mesh, tp_plan(model))
        ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            want, got = single(ids).logits, model(ids).logits
        replicated = sum(t.numel() * t.element_size() for k, t in model.state_dict().items()
                         if (not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements))
                         and not k.endswith("_extra_state"))
        experts = model.model.layers[0].mlp.experts
        ref = single.model.layers[0].mlp.experts
        out[family] = {
            "max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "bytes_read": report.bytes_read, "bytes_total": report.bytes_total, "replicated_bytes": replicated,
            "experts_quantized": sum(isinstance(m, QuantFusedExperts) for m in model.modules()),
            "meta_left": [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                          if t.device.type == "meta"],
            "gate_up_rows": holds_my_rows(experts, ref, rank, world),
            "down_scales_equal": bool(torch.equal(experts.down_proj.scales.full_tensor(), ref.down_proj.scales)),
            "gate_up_local": list(experts.gate_up_proj.qweight.to_local().shape),
            "gate_up_full": list(experts.gate_up_proj.qweight.shape),
        }
    return out


def check_load_mlx_lm(rank: int, world: int, mesh) -> dict | None:
    """Folders mlx_lm wrote (its own quantize_model: the routers quantized too, Qwen3-MoE's 8-bit;
    Mixtral's block named block_sparse_moe) loaded into each rank's slices, against load_mlx of the
    same folder in one process. The tiny models have 2 KV heads: world 2 only."""
    from pathlib import Path

    from test_moe_mlx_lm import mlx_lm_quantized_folder
    from torch_qmm.distributed import empty_parameters, load_mlx_sharded, tp_plan
    from torch_qmm.interop import load_mlx

    if world != 2:
        return None
    out = {}
    for family in ("mixtral", "qwen3_moe"):
        scratch = Path(SCRATCH) / f"mlx-lm-{family}"
        if rank == 0:
            scratch.mkdir()
            mlx_lm_quantized_folder(family, "affine", scratch)
        dist.barrier()
        folder = scratch / "mlx"
        config = moe_helpers.tiny_moe(family).config
        model_cls = moe_helpers.FAMILIES[family][1]
        single = model_cls(config).eval()
        single_report = load_mlx(single, folder)
        with empty_parameters():
            model = model_cls(config).eval()
        load_mlx_sharded(model, folder, mesh, tp_plan(model))
        ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            want, got = single(ids).logits, model(ids).logits
        out[family] = {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                       "routers_dequantized": len(single_report.dequantized),
                       "router": type(model.get_submodule(single_report.dequantized[0])).__name__}
    return out


def check_load_pretrained_moe(rank: int, world: int, mesh) -> dict:
    """save_pretrained folders of quantized MoE models (the experts stored as QuantFusedExperts
    buffers: gate_up packed, a Mixtral block renamed block_sparse_moe, gpt-oss' rows interleaved)
    loaded into each rank's slices, against from_pretrained of the same folder in one process."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    import torch_qmm.interop.transformers  # noqa: F401  (from_pretrained of a torch_qmm folder)
    from torch_qmm.distributed import empty_parameters, load_pretrained_sharded, tp_plan
    from torch_qmm.interop.transformers import record_quantization_config
    from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

    out = {}
    for family in ("mixtral", "qwen3_moe", "gpt_oss", "qwen3_moe 8-bit down"):
        folder = Path(SCRATCH) / f"pretrained-{family.replace(' ', '-')}"
        if rank == 0:
            q = quantized_moe(family.split()[0], world)
            if family.endswith("down"):  # experts whose projections differ in bits, as convert writes a
                experts = q.model.layers[0].mlp.experts  # GGUF file's Q4_K gate/up beside a Q8_0 down
                experts.down_proj = QuantSwitchLinear.from_float(dequantized(experts.down_proj).float(), bits=8,
                                                                 group_size=32)
                assert record_quantization_config(q) is None
            q.save_pretrained(folder)
        dist.barrier()
        single = AutoModelForCausalLM.from_pretrained(folder).eval()
        with empty_parameters():
            model = moe_helpers.FAMILIES[family.split()[0]][1](tiny_moe(family.split()[0], 32 * world, world).config).eval()
        report = load_pretrained_sharded(model, folder, mesh, tp_plan(model))
        ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            want, got = single(ids).logits, model(ids).logits
        experts = model.model.layers[0].mlp.experts
        out[family] = {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                       "bits": [experts.gate_up_proj.bits, experts.down_proj.bits],
                       "reported": report.quantized.get("model.layers.0.mlp.experts"),
                       "experts_quantized": sum(isinstance(m, QuantFusedExperts) for m in model.modules()),
                       "gate_up_rows": holds_my_rows(experts, single.model.layers[0].mlp.experts, rank, world),
                       "bytes_read": report.bytes_read, "bytes_total": report.bytes_total}
    return out


def check_gguf_gpt_oss(rank: int, world: int, mesh) -> dict | None:
    """A gpt-oss GGUF file (MXFP4 experts with biases, Q8_0 attention; written as llama.cpp's
    converter writes it, tests/test_interop_gguf_gpt_oss.py) loaded by load_gguf_llama and split by
    tp_plan, against the same model in one process. Its 2 KV heads split over 2 ranks only."""
    if world != 2:
        return None
    import numpy as np
    from transformers import AutoModelForCausalLM

    from test_interop_gguf_gpt_oss import MXFP4_MIX, gpt_oss_model, write_gpt_oss_gguf
    from torch_qmm.distributed import parallelize, tp_plan
    from torch_qmm.interop.gguf import GGUFFile
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama

    path = os.path.join(SCRATCH, "gpt-oss.gguf")
    if rank == 0:
        write_gpt_oss_gguf(gpt_oss_model(), path, MXFP4_MIX, np.random.default_rng(11))
    dist.barrier()
    f = GGUFFile(path)
    model = AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = model(ids).logits
    whole = copy.deepcopy(model.model.layers[0].mlp.experts)
    parallelize(model, mesh, tp_plan(model))
    with torch.no_grad():
        got = model(ids).logits
    experts = model.model.layers[0].mlp.experts
    return {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "mode": experts.gate_up_proj.mode, "gate_up_rows": holds_my_rows(experts, whole, rank, world)}


CHECKS = {
    "models": check_models,
    "block": check_block,
    "switch_linear": check_switch_linear,
    "refusals": check_refusals,
    "load_mlx": check_load_mlx,
    "load_mlx_lm": check_load_mlx_lm,
    "load_pretrained_moe": check_load_pretrained_moe,
    "gguf_gpt_oss": check_gguf_gpt_oss,
}
