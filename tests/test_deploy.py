"""Serving a quantized model. torch.export: the exported program, with a dynamic number of rows,
gives the module's outputs, also after torch.export.save / load (the torch_qmm ops are in the
graph). torch.jit: trace records the ops; script is refused with an error naming the module.
Threads: concurrent calls give the results of calls made one at a time."""

from __future__ import annotations

import copy
import io
import threading

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm.interop.modules import GGUFLinear, QuantEmbedding, TiedQuantLinear
from torch_qmm.nn import QuantLinear
from torch_qmm.nn_moe import SORT_MIN_PAIRS, QuantFusedExperts

from gguf_helpers import Q4_K, Q6_K, random_k_blocks

transformers = pytest.importorskip("transformers")
from moe_helpers import rtn_reference, tiny_moe  # noqa: E402


def _saved_and_loaded(ep):
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _gguf_linear(ggml_type, k: int, n: int) -> GGUFLinear:
    layer = GGUFLinear(k, n, int(ggml_type), bias=True)
    with torch.no_grad():
        layer.blocks.copy_(torch.from_numpy(random_k_blocks(ggml_type, n, k, np.random.default_rng(0))))
        layer.bias.normal_()
    return layer


LAYERS = {
    "affine": lambda: QuantLinear.from_linear(torch.nn.Linear(256, 48), bits=3, group_size=32),
    "mxfp4": lambda: QuantLinear.from_linear(torch.nn.Linear(256, 48, bias=False), mode="mxfp4"),
    "q4_k": lambda: _gguf_linear(Q4_K, 256, 48),
    "q6_k": lambda: _gguf_linear(Q6_K, 512, 16),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_exported_linear_layer_with_dynamic_rows(kind):
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    rows = torch.export.Dim("rows", min=1, max=1024)
    ep = torch.export.export(layer, (torch.randn(5, layer.in_features),), dynamic_shapes=({0: rows},))
    loaded = _saved_and_loaded(ep)
    for m in (1, 3, 17, 64):
        x = torch.randn(m, layer.in_features)
        want = layer(x)
        assert torch.equal(ep.module()(x), want) and torch.equal(loaded.module()(x), want), m


class _EmbeddingAndTiedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = QuantEmbedding.from_embedding(torch.nn.Embedding(100, 64), bits=4, group_size=32)
        self.head = TiedQuantLinear(self.embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))


@pytest.mark.parametrize("bounded", [True, False], ids=["max-64", "unbounded"])
def test_exported_embedding_checks_ids_when_it_runs(bounded):
    # An unbounded Dim: the ops' size checks put no guard on a symbolic size (one that an unbounded
    # dimension could not satisfy); they run on the concrete sizes of each call.
    torch.manual_seed(0)
    model = _EmbeddingAndTiedHead()
    tokens = torch.export.Dim("tokens", min=1, max=64) if bounded else torch.export.Dim("tokens")
    ep = _saved_and_loaded(torch.export.export(model, (torch.randint(0, 100, (2, 7)),),
                                               dynamic_shapes=({1: tokens},)))
    ids = torch.randint(0, 100, (2, 11))
    assert torch.equal(ep.module()(ids), model(ids))
    ids[1, 3] = 100
    with pytest.raises(RuntimeError, match=r"QuantEmbedding: argument 'ids' must be in \[0, 100\)"):
        ep.module()(ids)


class _Experts(torch.nn.Module):
    """An experts module with its three inputs positional (for dynamic_shapes)."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, index, weights)


@pytest.mark.parametrize("strict", [False, True])
def test_exported_experts_with_dynamic_tokens(strict):
    # QuantFusedExperts sorts the (token, expert) pairs from SORT_MIN_PAIRS on; an exported program
    # serves token counts on both sides of that with one graph, the float experts' results.
    float_model = tiny_moe("qwen3_moe")
    model = copy.deepcopy(float_model)
    torch_qmm.quantize_model(model, bits=4, group_size=32)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantFusedExperts)
    reference = rtn_reference(float_model, model, transposed_experts=False).model.layers[0].mlp.experts

    def inputs(tokens: int):
        g = torch.Generator().manual_seed(tokens)
        index = torch.rand(tokens, experts.num_experts, generator=g).argsort(-1)[:, :2]
        return torch.randn(tokens, experts.gate_up_proj.in_features, generator=g), index, torch.rand(tokens, 2, generator=g)

    tokens = torch.export.Dim("tokens", min=1, max=256)
    with torch.no_grad():
        ep = torch.export.export(_Experts(experts), inputs(5), dynamic_shapes=({0: tokens},) * 3, strict=strict)
        loaded = _saved_and_loaded(ep)
        for n in (1, 5, SORT_MIN_PAIRS // 2 - 1, SORT_MIN_PAIRS // 2, 100):
            want = reference(*inputs(n))
            for got in (experts(*inputs(n)), ep.module()(*inputs(n)), loaded.module()(*inputs(n))):
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, (n, err)
            assert torch.equal(ep.module()(*inputs(n)), experts(*inputs(n))), n


@pytest.mark.parametrize("kind", list(LAYERS))
def test_fx_symbolic_trace_records_the_product_as_one_call(kind):
    # torch.fx.symbolic_trace has no values: the layer's product is one call node (torch.fx.wrap),
    # run with the real tensors when the traced module runs.
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    model = torch.nn.Sequential(layer, torch.nn.ReLU())
    traced = torch.fx.symbolic_trace(model)
    calls = [n.target.__name__ for n in traced.graph.nodes if n.op == "call_function"]
    assert ("quantized_matmul" if kind in ("affine", "mxfp4") else "gguf_matmul") in calls
    x = torch.randn(3, layer.in_features)
    assert torch.equal(traced(x), model(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the casts decide when the traced module runs
        want = model(x)
        got = traced(x)
    assert want.dtype == torch.bfloat16 and got.dtype == want.dtype and torch.equal(got, want)


def test_fx_symbolic_trace_of_a_tied_head():
    torch.manual_seed(0)
    model = _EmbeddingAndTiedHead()
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(model.head))
    x = torch.randn(2, 64)
    assert torch.equal(traced(x), model.head(x))


def test_jit_script_is_a_clear_error_and_trace_records_the_ops():
    torch.manual_seed(0)
    embedding = QuantEmbedding.from_embedding(torch.nn.Embedding(100, 64), bits=4, group_size=32)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 64), bits=3, group_size=32)
    model = torch.nn.Sequential(embedding, torch.nn.ReLU(), layer, TiedQuantLinear(embedding))
    with pytest.raises(RuntimeError, match=r"torch.jit.script cannot compile QuantEmbedding: its forward runs Python "
                                           r"that TorchScript does not support; torch.export.export \(or "
                                           r"torch.jit.trace\) records its torch_qmm ops instead"):
        torch.jit.script(model)
    with pytest.raises(RuntimeError, match=r"torch.jit.script cannot compile GGUFLinear"):
        torch.jit.script(LAYERS["q4_k"]())
    traced = torch.jit.trace(model, (torch.randint(0, 100, (2, 7)),))
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    ids = torch.randint(0, 100, (3, 5))
    assert torch.equal(loaded(ids), model(ids))
    # the traced graph refuses ids out of range, as a traced nn.Embedding does (no wrapped -1)
    for bad in (-1, 100):
        ids[1, 2] = bad
        with pytest.raises(RuntimeError, match="index out of range"):
            loaded(ids)


def test_concurrent_calls_from_threads_give_the_sequential_results(threads):
    # A server's request threads share one model: each call must be what it is alone, whatever
    # other calls (other M, so other kernels; int8 activations in one thread) run beside it.
    torch.manual_seed(0)
    layers = {kind: make() for kind, make in LAYERS.items()}
    calls = [(kind, torch.randn(m, layer.in_features), int8) for kind, layer in layers.items()
             for m in (1, 3, 17, 64) for int8 in ((False, True) if kind == "affine" else (False,))]

    def call(kind, x, int8):
        with torch_qmm.activation_quantization("int8" if int8 else None):
            return layers[kind](x)

    want = [call(*c) for c in calls]
    assert not torch.equal(want[0], call(*calls[0][:2], True))  # the int8 calls differ from the exact ones
    start = threading.Barrier(4)
    got: dict[tuple[int, int, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def serve(worker: int) -> None:
        try:
            start.wait()
            for r in range(3):
                for i in range(len(calls)):
                    j = (i * 7 + worker * 5 + r) % len(calls)
                    got[worker, r, j] = call(*calls[j])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    workers = [threading.Thread(target=serve, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and not any(w.is_alive() for w in workers)
    assert len(got) == 4 * 3 * len(calls)
    for (worker, r, j), y in got.items():
        assert torch.equal(y, want[j]), (worker, calls[j][0], calls[j][1].shape[0], calls[j][2])
