"""Tensor parallelism over gloo on CPU (torch_qmm.distributed): 2 and 4 processes, one spawn per
world size running every check of tests/distributed_checks.py; the tests assert on what each rank
reported. Reference: float64 (the tolerance rule) for single layers, the same model in one
process for stacks.

Tolerances. Single layers: torch_qmm.tolerance.sharded_error_bound against the float64 product:
the rule of error_bound plus the roundings the split adds (rowwise: each rank's partial sum
rounded once to the dtype and S - 1 additions in the all-reduce, 2S - 1 roundings; a bias one
more). Stacks (two llama MLPs, a two-layer llama) compared with the one-process model: no
per-element bound survives silu, softmax and RMSNorm, so they are held to 1e-4 of the largest
output (float32: ACC_RTOL = 2e-5 per product, a few products deep), the last product of the MLP
stack to the rule against float64 of its actual input, and the llama's greedy tokens must agree.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.tensor.parallel")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distributed_checks import spawn  # noqa: E402
from torch_qmm.formats import FORMATS  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLDS = (2, 4)
STACK_RTOL = 1e-4


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    return world, spawn(world, str(tmp_path_factory.mktemp(f"tp{world}")))


def _values(ranks, check):
    world, results = ranks
    for r, res in enumerate(results):
        assert res[check]["ok"], f"rank {r} of {world}: {res[check]['error']}"
    return world, [res[check]["value"] for res in results]


def test_single_layers_every_mode_against_float64(ranks):
    world, values = _values(ranks, "layers")
    assert {k.split("/")[0] for k in values[0]} == set(FORMATS)
    for v in values:
        for case, c in v.items():
            assert c["y_ratio"] <= 1, (case, c)
            assert c["dx_ratio"] <= 1, (case, c)
            assert c["local"] == c["expected_local"], case  # each rank holds its share of the packed words
            mine, theirs = c["placement"]
            assert mine == theirs, case  # the layout PyTorch's style gives nn.Linear
            assert c["local_shape"][0] == c["local_shape"][1], case
            split = case.endswith("colwise")
            if case.split("/")[0] == "affine":
                assert c["biases_local"] == c["local"]["scales"], case
            else:
                assert c["biases_local"] is None, case
            assert c["bias_placement"] == ("S(0)" if split else "R"), case


def test_mlp_stack_matches_one_process(ranks):
    world, values = _values(ranks, "mlp")
    for v in values:
        for mode, c in v.items():
            assert c["down_input_max_diff"] <= STACK_RTOL * c["down_input_scale"], (mode, c)
            assert c["y_ratio_vs_reference"] <= 1, (mode, c)
            assert c["y_max_diff"] <= STACK_RTOL * c["y_scale"], (mode, c)
            assert c["dx_max_diff"] <= STACK_RTOL * c["dx_scale"], (mode, c)
            assert c["local_bytes"] * world == c["full_bytes"], mode
    assert values[0]["affine"]["y"] == values[-1]["affine"]["y"]  # replicated output


def test_collectives_staged_through_cpu_give_the_same_numbers(ranks):
    _, direct = _values(ranks, "mlp")
    _, staged = _values(ranks, "mlp_staged")
    for d, s in zip(direct, staged):
        for mode in d:
            assert s[mode]["y"] == d[mode]["y"], mode
            assert s[mode]["dx"] == d[mode]["dx"], mode


def test_sequence_parallel_norm_and_mlp(ranks):
    _, values = _values(ranks, "sequence_parallel")
    for v in values:
        assert v["shape"][0] == v["shape"][1]
        assert v["max_diff"] <= STACK_RTOL * v["scale"], v


def test_splits_that_cut_groups_are_refused(ranks):
    world, values = _values(ranks, "refusals")
    v = values[0]
    k = world * 32 + 32
    assert v["rowwise"] is not None
    for part in ("QuantRowwiseParallel", "'down_proj'", f"in_features={k}", "group_size=32", f"world_size={world}"):
        assert part in v["rowwise"], (part, v["rowwise"])
    assert v["embedding_colwise"] is not None and "'embed'" in v["embedding_colwise"]
    assert v["tied"] is not None and "'head'" in v["tied"]


def test_embedding_styles_as_pytorch_gives_nn_embedding(ranks):
    world, values = _values(ranks, "embedding")
    for v in values:
        for case, c in v.items():
            assert c["equal"] and c["equal_torch"], (case, c)
            assert c["placements"][0] == c["placements"][1], case
            rows, words = c["full"]
            assert c["local"] == ([rows, words // world] if "/colwise/" in case else [rows // world, words]), case



def test_row_split_embedding_refuses_ids_outside_the_whole_table(ranks):
    # nn.Embedding's rule (IndexError for an id < 0 or >= num_embeddings), checked on the whole
    # table: num_embeddings itself lies outside every rank's rows, where a check against a rank's
    # rows alone would embed it as zeros.
    world, values = _values(ranks, "embedding_ids")
    num = values[0]["num_embeddings"]
    with pytest.raises(IndexError):
        torch.nn.Embedding(num, 4)(torch.tensor([num]))
    for v in values:
        for bad in (num, num + 3, -1):
            c = v[str(bad)]
            assert c["whole"] is not None and f"must be in [0, {num})" in c["whole"], (bad, c)
            assert c["sharded"] == c["whole"], (bad, c)

def test_tiny_llama_with_its_tp_plan(ranks):
    world, values = _values(ranks, "llama")
    for v in values:
        assert v["quantized"] == 15  # 7 linear layers per block, 2 blocks, lm_head
        assert v["logits_max_diff"] <= STACK_RTOL * v["logits_scale"], v
        assert v["ids_logits_max_diff"] <= STACK_RTOL * v["logits_scale"], v
        assert v["dx_max_diff"] <= STACK_RTOL * v["dx_scale"], v
        assert v["argmax_equal"]
        assert v["generate_equal"]
        assert v["q_local"] == [v["q_full"][0] // world, v["q_full"][1]]
        assert v["o_local"] == [v["o_full"][0], v["o_full"][1] // world]


def test_checkpoints_with_a_tied_head_load_as_their_peers_read_them(ranks):
    # The checkpoints hold no lm_head tensors: the head reads the embedding's, split colwise. MLX
    # folders against mlx_lm; a save_pretrained folder against transformers' from_pretrained.
    world, values = _values(ranks, "load_mlx_tied")
    for v in values:
        for embedding, c in v.items():
            assert c["max_diff"] <= STACK_RTOL * c["scale"], (embedding, c)
        assert v["quantized"]["head"] == "QuantLinear"
        assert v["float"]["head"] == "Linear"
        assert v["float"]["head_local"] == [64, 128]  # 64 * world vocabulary rows split over world ranks
        assert v["pretrained"]["head"] == "Linear"
        assert v["pretrained"]["head_local"] == [64, 128]


def test_a_head_tied_to_a_quant_embedding_stays_replicated_with_its_table(ranks):
    # tp_plan split the head tied to a QuantEmbedding (refused), and a plan without the head failed
    # in the forward (a sharded table beside replicated tensors), naming no layer.
    world, values = _values(ranks, "tied_quant_embedding")
    for v in values:
        assert not v["head_in_plan"] and not v["embedding_in_plan"] and v["layers_in_plan"] > 0
        assert v["refused"] == ("the plan splits 'model.embed_tokens', whose table the output layer 'lm_head' shares "
                                "(TiedQuantLinear); leave both replicated (tp_plan does), or load with "
                                "load_mlx_sharded, which unties them")
        assert v["max_diff"] <= STACK_RTOL * v["scale"], v
        assert v["q_local"][0] == 128 // world  # the attention is split


def test_ranks_given_different_checkpoints_refuse_the_load(ranks):
    # Each rank loaded its own folder without error, and together they computed wrong logits.
    world, values = _values(ranks, "load_mlx_other_folders")
    for message in values:
        assert message is not None and "the ranks were given different checkpoints" in message, message
        assert "rank 0: " in message and "mlx-llama-gs32" in message and f"rank {world - 1}: " in message
        assert "mlx-llama-gs64" in message


def test_mlx_checkpoint_loads_into_each_ranks_slices(ranks):
    world, values = _values(ranks, "load_mlx")
    for v in values:
        assert v["max_diff"] <= STACK_RTOL * v["scale"], v
        assert v["quantized"] == 16  # 15 linear layers and the embedding
        assert v["meta_left"] == []
        assert v["meta_built_equal"]  # a model built wholly on meta loads to the same logits
        # each rank read its share of every sharded tensor and the replicated ones (norms) whole
        sharded = v["bytes_total"] - v["replicated_bytes"]
        assert v["bytes_read"] == sharded // world + v["replicated_bytes"], v
        assert v["embed_local"] == [v["embed_full"][0] // world, v["embed_full"][1]]


def test_gguf_layers_against_gguf_dequantize(ranks):
    world, values = _values(ranks, "gguf")
    for v in values:
        for case, c in v.items():
            assert c["ratio"] <= 1, (case, c)
            rows, nbytes = c["full"]
            assert c["local"] == ([rows // world, nbytes] if case.endswith("colwise") else [rows, nbytes // world]), case


def test_transformers_save_loads_into_each_ranks_slices(ranks):
    world, values = _values(ranks, "load_pretrained")
    for cases in values:
        for case, v in cases.items():
            assert v["max_diff"] <= STACK_RTOL * v["scale"], (case, v)
            if case == "linears":  # lm_head stays float (transformers' default)
                assert v["quantized"] == v["single_quantized"] == 14, v
                assert (v["embedding"], v["head"]) == ("Embedding", "Linear"), v
            else:  # the embedding too, and the head tied to it (a layer of its own reading its tensors)
                assert v["quantized"] == v["single_quantized"] == 16, v
                assert (v["embedding"], v["head"]) == ("ShardedQuantEmbedding", "QuantLinear"), v
            sharded = v["bytes_total"] - v["replicated_bytes"]
            assert v["bytes_read"] == sharded // world + v["replicated_bytes"], (case, v)


# ---- the plan built from a transformers model's own (no process group needed) -----------------

def _planned_model(plan: dict):
    from torch import nn

    model = nn.Module()
    for name in "abcdef":
        model.add_module(name, nn.Linear(4, 4))
    model.layers = nn.ModuleList(nn.ModuleDict({"g": nn.Linear(4, 4)}) for _ in range(2))
    model._tp_plan = plan
    return model


def test_each_transformers_plan_kind_takes_its_style():
    from torch.distributed.tensor import Replicate, Shard
    from torch_qmm.distributed import QuantColwiseParallel, QuantRowwiseParallel, tp_plan
    from torch_qmm.distributed.styles import ReplicatedGradAllReduce

    kinds = {"a": "colwise", "b": "rowwise", "c": "embedding_rowwise", "d": "colwise_gather_output",
             "e": "rowwise_split_input", "f": "replicated_with_grad_allreduce", "layers.*.g": "rowwise",
             "layers.*": "colwise", "absent": "colwise", "layers.*.g.x": "colwise"}
    plan = tp_plan(_planned_model(kinds), stage=True)
    # (style, input layouts, output layouts): those of PyTorch's ColwiseParallel / RowwiseParallel
    # with the layouts transformers' kind names.
    want = {"a": (QuantColwiseParallel, (Replicate(),), (Shard(-1),)),
            "b": (QuantRowwiseParallel, (Shard(-1),), (Replicate(),)),
            "c": (QuantRowwiseParallel, (Replicate(),), (Replicate(),)),
            "d": (QuantColwiseParallel, (Replicate(),), (Replicate(),)),
            "e": (QuantRowwiseParallel, (Replicate(),), (Replicate(),)),
            "layers.*.g": (QuantRowwiseParallel, (Shard(-1),), (Replicate(),)),
            "layers.*": (QuantColwiseParallel, (Replicate(),), (Shard(-1),))}
    # entries naming no module ("absent"; a wildcard does not cross a dot) are left out
    assert set(plan) == set(want) | {"f"}
    assert type(plan["f"]) is ReplicatedGradAllReduce
    for key, (cls, inputs, outputs) in want.items():
        style = plan[key]
        assert (type(style), style.input_layouts, style.output_layouts, style.stage) == (cls, inputs, outputs, True), key
    assert tp_plan(_planned_model({"a": "colwise"}))["a"].stage is None


def test_plan_kinds_without_a_style_and_models_without_a_plan_are_refused():
    from torch import nn
    from torch_qmm.distributed import tp_plan

    with pytest.raises(ValueError, match=r"tp plan entry 'a': 'sequence_parallel' has no torch_qmm style \(known: "
                                         r"'colwise', 'rowwise'"):
        tp_plan(_planned_model({"a": "sequence_parallel"}))
    with pytest.raises(ValueError, match=r"Sequential has no tensor-parallel plan \(model._tp_plan"):
        tp_plan(nn.Sequential(nn.Linear(4, 4)))


# ---- attention heads the world size does not divide (refused before any split: no process group) -

class _Mesh:
    """A mesh of `n` ranks as far as parallelize reads it before it splits any layer: its size."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def _llama(heads: int, kv_heads: int):
    import torch_qmm
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    torch_qmm.quantize_model(model, bits=4, group_size=32)
    return model


def test_attention_heads_the_world_size_does_not_divide_are_refused_before_any_split():
    from torch_qmm.distributed import parallelize, tp_plan

    model = _llama(4, 1)
    with pytest.raises(ValueError, match=r"QuantColwiseParallel: layer 'model.layers.0.self_attn' cannot be split by "
                                         r"heads \(layer 'model.layers.0.self_attn.q_proj' is split colwise\): "
                                         r"num_attention_heads=4 and num_key_value_heads=1 \(its config\) into "
                                         r"world_size=2 shards of whole heads need both to be multiples of 2"):
        parallelize(model, _Mesh(2), tp_plan(model))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_moe_attention_heads_are_checked_where_the_plan_splits_them(family):
    from moe_helpers import tiny_moe  # 4 heads, 2 kv heads
    from torch_qmm.distributed import parallelize, tp_plan
    from torch_qmm.distributed.partition import check_whole_heads

    model = tiny_moe(family)
    plan = tp_plan(model)
    check_whole_heads(model, plan, 2)
    if family in ("olmoe", "gpt_oss"):  # q/k/v gathered (colwise_gather_output) or not split: whole heads
        check_whole_heads(model, plan, 4)
        return
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn' cannot be split by heads .*"
                                         r"num_attention_heads=4 and num_key_value_heads=2 \(its config\) into "
                                         r"world_size=4 "):
        parallelize(model, _Mesh(4), plan)


def test_attention_heads_the_world_size_divides_pass_the_check():
    from torch_qmm.distributed import tp_plan
    from torch_qmm.distributed.partition import check_whole_heads

    model = _llama(4, 2)
    check_whole_heads(model, tp_plan(model), 2)


# ---- one rank in a child process (it starts a process group) ------------------------------------

_GEMMA_EMBEDDING_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch_qmm.distributed import empty_parameters, load_pretrained_sharded, tp_plan

store, folder = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
with empty_parameters():
    model = transformers.GemmaForCausalLM(transformers.AutoConfig.from_pretrained(folder)).eval()
load_pretrained_sharded(model, folder, mesh, tp_plan(model))
with torch.no_grad():
    rows = model.model.embed_tokens(torch.tensor([[1, 5, 9, 95, 0, 33]]))
rows = rows.full_tensor() if isinstance(rows, DTensor) else rows
print(json.dumps({"type": type(model.model.embed_tokens).__name__, "rows": rows.tolist()}))
dist.destroy_process_group()
"""


def test_load_pretrained_sharded_keeps_the_scale_of_a_gemma_quantized_embedding(tmp_path):
    """A Gemma folder saved with its embedding quantized (TorchQmmConfig(embeddings=...)), loaded
    by load_pretrained_sharded on one rank: the embedding's rows are the saved table dequantized (as
    mx.dequantize gives it) times Gemma's scale sqrt(hidden_size), which transformers' own
    GemmaTextScaledWordEmbedding applies to a float table. float32 throughout: the same products,
    so assert_close's float32 defaults (rtol 1.3e-6) hold."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    mx = pytest.importorskip("mlx.core")
    np = pytest.importorskip("numpy")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from torch_qmm.interop.transformers import TorchQmmConfig

    config = transformers.GemmaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.GemmaForCausalLM(config).save_pretrained(tmp_path / "float")
    transformers.GemmaForCausalLM.from_pretrained(tmp_path / "float", quantization_config=TorchQmmConfig(
        bits=4, group_size=32, embeddings=["model.embed_tokens"])).save_pretrained(tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    table = mx.dequantize(*(mx.array(tensors[f"model.embed_tokens.{k}"].numpy()) for k in ("qweight", "scales", "biases")),
                          group_size=32, bits=4)
    reference = transformers.GemmaForCausalLM(config).model.embed_tokens  # GemmaTextScaledWordEmbedding
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(np.array(table)))
        want = reference(torch.tensor([[1, 5, 9, 95, 0, 33]]))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])}
    proc = subprocess.run([sys.executable, "-c", _GEMMA_EMBEDDING_SCRIPT, str(tmp_path / "store"), str(tmp_path / "q")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert "QuantEmbedding" in got["type"]
    torch.testing.assert_close(torch.tensor(got["rows"]), want)
