"""The method registry (torch_qmm.quantizers.methods) is the one list that quantize_model,
TorchQmmConfig and `convert --method` accept; gptq with activation order over several lazy-update
blocks equals a float64 reference written here from the algorithm's definition."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_qmm
from torch_qmm.quantizers import AWQ, GPTQ, REGISTRY, Method, gptq, names, register, resolve

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


CALIB = [torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
NOT_HEAD = staticmethod(lambda name, _: name != "lm_head")


# ---- one registry ------------------------------------------------------------------------------------

def test_the_cli_offers_exactly_the_registered_methods():
    import argparse

    from torch_qmm.interop.cli_convert import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if "--method" in a.option_strings)
    assert tuple(action.choices) == names()
    assert {"rtn", "mse", "awq", "gptq", "gptq-clip", "awq-gptq"} <= set(names())
    for name in names():
        assert name + ":" in action.help


def test_names_and_options_resolve_to_the_pass_that_runs_them():
    assert resolve("rtn").kind == "rtn" and not resolve("rtn").calibrated
    assert resolve("mse").kind == "mse" and not resolve("mse").calibrated
    assert resolve("awq-gptq").options == AWQ(gptq=GPTQ(act_order=True, clip=True))
    assert resolve("gptq-clip").options == GPTQ(act_order=True, clip=True)
    assert resolve(GPTQ(damp=0.1)).kind == "gptq" and resolve(GPTQ(damp=0.1)).calibrated
    assert resolve(AWQ()).kind == "awq"


def test_every_preset_holds_the_options_the_readme_gives_it():
    """The README's table of methods names each calibrated preset's options as the GPTQ(...) /
    AWQ(...) to pass for it; the registry must hold those."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `([a-z-]+)`(?: \(default\))? \| calibration \| `((?:GPTQ|AWQ)\(.*?\))`:", readme, re.M)
    documented = {name: eval(options, {"GPTQ": GPTQ, "AWQ": AWQ}) for name, options in rows}
    assert {"gptq-clip", "awq-gptq", "gptq-refit", "awq-gptq-refit"} <= set(documented), rows
    for name, options in documented.items():
        assert resolve(name).options == options, name


def test_a_preset_name_quantizes_as_its_options():
    """quantize_model(method="awq-gptq") writes the same triples as the options it names."""
    by_name, by_options = _llama(), _llama()
    torch_qmm.quantize_model(by_name, bits=3, group_size=32, method="awq-gptq", calibration=CALIB, filter_fn=NOT_HEAD)
    torch_qmm.quantize_model(by_options, bits=3, group_size=32, method=AWQ(gptq=GPTQ(act_order=True, clip=True)),
                             calibration=CALIB, filter_fn=NOT_HEAD)
    rtn = _llama()
    torch_qmm.quantize_model(rtn, bits=3, group_size=32, filter_fn=NOT_HEAD)
    a, b, r = (dict(m.named_buffers()) for m in (by_name, by_options, rtn))
    assert [n for n in a if n.endswith("qweight")] and a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert any(not torch.equal(a[n], r[n]) for n in a if n.endswith("qweight"))


def test_torchqmmconfig_takes_names_and_options_and_refuses_others():
    from torch_qmm.interop.transformers import TorchQmmConfig

    assert TorchQmmConfig(bits=4, method="gptq-clip").to_dict()["method"] == "gptq-clip"
    assert TorchQmmConfig(bits=4, method=GPTQ(act_order=True)).to_dict()["method"] == "gptq"
    with pytest.raises(ValueError, match=r"argument 'method' must be one of \('rtn', 'mse'"):
        TorchQmmConfig(bits=4, method="hqq")
    with pytest.raises(TypeError, match="argument 'method' must be a method name .* got int"):
        TorchQmmConfig(bits=4, method=4)


def test_unknown_methods_are_clear_errors_everywhere():
    with pytest.raises(ValueError, match="argument 'method' must be one of .*'awq-gptq'.*got 'gptqq'"):
        torch_qmm.quantize_model(_llama(), method="gptqq")
    with pytest.raises(TypeError, match="argument 'method' must be a method name"):
        torch_qmm.quantize_model(_llama(), method=None)
    with pytest.raises(ValueError, match="method='awq-gptq' needs calibration"):
        torch_qmm.quantize_model(_llama(), method="awq-gptq")
    with pytest.raises(TypeError, match="argument 'act_order' must be a bool"):
        GPTQ(act_order=1)


def test_register_adds_a_name_and_refuses_duplicates_and_mismatched_options():
    m = Method("gptq-damp10", "gptq", GPTQ(damp=0.1), "gptq with 10% dampening")
    try:
        register(m)
        assert resolve("gptq-damp10") is m and "gptq-damp10" in names()
        with pytest.raises(ValueError, match="already registered"):
            register(copy.copy(m))
    finally:
        REGISTRY.pop("gptq-damp10", None)
    with pytest.raises(ValueError, match="kind must be one of"):
        register(Method("x", "gptq", AWQ(), ""))
    with pytest.raises(ValueError, match="kind must be one of"):
        register(Method("y", "hqq", None, ""))
    assert "x" not in names() and "y" not in names()


# ---- gptq with act-order across lazy-update blocks vs float64 -------------------------------------

def _obq_reference(w, h, bits, group_size, damp, act_order):
    """Optimal Brain Quantization one column at a time in float64, the inverse Hessian of the columns
    left recomputed by explicit inversion at each step. With act_order the columns are visited by
    decreasing H_ii and every group's scale and bias come from the original weights (static groups)."""
    w = w.double().clone()
    h = h.double().clone()
    cols = w.shape[1]
    order = (torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order
             else torch.arange(cols))
    lo = w.reshape(w.shape[0], -1, group_size).amin(-1)
    hi = w.reshape(w.shape[0], -1, group_size).amax(-1)
    s_static, b_static = (hi - lo) / (2**bits - 1), lo
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=torch.float64)
    q_perm = torch.zeros_like(w)
    s = b = None
    for j in range(cols):
        col = int(order[j])
        if act_order:
            s, b = s_static[:, col // group_size], b_static[:, col // group_size]
        elif col % group_size == 0:
            g = w[:, j:j + group_size]
            s, b = (g.amax(-1) - g.amin(-1)) / (2**bits - 1), g.amin(-1)
        q = torch.clamp(torch.round((w[:, j] - b) / s), 0, 2**bits - 1)
        q_perm[:, j] = q
        hinv = torch.linalg.inv(h[j:, j:])
        err = (w[:, j] - (q * s + b)) / hinv[0, 0]
        w[:, j:] -= err[:, None] * hinv[0][None, :]
    q_out = torch.empty_like(q_perm)
    q_out[:, order] = q_perm
    return q_out


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_over_several_blocks_equals_the_float64_reference(act_order):
    cols = 2 * gptq.BLOCK + 64  # three lazy-update blocks, the last one partial
    g = torch.Generator().manual_seed(11)
    w = torch.randn(6, cols, generator=g, dtype=torch.float64)
    mix = torch.randn(cols, cols, generator=g, dtype=torch.float64) / cols**0.5 + torch.eye(cols, dtype=torch.float64)
    x = (torch.randn(3 * cols, cols, generator=g, dtype=torch.float64) * torch.rand(cols, generator=g,
                                                                                     dtype=torch.float64) * 3) @ mix
    h = x.T @ x

    def minmax(wg, _first):
        grp = wg.reshape(wg.shape[0], -1, 32)
        lo, hi = grp.amin(-1), grp.amax(-1)
        return (hi - lo) / 7, lo

    q, _, _ = gptq.search(w, h, 3, 32, minmax, damp=0.01, act_order=act_order)
    q_ref = _obq_reference(w, h, 3, 32, 0.01, act_order)
    assert torch.equal(q, q_ref), f"{int((q != q_ref).sum())} of {q.numel()} codes differ"


# ---- MLX-LM's mixed recipe as a bits mapping ---------------------------------------------------------

@pytest.mark.parametrize("n_blocks,low,high", [(30, 3, 6), (16, 3, 4), (9, 2, 6)])
def test_mixed_recipe_gives_each_layer_the_bits_of_mlx_lms_predicate(n_blocks, low, high):
    convert = pytest.importorskip("mlx_lm.convert")
    from torch_qmm.quantizers.mixed import recipe

    leaves = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")
    names = [f"model.layers.{i}.{leaf}" for i in range(n_blocks) for leaf in leaves] + ["lm_head"]

    class Shape:  # what mlx_lm's predicate builder reads of a model: its module names and block count
        layers = [None] * n_blocks

        @staticmethod
        def named_modules():
            return [(n, None) for n in names]

    predicate = convert.mixed_quant_predicate_builder(f"mixed_{low}_{high}", Shape(), group_size=64)
    theirs = {n: predicate(n, None)["bits"] for n in names}
    assert recipe(names, low, high) == theirs
    assert low < sum(recipe(names, low, high).values()) / len(names) < high
