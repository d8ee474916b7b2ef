"""Tensor parallelism of quantized MoE experts over gloo on CPU: 2 and 4 processes, one spawn per
world size running every check of tests/distributed_moe_checks.py; the tests assert on what each
rank reported.

Tolerances. The experts block and a lone QuantSwitchLinear: torch_qmm.tolerance's
sharded_error_bound against float64 of the layers' own dequantized weights (the roundings the
split adds are counted where each check computes them). Whole models (five families, tiny, in
float32) against the same model in one process: no per-element bound survives attention,
softmax routing and the norms, so logits and gradients w.r.t. the input embeddings and the float
parameters are held to 1e-4 of their largest value (float32: ACC_RTOL = 2e-5 per product, a few
products deep; the tiny models measure ~1e-6), and the greedy tokens must agree.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.tensor.parallel")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402

from distributed_checks import spawn  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLDS = (2, 4)
STACK_RTOL = 1e-4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_tp_plan_of_moe_families(family):
    from distributed_moe_checks import quantized_moe
    from torch_qmm.distributed import QuantExpertsParallel, QuantRowwiseParallel, ReplicatedGradAllReduce, tp_plan

    model = quantized_moe(family, 2)
    plan = tp_plan(model)
    assert isinstance(plan.get("model.layers.*.mlp.experts"), QuantExpertsParallel), plan
    # the experts' own projections are QuantExpertsParallel's; entries naming no module are dropped
    assert not any(k.startswith("model.layers.*.mlp.experts.") for k in plan), plan
    assert "model.layers.*.mlp.gate_proj" not in plan
    assert ("model.layers.*.self_attn.q_proj" in plan) == (family != "gpt_oss")  # gpt-oss: attention whole
    if family == "qwen3_moe":
        assert isinstance(plan["model.layers.*.self_attn.q_norm"], ReplicatedGradAllReduce)
    if family == "olmoe":  # q/k/v gather their output (q_norm over all heads): o_proj splits its input
        o = plan["model.layers.*.self_attn.o_proj"]
        assert isinstance(o, QuantRowwiseParallel) and o.input_layouts == (Replicate(),)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    return world, spawn(world, str(tmp_path_factory.mktemp(f"moe{world}")), "distributed_moe_checks")


def _values(ranks, check):
    world, results = ranks
    for r, res in enumerate(results):
        assert res[check]["ok"], f"rank {r} of {world}: {res[check]['error']}"
    return world, [res[check]["value"] for res in results]


def test_moe_models_with_their_tp_plan_match_one_process(ranks):
    world, values = _values(ranks, "models")
    assert set(values[0]) == {"qwen3_moe/affine", "mixtral/affine", "gpt_oss/affine", "olmoe/affine",
                              "qwen2_moe/affine", "gpt_oss/mxfp4"}
    for v in values:
        for case, c in v.items():
            assert c["logits_max_diff"] <= STACK_RTOL * c["logits_scale"], (case, c)
            assert c["dx_max_diff"] <= STACK_RTOL * c["dx_scale"], (case, c)
            assert c["argmax_equal"], case
            assert c["local_bytes"] * world == c["full_bytes"], case  # each rank its share of the experts
            e, rows, words = c["gate_up_full"]
            assert c["gate_up_local"] == [e, rows // world, words], case
            e, rows, words = c["down_full"]
            assert c["down_local"] == [e, rows, words // world], case
            assert c["gate_up_rows"], case  # its gate and up rows of the layer, in the layer's row order
            assert c["grads"], case
            for name, (diff, scale) in c["grads"].items():
                assert diff <= STACK_RTOL * scale, (case, name, diff, scale)
    qwen3 = values[0]["qwen3_moe/affine"]["grads"]  # the norms over each rank's heads
    assert any(n.endswith("self_attn.q_norm.weight") for n in qwen3), sorted(qwen3)


def test_experts_block_against_float64(ranks):
    _, values = _values(ranks, "block")
    for v in values:
        for case, c in v.items():
            assert c["y_ratio"] <= 1, (case, c)
            assert c["h_max_diff"] <= STACK_RTOL * c["h_scale"], (case, c)
            assert c["dx_max_diff"] <= STACK_RTOL * c["dx_scale"], (case, c)
            assert c["dw_max_diff"] <= STACK_RTOL * c["dw_scale"], (case, c)  # top_k_weights' gradient
            assert c["staged_equal"], case


def test_switch_linear_colwise_and_rowwise_against_float64(ranks):
    world, values = _values(ranks, "switch_linear")
    for v in values:
        for name, c in v.items():
            assert c["y_ratio"] <= 1, (name, c)
            assert c["dx_ratio"] <= 1, (name, c)
            e, rows, words = c["full"]
            assert c["local"] == ([e, rows // world, words] if name == "colwise" else [e, rows, words // world]), name
            assert c["bias_placement"] == ("S(1)" if name == "colwise" else "R"), name


def test_splits_that_cut_groups_are_refused(ranks):
    world, values = _values(ranks, "refusals")
    v = values[0]
    inter = 32 * world + 32
    assert v["experts"] is not None
    for part in ("QuantExpertsParallel", "'model.layers.0.mlp.experts.down_proj'", f"in_features={inter}",
                 "group_size=32", f"world_size={world}"):
        assert part in v["experts"], (part, v["experts"])
    assert v["float_experts"] is not None and "'model.layers.0.mlp.experts'" in v["float_experts"]
    assert v["switch_rowwise"] is not None
    assert "QuantRowwiseParallel" in v["switch_rowwise"] and "'switch'" in v["switch_rowwise"]
    assert v["gguf_experts"] is not None
    for part in ("'experts'", "gate_up_proj (GGUFSwitchLinear)", "down_proj (GGUFSwitchLinear)", "load_mlx_sharded",
                 "Q2_K / Q3_K / Q6_K / lattice i-quant projection only with --requantize rest"):
        assert part in v["gguf_experts"], (part, v["gguf_experts"])


def test_mlx_moe_checkpoint_loads_into_each_ranks_slices(ranks):
    world, values = _values(ranks, "load_mlx")
    for v in values:
        assert set(v) == {"qwen3_moe", "mixtral", "gpt_oss"}
        for family, c in v.items():
            assert c["max_diff"] <= STACK_RTOL * c["scale"], (family, c)
            assert c["experts_quantized"] == 2, family
            assert c["meta_left"] == [], family
            assert c["gate_up_rows"] and c["down_scales_equal"], family
            sharded = c["bytes_total"] - c["replicated_bytes"]
            assert c["bytes_read"] == sharded // world + c["replicated_bytes"], (family, c)
            e, rows, words = c["gate_up_full"]
            assert c["gate_up_local"] == [e, rows // world, words], family


def test_mlx_lm_moe_folders_load_into_each_ranks_slices(ranks):
    # mlx_lm stores the routers quantized (load_mlx_sharded refused them: "expected nn.Linear or
    # nn.Embedding"), and a Mixtral block as block_sparse_moe ("does not exist in the model").
    world, values = _values(ranks, "load_mlx_lm")
    for v in values:
        if world != 2:
            assert v is None
            continue
        for family, c in v.items():
            assert c["max_diff"] <= STACK_RTOL * c["scale"], (family, c)
            assert c["routers_dequantized"] == 2 and not c["router"].startswith("Quant"), (family, c)


def test_save_pretrained_moe_folders_load_into_each_ranks_slices(ranks):
    # load_pretrained_sharded read QuantLinear layers only: the quantized experts reached
    # QuantExpertsParallel as float modules ("quantize the experts with quantize_model").
    world, values = _values(ranks, "load_pretrained_moe")
    for v in values:
        assert set(v) == {"mixtral", "qwen3_moe", "gpt_oss", "qwen3_moe 8-bit down"}
        for family, c in v.items():
            assert c["max_diff"] <= STACK_RTOL * c["scale"], (family, c)
            assert c["bits"] == ([4, 8] if family.endswith("down") else [4, 4]), (family, c)
            if family.startswith("qwen3_moe"):  # (Mixtral's block is stored as block_sparse_moe)
                assert c["reported"] == ("affine b4/8 gs32" if family.endswith("down") else "affine b4 gs32"), (family, c)
            assert c["experts_quantized"] == 2 and c["gate_up_rows"], (family, c)
            assert c["bytes_read"] < c["bytes_total"], (family, c)  # a slice of the experts, not all of them


def test_a_gpt_oss_gguf_model_splits_with_its_tp_plan(ranks):
    # load_gguf_llama's gpt-oss model (mxfp4 experts with biases, rows alternating gate, up) under
    # tp_plan: each rank holds its rows of every expert tensor, biases included, and the logits
    # are the one-process model's
    world, values = _values(ranks, "gguf_gpt_oss")
    for v in values:
        if world != 2:
            assert v is None
            continue
        assert v["max_diff"] <= STACK_RTOL * v["scale"], v
        assert v["mode"] == "mxfp4" and v["gate_up_rows"], v
