"""Quantized MoE models of five transformers families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
gpt-oss): quantize_model and TorchQmmConfig quantize the fused experts, keep routers and gates
float, and the model computes what the same float model computes with its quantized weights
replaced by MLX's round trip of them (mx.quantize / mx.dequantize: no torch_qmm code)."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

from moe_helpers import FAMILIES, HIDDEN, INTER, EXPERTS, VOCAB, logits, rtn_reference, tiny_moe
from torch_qmm.convert import quantize_model
from torch_qmm.formats import FORMATS
from torch_qmm.nn import QuantLinear
from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

MODES = list(FORMATS)
GROUP = {"affine": 32}  # the fp modes: their only group size
# Relative to the largest logit. float32: both sides multiply the same float32 weights in float32,
# in different orders, through two layers: measured 1e-6 to 2e-6, bound 1e-4 (~800 ulps); the
# quantization itself moves the logits by 0.1 to 0.7, which the test checks it can see.
# bfloat16 (one experts block): both sides round the projections' outputs to bfloat16, transformers
# also the products with the routing weights and their sum, at other points than ours: a few
# bfloat16 ulps (2**-8 relative) of the largest output, bound 2e-2.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def ids_for(seed: int = 0, n: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def quantized(family: str, mode: str = "affine", dtype=torch.float32, **kw):
    model = tiny_moe(family, dtype=dtype)
    q = copy.deepcopy(model)
    quantize_model(q, group_size=GROUP.get(mode), mode=mode, **kw)
    return model, q


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_moe_matches_mlx_round_trip(family, mode):
    model, q = quantized(family, mode)
    ref = rtn_reference(model, q, transposed_experts=family == "gpt_oss")
    ids = ids_for()
    want = logits(ref, ids)
    err = rel_err(logits(q, ids), want)
    assert err < RTOL[torch.float32], f"{family} {mode}: max |ours - mlx rtn| / max |logit| = {err:.3g}"
    assert rel_err(logits(model, ids), want) > 100 * RTOL[torch.float32]  # the quantization is visible


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_experts_bfloat16(family):
    # One experts module with given routing: in bfloat16 a whole model's routing may flip on a
    # rounding (transformers' own bfloat16 model and its float32 one differ by up to 0.2 of the
    # largest logit on these seeds), so the block is compared with the routing held fixed.
    model, q = quantized(family, "affine", dtype=torch.bfloat16)
    ref = rtn_reference(model, q, transposed_experts=family == "gpt_oss")
    g = torch.Generator().manual_seed(5)
    tokens = 24
    hidden = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    index = torch.rand(tokens, EXPERTS, generator=g).argsort(-1)[:, :2]
    weights = torch.rand(tokens, 2, generator=g).softmax(-1).to(torch.bfloat16)
    with torch.no_grad():
        want = ref.model.layers[0].mlp.experts(hidden, index, weights).float()
        got = q.model.layers[0].mlp.experts(hidden, index, weights)
    assert got.dtype == torch.bfloat16
    err = rel_err(got.float(), want)
    assert err < RTOL[torch.bfloat16], f"{family} bfloat16: {err:.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_are_quantized_and_gates_stay_float(family):
    model, q = quantized(family, "mxfp4")
    experts = {n: m for n, m in q.named_modules() if isinstance(m, QuantFusedExperts)}
    assert sorted(experts) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for m in experts.values():
        assert not list(m.parameters(recurse=False)) and not any(p.dim() == 3 for p in m.parameters())
        for layer, (out, k) in ((m.gate_up_proj, (2 * INTER, HIDDEN)), (m.down_proj, (HIDDEN, INTER))):
            assert isinstance(layer, QuantSwitchLinear) and layer.mode == "mxfp4"
            assert layer.qweight.dtype == torch.uint32 and layer.qweight.shape == (EXPERTS, out, k * 4 // 32)
            assert layer.scales.dtype == torch.uint8 and layer.scales.shape == (EXPERTS, out, k // 32)
    # routers: float weights of their own module type; Qwen2-MoE's shared_expert_gate a float nn.Linear
    routers = [m for n, m in q.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]
    assert len(routers) == 2 and all(r.weight.dtype == torch.float32 and r.weight.dim() == 2 for r in routers)
    gates = [m for n, m in q.named_modules() if n.endswith("shared_expert_gate")]
    assert all(type(g) is nn.Linear for g in gates) and len(gates) == (2 if family == "qwen2_moe" else 0)
    assert all(isinstance(m, QuantLinear) for n, m in q.named_modules() if n.endswith("q_proj"))


def test_gates_quantized_when_asked():
    _, q = quantized("qwen2_moe", "affine", quantize_gates=True)
    assert all(isinstance(m, QuantLinear) for n, m in q.named_modules() if n.endswith("shared_expert_gate"))


def test_experts_left_float_when_asked():
    _, q = quantized("qwen3_moe", "affine", experts=False)
    assert not any(isinstance(m, QuantFusedExperts) for m in q.modules())
    assert q.model.layers[0].mlp.experts.gate_up_proj.dim() == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_generate_runs_and_follows_the_reference(family):
    model, q = quantized(family, "affine")
    ref = rtn_reference(model, q, transposed_experts=family == "gpt_oss")
    ids = ids_for(2, 6)
    got = q.generate(ids, max_new_tokens=6, do_sample=False)
    assert got.shape == (1, 12)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=6, do_sample=False))


def test_many_tokens_take_the_sorted_path_and_agree():
    # 40 tokens x 2 experts = 80 (token, expert) pairs: sorted by expert before the matmuls
    model, q = quantized("mixtral", "affine")
    ref = rtn_reference(model, q, transposed_experts=False)
    ids = ids_for(3, 40)
    assert rel_err(logits(q, ids), logits(ref, ids)) < RTOL[torch.float32]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_torch_qmm_config_quantizes_experts_and_round_trips(family, tmp_path):
    from torch_qmm.interop.transformers import TorchQmmConfig

    model_cls = FAMILIES[family][1]
    model = tiny_moe(family)
    model.save_pretrained(tmp_path / "float")
    q = model_cls.from_pretrained(tmp_path / "float", quantization_config=TorchQmmConfig(bits=4, group_size=32),
                                  dtype=torch.float32)
    assert sum(isinstance(m, QuantFusedExperts) for m in q.modules()) == 2
    ids = ids_for(4)
    ref = rtn_reference(model, q, transposed_experts=family == "gpt_oss")
    want = logits(q, ids)
    assert rel_err(want, logits(ref, ids)) < RTOL[torch.float32]
    q.save_pretrained(tmp_path / "quantized")
    again = model_cls.from_pretrained(tmp_path / "quantized", dtype=torch.float32)
    assert sum(isinstance(m, QuantFusedExperts) for m in again.modules()) == 2
    assert torch.equal(logits(again, ids), want)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_moe_model_quantized_or_reloaded_in_bfloat16_has_bfloat16_experts(family, tmp_path):
    # quantize_model(dtype=...) quantizes the experts in that dtype too (the scales MLX gives for
    # bfloat16 weights, not float32 ones rounded later), and from_pretrained(dtype=bfloat16) of
    # the saved folder builds bfloat16 experts that give the same logits.
    model = tiny_moe(family)
    q = copy.deepcopy(model)
    quantize_model(q, group_size=32, dtype=torch.bfloat16)
    experts = [m for m in q.modules() if isinstance(m, QuantFusedExperts)]
    assert experts and {m.gate_up_proj.scales.dtype for m in experts} == {torch.bfloat16}
    # the scales are MLX's for the bfloat16 weights
    import mlx.core as mx

    down = _float_down(model, family).detach().to(torch.bfloat16).float().numpy()
    mlx_scales = mx.quantize(mx.array(down).astype(mx.bfloat16), group_size=32, bits=4)[1]
    assert torch.equal(experts[0].down_proj.scales.float(), torch.from_numpy(np.array(mlx_scales.astype(mx.float32))))
    q.to(torch.bfloat16)  # the layers left float (norms, embedding, router) too
    assert {m.down_proj.scales.dtype for m in experts} == {torch.bfloat16}
    ids = ids_for(4)
    want = logits(q, ids)
    assert torch.isfinite(want).all()
    q.save_pretrained(tmp_path / "quantized")
    again = FAMILIES[family][1].from_pretrained(tmp_path / "quantized", dtype=torch.bfloat16)
    assert {m.down_proj.scales.dtype for m in again.modules() if isinstance(m, QuantFusedExperts)} == {torch.bfloat16}
    saved, loaded = q.state_dict(), again.state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved if ".experts." in k)
    # the same weights; the reloaded model's float layers may round in another order in bfloat16
    assert rel_err(logits(again, ids), want) < RTOL[torch.bfloat16]


def _float_down(model, family: str) -> torch.Tensor:
    """The first layer's expert down projections of a float model as [E, out, in]."""
    w = model.model.layers[0].mlp.experts.down_proj
    return w.transpose(1, 2) if family == "gpt_oss" else w


# transformers saves a Mixtral model under its checkpoints' names (the MoE block as
# block_sparse_moe, renamed to mlp on load); the other families under the model's own names.
SAVED_AS = {"mixtral": (".mlp.", ".block_sparse_moe.")}


def stored_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


@pytest.mark.parametrize("route", ["quantize_model-from-config", "quantize_model-after-from_pretrained",
                                   "TorchQmmConfig"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_stores_the_quantized_experts_and_reloads_them(family, route, tmp_path):
    """However the model was quantized (quantize_model on a model built from its config or read by
    from_pretrained, or TorchQmmConfig on load), save_pretrained stores every tensor of its state
    as it is (the experts' packed words, scales and biases, no per-expert float weights) and
    from_pretrained rebuilds it: the same tensors bit for bit, the same logits (same buffers,
    same kernels: equal, no tolerance)."""
    from torch_qmm.interop.transformers import TorchQmmConfig

    model_cls = FAMILIES[family][1]
    q = tiny_moe(family)
    if route != "quantize_model-from-config":
        q.save_pretrained(tmp_path / "float")
    if route == "TorchQmmConfig":
        q = model_cls.from_pretrained(tmp_path / "float", quantization_config=TorchQmmConfig(bits=4, group_size=32),
                                      dtype=torch.float32)
    else:
        if route == "quantize_model-after-from_pretrained":
            q = model_cls.from_pretrained(tmp_path / "float", dtype=torch.float32)
        quantize_model(q, bits=4, group_size=32)
    assert sum(isinstance(m, QuantFusedExperts) for m in q.modules()) == 2
    q.save_pretrained(tmp_path / "quantized")

    stored = stored_tensors(tmp_path / "quantized")
    state = q.state_dict()
    old, new = SAVED_AS.get(family, (".", "."))
    assert sorted(stored) == sorted(k.replace(old, new) for k in state)
    for name, t in state.items():
        s = stored[name.replace(old, new)]
        assert s.dtype == t.dtype and torch.equal(s, t), name
    words = stored["model.layers.0.mlp.experts.gate_up_proj.qweight".replace(old, new)]
    assert words.dtype == torch.uint32 and words.shape == (EXPERTS, 2 * INTER, HIDDEN * 4 // 32)

    again = model_cls.from_pretrained(tmp_path / "quantized", dtype=torch.float32)
    reloaded = again.state_dict()
    assert sorted(reloaded) == sorted(state)
    for name, t in state.items():
        assert reloaded[name].dtype == t.dtype and torch.equal(reloaded[name], t), name
    ids = ids_for(6)
    assert torch.equal(logits(again, ids), logits(q, ids))


def test_expert_converters_are_dropped_as_transformers_matches_them(tmp_path):
    # Some families write a converter's target as a regex (deepseek_v4, kimi_linear:
    # r"\.experts.gate_up_proj"); it is dropped when its reverse, as transformers applies it on
    # save, would take a tensor of the quantized experts. Here Qwen3-MoE's merge in that spelling.
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    q = tiny_moe("qwen3_moe")
    q._weight_conversions = [WeightConverter(
        source_patterns=[r"\.experts.*.gate_proj.weight", r"\.experts.*.up_proj.weight"],
        target_patterns=r"\.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=1)])]
    quantize_model(q, bits=4, group_size=32)
    assert q._weight_conversions == []
    q.save_pretrained(tmp_path)
    stored = stored_tensors(tmp_path)
    assert torch.equal(stored["model.layers.0.mlp.experts.gate_up_proj.qweight"],
                       q.model.layers[0].mlp.experts.gate_up_proj.qweight)


def test_state_dict_of_other_format_is_refused():
    _, q = quantized("olmoe", "affine")
    _, other = quantized("olmoe", "mxfp4")
    with pytest.raises((ValueError, RuntimeError), match="mode=affine|bits=4, group_size=32"):
        other.load_state_dict(q.state_dict())


@pytest.mark.parametrize("inter, group_size, why", [(96, 64, "its intermediate size 96 is not a multiple of group_size=64"),
                                                    (64, 128, "its hidden size 64 is not a multiple of group_size=128")])
def test_experts_of_sizes_off_the_group_stay_float_with_the_reason(inter, group_size, why):
    import moe_helpers

    config_cls, model_cls, fields = FAMILIES["qwen3_moe"]
    config = config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_experts_per_tok=2,
                        tie_word_embeddings=False, **moe_helpers._ATTN, **dict(fields, moe_intermediate_size=inter))
    model = model_cls(config).eval()
    with pytest.warns(UserWarning, match=r"skipped model\.layers\.0\.mlp\.experts \(" + why):
        summary = quantize_model(model, bits=4, group_size=group_size)
    experts = model.model.layers[0].mlp.experts
    assert not isinstance(experts, QuantFusedExperts) and experts.gate_up_proj.shape == (EXPERTS, 2 * inter, HIDDEN)
    assert summary.skipped["model.layers.0.mlp.experts"] == why
    assert "model.layers.0.mlp.experts" not in summary.converted
    if group_size == 64:  # the attention projections (64 wide) are still quantized
        assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)


def test_filter_fn_leaves_experts_float():
    model = tiny_moe("mixtral")
    summary = quantize_model(model, bits=4, group_size=32, filter_fn=lambda name, m: not name.endswith("experts"))
    assert not any(isinstance(m, QuantFusedExperts) for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert not any(n.endswith("experts") for n in summary.converted)


@pytest.mark.parametrize("kw", [dict(method="mse"), dict(bits={"*": 4})], ids=["mse", "per-layer-bits"])
def test_experts_stay_float_under_a_per_layer_quantizer(kw):
    # The fused experts are quantized by rtn at one width; a quantizer choosing per layer leaves
    # them float, says so, and still quantizes the linear layers.
    model = tiny_moe("qwen3_moe")
    with pytest.warns(UserWarning, match=r"skipped model\.layers\.0\.mlp\.experts \(fused experts are quantized by rtn"):
        summary = quantize_model(model, group_size=32, **kw)
    assert not any(isinstance(m, QuantFusedExperts) for m in model.modules())
    want = "fused experts are quantized by rtn with one bit width, not " + (
        "per-layer bits" if "bits" in kw else "method=" + repr(kw["method"]))
    assert summary.skipped["model.layers.1.mlp.experts"] == want
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)


def test_experts_named_in_modules_to_not_convert_stay_float_through_a_reload(tmp_path):
    from torch_qmm.interop.transformers import TorchQmmConfig

    model_cls = FAMILIES["qwen3_moe"][1]
    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "float")
    config = TorchQmmConfig(bits=4, group_size=32, modules_to_not_convert=["lm_head", "model.layers.0.mlp.experts"])
    q = model_cls.from_pretrained(tmp_path / "float", quantization_config=config, dtype=torch.float32)
    kinds = [type(layer.mlp.experts).__name__ for layer in q.model.layers]
    assert kinds[1] == "QuantFusedExperts" and kinds[0] != "QuantFusedExperts", kinds
    ids = ids_for(5)
    want = logits(q, ids)
    q.save_pretrained(tmp_path / "quantized")
    again = model_cls.from_pretrained(tmp_path / "quantized", dtype=torch.float32)
    assert [type(layer.mlp.experts).__name__ for layer in again.model.layers] == kinds
    assert torch.equal(logits(again, ids), want)


def test_float64_experts_are_refused_before_any_layer_is_converted():
    """Fused experts in a dtype the quantized layers do not compute in (float64) are checked with
    the linear layers, before anything changes: a TypeError naming the experts module, the model
    left as it was (not the blocks before them converted, then an error about an argument 'dtype'
    the caller did not pass)."""
    from torch_qmm.interop.experts import fused_experts

    model = tiny_moe("qwen3_moe")
    experts_name, experts = fused_experts(model)[-1]  # the last block's: the others come first
    experts.double()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(TypeError, match=rf"quantize_model: .*{re.escape(experts_name)} \(torch.float64\)\. Pass dtype="):
        quantize_model(model, bits=4, group_size=64)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(p.dtype == torch.float64 for p in experts.parameters())


def test_experts_with_a_norm_after_each_expert_stay_float():
    """An experts module that normalizes each expert's output before the routing weights
    (transformers' has_post_expert_norm: MuseSpark's experts) is not one QuantFusedExperts can
    compute, which has no norm: quantize_model leaves it float, computing what it computed, while a
    Qwen3-MoE experts module of the same shapes beside it is quantized (quantize_model reached both)."""
    muse = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig

    config = MuseSparkTextConfig(num_local_experts=EXPERTS, moe_hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                 hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    normed = muse.MuseSparkExperts(config).eval()
    assert normed.has_post_expert_norm
    with torch.no_grad():
        normed.gate_up_proj.normal_(0, HIDDEN ** -0.5)
        normed.down_proj.normal_(0, INTER ** -0.5)
        normed.post_expert_norm.weight.uniform_(0.7, 1.3)
    model = nn.ModuleDict({"normed": normed, "plain": tiny_moe("qwen3_moe").model.layers[0].mlp.experts})
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, HIDDEN, generator=g)
    index = torch.rand(6, EXPERTS, generator=g).argsort(-1)[:, :2]
    weights = torch.rand(6, 2, generator=g).softmax(-1)
    with torch.no_grad():
        want = normed(hidden, index, weights)
        quantize_model(model, bits=4, group_size=32)
        got = model["normed"](hidden, index, weights)
    assert type(model["normed"]) is muse.MuseSparkExperts and normed.gate_up_proj.dim() == 3
    assert isinstance(model["plain"], QuantFusedExperts)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gate_and_up_rows_are_the_rows_the_gating_reads(family):
    """QuantFusedExperts' own split of gate_up_proj's rows (used to save and load MLX's separate
    gate_proj / up_proj and to shard the experts) is the one the model's gating reads: rows
    joined by join_gate_and_up from a gate g and an up u go through the activation as the family's
    gating of g and u, written here from the models' definitions (Mixtral, Qwen, OLMoE: silu(g) * u;
    gpt-oss: g clamped above at its swiglu_limit, u clamped to +-limit, (u + 1) * g * sigmoid(1.702 g))."""
    model, q = quantized(family, "affine")
    experts = q.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(2)
    gate, up = (3 * torch.randn(EXPERTS, INTER, 5, generator=g) for _ in range(2))  # [E, I, 5 tokens]
    rows = experts.join_gate_and_up(gate, up)  # [E, 2I, 5]
    assert all(torch.equal(a, b) for a, b in zip(experts.gate_and_up_rows(rows), (gate, up)))
    if family == "gpt_oss":
        limit = model.config.swiglu_limit
        gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
        want = (uc + 1) * gc * torch.sigmoid(1.702 * gc)
    else:
        want = torch.nn.functional.silu(gate) * up
    with torch.no_grad():
        got = experts.activation(rows.transpose(1, 2)).transpose(1, 2)  # [E, 5, 2I] -> [E, 5, I] -> [E, I, 5]
    # the same float32 operations, perhaps fused or ordered otherwise: a few ulps (the rows taken
    # in the other order would pair a gate with another feature's up, off by O(1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_quantize_model_summary_counts_expert_blocks_apart_from_linear_layers():
    model = tiny_moe("qwen3_moe")
    summary = quantize_model(model, group_size=32)
    linear = sum(type(m).__name__ == "QuantLinear" for m in model.modules())
    blocks = sum(isinstance(m, QuantFusedExperts) for m in model.modules())
    assert (linear, blocks) == (len(summary.converted) - 2, 2)
    assert str(summary).startswith(f"{linear} linear layers and 2 MoE expert blocks quantized, 0 skipped")
