"""python -m torch_qmm convert / inspect, end to end on small models built from configs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from torch_qmm.__main__ import main
from torch_qmm.formats import FORMATS
from torch_qmm.interop import GGUFLinear, QuantEmbedding, load_mlx, parse_quantization
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import load_gguf_llama
from torch_qmm.nn import QuantLinear

transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
from test_interop_gguf_llama import hf_model, write_llama_gguf  # noqa: E402
from torch_qmm.interop.transformers import TorchQmmConfig  # noqa: E402

IDS = torch.tensor([[1, 2, 3, 50, 95, 0, 7]])


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    hf_model(tied=True).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_llama_gguf(hf_model(tied=False), path, {"proj": T.Q8_0, "embed": T.Q4_0, "lm_head": T.Q8_0},
                     np.random.default_rng(0))
    return path


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_convert_transformers_folder_reloads_with_from_pretrained(hf_folder, tmp_path):
    assert main(["convert", str(hf_folder), str(tmp_path / "out"), "--bits", "4", "--group-size", "64"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = transformers.AutoModelForCausalLM.from_pretrained(
        hf_folder, quantization_config=TorchQmmConfig(bits=4, group_size=64)
    )
    assert isinstance(reloaded.model.layers[0].mlp.up_proj, QuantLinear)
    assert torch.equal(_logits(reloaded), _logits(expected))


def test_convert_to_mlx_is_read_by_mlx_and_by_load_mlx(hf_folder, tmp_path):
    out = tmp_path / "mlx"
    assert main(["convert", str(hf_folder), str(out), "--format", "mlx", "--bits", "6", "--group-size", "32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 6 and config["tie_word_embeddings"] is True
    weights = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: MLX uses the quantized embedding as the head
    # MLX decodes exactly the weights our QuantLinear multiplies by
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_mlx(model, out)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    # what MLX reads from the folder is what load_mlx reads, tensor by tensor, bit for bit
    from test_interop_mlx import assert_same_tensors

    assert_same_tensors(model, weights)
    q = model.model.layers[1].self_attn.o_proj
    ours = torch_qmm_dequant(q)
    theirs = mx.dequantize(weights["model.layers.1.self_attn.o_proj.weight"],
                           weights["model.layers.1.self_attn.o_proj.scales"],
                           weights["model.layers.1.self_attn.o_proj.biases"], group_size=32, bits=6)
    # (within an ulp: MLX may fuse scale * q + bias into one FMA)
    torch.testing.assert_close(ours, torch.from_numpy(np.array(theirs)), rtol=2**-22, atol=2**-22 * ours.abs().max().item())
    # and the converted model is the float model quantized
    source = transformers.AutoModelForCausalLM.from_pretrained(hf_folder)
    err = (_logits(model) - _logits(source)).abs().max() / _logits(source).abs().max()
    assert err < 0.05


def torch_qmm_dequant(q):
    import torch_qmm

    return torch_qmm.dequantize(q.qweight, q.scales, q.biases, group_size=q.group_size, bits=q.bits)


def test_convert_gguf_to_mlx_keeps_block_types_exact(gguf_path, tmp_path):
    out = tmp_path / "mlx"
    assert main(["convert", str(gguf_path), str(out), "--format", "mlx"]) == 0
    default, overrides = parse_quantization(json.loads((out / "config.json").read_text()))
    assert (default.bits, default.group_size) == (8, 32)  # Q8_0 layers, exact
    assert (overrides["model.embed_tokens"].bits, overrides["model.embed_tokens"].group_size) == (4, 32)  # Q4_0
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_mlx(model, out)
    from_gguf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_gguf_llama(from_gguf, GGUFFile(gguf_path))
    assert torch.equal(_logits(model), _logits(from_gguf))


@pytest.mark.parametrize("qtype, bits", [(T.Q5_K, 5), (T.IQ4_XS, 8)], ids=["Q5_K", "IQ4_XS"])
def test_convert_k_quant_gguf_to_mlx_is_exact_and_mlx_decodes_the_file_weights(tmp_path, capsys, qtype, bits):
    # Q5_K (llama.cpp's Q5_K_M files) has an exact affine form: 5 bits, one group of 32 per
    # sub-block, float32 scale d*sc and bias -dmin*m; IQ4_XS too, as 8 bits: code value + 128,
    # scale d*(l - 32), bias -128 * scale. MLX's own dequantize of the folder gives back the weights
    # the gguf package decodes from the file, and load_mlx the model load_gguf_llama builds.
    path = tmp_path / "m.gguf"
    held = write_llama_gguf(hf_model(tied=False), path, {"proj": qtype, "embed": qtype, "lm_head": qtype},
                            np.random.default_rng(3))
    out = tmp_path / "mlx"
    assert main(["convert", str(path), str(out), "--format", "mlx"]) == 0
    assert re.search(rf"model\.layers\.1\.mlp\.down_proj +lossless {qtype.name} -> affine b{bits} gs32\n",
                     capsys.readouterr().out)
    default, overrides = parse_quantization(json.loads((out / "config.json").read_text()))
    assert (default.bits, default.group_size) == (bits, 32) and not overrides
    weights = mx.load(str(out / "model.safetensors"))
    for name in ("model.layers.0.mlp.up_proj", "model.layers.1.self_attn.k_proj", "model.embed_tokens", "lm_head"):
        assert weights[name + ".scales"].dtype == mx.float32, name
        w = mx.dequantize(weights[name + ".weight"], weights[name + ".scales"], weights[name + ".biases"],
                          group_size=32, bits=bits)
        want = held[name + ".weight"]
        # gguf rounds d*sc*q - dmin*m once (d*sc*q is exact): MLX, fused or not, rounds s*q + b once too
        assert torch.equal(torch.from_numpy(np.array(w)), want), name
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_mlx(model, out)
    from_gguf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_gguf_llama(from_gguf, GGUFFile(path))
    assert isinstance(from_gguf.model.layers[0].mlp.up_proj, GGUFLinear)  # the file's blocks
    # the same weights, summed in another order (gguf_qmm against the affine kernel): float32 sums
    # of at most 512 products per layer over 2 layers, as the other GGUF model comparisons
    want = _logits(from_gguf)
    torch.testing.assert_close(_logits(model), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("arch, head_dim", [("qwen2", None), ("qwen3", 128)])
def test_convert_qwen_gguf_to_mlx_and_transformers_gives_the_gguf_model(tmp_path, arch, head_dim):
    # qwen2 / qwen3 files (Q5_K and Q8_0 layers exact, Q6_K decoded): mlx_lm's own qwen models read
    # the MLX folder, transformers' Qwen classes the transformers one, and both give the logits of
    # the GGUF model load_gguf_llama builds (float32 sums in other orders: 1e-4 of the largest logit,
    # as in test_interop_mlx_lm.py).
    import mlx_lm.utils as mlx_lm_utils

    import torch_qmm.interop.transformers  # noqa: F401  (from_pretrained of a torch_qmm folder)
    from test_interop_gguf_llama import QWEN_MIX, qwen_model
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf

    path = tmp_path / "m.gguf"
    write_llama_gguf(qwen_model(arch, tied=False, head_dim=head_dim), path, QWEN_MIX, np.random.default_rng(4))
    f = GGUFFile(path)
    ours = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(ours, f)
    want = _logits(ours)[0]
    scale = want.abs().max().item()
    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    mlx_model, mlx_config = mlx_lm_utils.load_model(tmp_path / "mlx")
    assert mlx_config["model_type"] == arch
    got = torch.from_numpy(np.array(mlx_model(mx.array(IDS.numpy())).astype(mx.float32)))[0]
    assert (got - want).abs().max().item() < 1e-4 * scale
    assert main(["convert", str(path), str(tmp_path / "hf")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reloaded.config.model_type == arch and reloaded.config.head_dim == ours.config.head_dim
    assert (_logits(reloaded)[0] - want).abs().max().item() < 1e-4 * scale


@pytest.mark.parametrize("arch, down", [("qwen3moe", "Q4_K"), ("qwen2moe", "Q6_K"), ("mixtral", "Q4_K"),
                                        ("qwen2moe", "Q8_0")])
def test_convert_moe_gguf_to_mlx_and_transformers_gives_the_gguf_model(tmp_path, arch, down):
    # Q4_K experts (all three projections) are written exact as affine 4-bit group-32 experts; a Q6_K
    # down projection has no exact affine form, so that block's experts are written float, as gguf
    # decodes them; a Q8_0 one (llama.cpp's fallback where the expert width is no multiple of 256)
    # exact as 8-bit beside 4-bit gate / up, which the transformers folder's config records per
    # projection. mlx_lm's own MoE models read the MLX folder, transformers' the other, and both
    # give the logits of the GGUF model load_gguf_llama builds (1e-4 of the largest logit, as above).
    import mlx_lm.utils as mlx_lm_utils

    import torch_qmm.interop.transformers  # noqa: F401  (from_pretrained of a torch_qmm folder)
    from test_interop_gguf_moe import IDS as MOE_IDS, MODEL_TYPES as MOE_TYPES, moe_model, write_moe_gguf
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf
    from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

    path = tmp_path / "m.gguf"
    types = {"gate_exps": T.Q4_K, "up_exps": T.Q4_K, "down_exps": getattr(T, down), "proj": T.Q8_0}
    write_moe_gguf(moe_model(arch, 256), path, types, np.random.default_rng(9))
    f = GGUFFile(path)
    ours = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(ours, f)
    with torch.no_grad():
        want = ours(MOE_IDS).logits[0]
    scale = want.abs().max().item()
    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    mlx_model, mlx_config = mlx_lm_utils.load_model(tmp_path / "mlx")
    assert mlx_config["model_type"] == MOE_TYPES[arch]
    got = torch.from_numpy(np.array(mlx_model(mx.array(MOE_IDS.numpy())).astype(mx.float32)))[0]
    assert (got - want).abs().max().item() < 1e-4 * scale
    assert main(["convert", str(path), str(tmp_path / "hf")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    experts = reloaded.model.layers[0].mlp.experts
    if down in ("Q4_K", "Q8_0"):
        assert isinstance(experts, QuantFusedExperts) and isinstance(experts.down_proj, QuantSwitchLinear)
        assert (experts.gate_up_proj.bits, experts.down_proj.bits, experts.down_proj.group_size) == (
            4, 4 if down == "Q4_K" else 8, 32)
    else:
        assert not isinstance(experts, QuantFusedExperts)
    with torch.no_grad():
        assert (reloaded(MOE_IDS).logits[0] - want).abs().max().item() < 1e-4 * scale


@pytest.mark.parametrize("arch, experts", [("qwen3moe", "F32"), ("mixtral", "F16"), ("qwen2moe", "Q6_K gate / up")])
def test_convert_moe_gguf_with_float_experts_narrower_than_the_hidden_size(tmp_path, arch, experts):
    # Experts of intermediate size 128 beside hidden size 256 (real MoE models' experts are narrower
    # than H), stored float (F32, F16) or written float (Q6_K gate / up beside a Q8_0 down: no exact
    # affine form, so the block is decoded): gate / up [E, I, H] and down [E, H, I] keep their own
    # orientation in both folders. Reference: the transformers model holding the weights the gguf
    # package decodes from the file (no torch_qmm code). Both folders hold the experts' weights bit
    # for bit; the logits, summed in other orders (mlx_lm; the Q8_0 attention layers' kernels), to
    # 1e-4 of the largest logit, as above.
    import mlx_lm.utils as mlx_lm_utils

    import torch_qmm.interop.transformers  # noqa: F401  (from_pretrained of a torch_qmm folder)
    from test_interop_gguf_moe import EXPERTS as MOE_EXPERTS, HIDDEN as MOE_HIDDEN, IDS as MOE_IDS, moe_model, write_moe_gguf

    inter = 128
    assert inter != MOE_HIDDEN
    types = {"F32": {"proj": T.Q8_0}, "F16": {"gate_exps": T.F16, "up_exps": T.F16, "down_exps": T.F16},
             "Q6_K gate / up": {"gate_exps": T.Q6_K, "up_exps": T.Q6_K, "down_exps": T.Q8_0, "proj": T.Q8_0}}[experts]
    path = tmp_path / "m.gguf"
    held = write_moe_gguf(moe_model(arch, inter), path, types, np.random.default_rng(21))
    reference = moe_model(arch, inter)
    reference.load_state_dict(held)
    with torch.no_grad():
        want = reference(MOE_IDS).logits[0]
    scale = want.abs().max().item()

    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    fused = {"gate": held["model.layers.1.mlp.experts.gate_up_proj"][:, :inter],
             "up": held["model.layers.1.mlp.experts.gate_up_proj"][:, inter:],
             "down": held["model.layers.1.mlp.experts.down_proj"]}
    mlp = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for part, w in fused.items():
        stored = torch.from_numpy(np.array(weights[f"model.layers.1.{mlp}.switch_mlp.{part}_proj.weight"]))
        assert stored.shape == ((MOE_EXPERTS, inter, MOE_HIDDEN) if part != "down" else
                                (MOE_EXPERTS, MOE_HIDDEN, inter)), part
        assert torch.equal(stored, w), part
    mlx_model, _ = mlx_lm_utils.load_model(tmp_path / "mlx")
    got = torch.from_numpy(np.array(mlx_model(mx.array(MOE_IDS.numpy())).astype(mx.float32)))[0]
    assert (got - want).abs().max().item() < 1e-4 * scale

    assert main(["convert", str(path), str(tmp_path / "hf")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    experts_module = reloaded.model.layers[1].mlp.experts
    assert torch.equal(experts_module.gate_up_proj, held["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(experts_module.down_proj, held["model.layers.1.mlp.experts.down_proj"])
    with torch.no_grad():
        assert (reloaded(MOE_IDS).logits[0] - want).abs().max().item() < 1e-4 * scale


@pytest.mark.parametrize("gate_up, down, proj", [("Q4_K", "Q6_K", "Q8_0"), ("Q6_K", "Q4_K", "Q8_0"),
                                                 ("Q6_K", "Q6_K", "Q8_0"), ("Q4_K", "Q6_K", "F16")])
def test_requantize_rest_keeps_the_exact_projection_of_a_moe_block(tmp_path, capsys, gate_up, down, proj):
    """A MoE block with one projection of an exact affine form (Q4_K) and one without (Q6_K; llama.cpp's
    Q4_K_M files keep down Q6_K beside Q4_K gate / up in some blocks): --requantize rest re-quantizes
    the second alone (both where neither has one). In the MLX folder an exact projection is the
    file's weights (mx.dequantize of it equals the gguf package's decode of the file), a re-quantized
    one mx.quantize of that decode; mlx_lm reads the folder; the transformers folder holds the same
    formats at its group size, 32, also where the block's projections are the only exact layers
    (proj F16: the other linear layers are float)."""
    import mlx_lm.utils as mlx_lm_utils
    from gguf import GGUFReader
    from gguf import quants as gguf_quants

    import torch_qmm.interop.transformers  # noqa: F401  (from_pretrained of a torch_qmm folder)
    from test_interop_gguf_moe import IDS as MOE_IDS, moe_model, write_moe_gguf
    from torch_qmm.nn_moe import QuantFusedExperts

    path = tmp_path / "m.gguf"
    types = {"gate_exps": getattr(T, gate_up), "up_exps": getattr(T, gate_up), "down_exps": getattr(T, down),
             "proj": getattr(T, proj)}
    write_moe_gguf(moe_model("qwen2moe", 256), path, types, np.random.default_rng(3))
    decoded = {t.name: gguf_quants.dequantize(t.data, t.tensor_type) for t in GGUFReader(path).tensors
               if "_exps" in t.name}
    source = {"gate_up_proj": gate_up, "down_proj": down}
    exact = {p for p, t in source.items() if t == "Q4_K"}
    parts = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
    if len(exact) == 1:  # without --requantize the block is float, and the report says what rest would do
        (kept,), (other,) = exact, set(source) - exact
        assert main(["convert", str(path), str(tmp_path / "float"), "--format", "mlx"]) == 0
        assert (f"its {other} has no exact affine form: --requantize rest re-quantizes {other} alone, {kept} stays "
                "exact") in capsys.readouterr().out
    assert main(["convert", str(path), str(tmp_path / "mlx"), "--format", "mlx", "--requantize", "rest", "--bits", "6",
                 "--group-size", "64"]) == 0
    report = capsys.readouterr().out
    if exact:
        (kept,), (requantized,) = exact, set(source) - exact
        assert f"re-quantized {requantized} of experts gate {gate_up}, up {gate_up}, down {down} -> " in report
        assert f"({kept} lossless; {requantized}: no exact affine form)" in report
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    for block in range(2):
        for p in source:
            bits, group_size = (4, 32) if p in exact else (6, 64)
            for part in parts[p]:
                key = f"model.layers.{block}.mlp.switch_mlp.{part}_proj"
                w, scales, biases = (weights[f"{key}.{leaf}"] for leaf in ("weight", "scales", "biases"))
                want = decoded[f"blk.{block}.ffn_{part}_exps.weight"]
                if p in exact:
                    got = np.array(mx.dequantize(w, scales, biases, group_size=group_size, bits=bits))
                    np.testing.assert_array_equal(got, want)
                else:
                    for stored, theirs in zip((w, scales, biases),
                                              mx.quantize(mx.array(want), group_size=group_size, bits=bits)):
                        np.testing.assert_array_equal(np.array(stored), np.array(theirs))
    mlx_model, _ = mlx_lm_utils.load_model(tmp_path / "mlx")
    got = np.array(mlx_model(mx.array(MOE_IDS.numpy())).astype(mx.float32))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "mlx"))
    load_mlx(model.eval(), tmp_path / "mlx")
    with torch.no_grad():
        ours = model(MOE_IDS).logits
    assert (ours - torch.from_numpy(got)).abs().max().item() < 1e-4 * ours.abs().max().item()

    assert main(["convert", str(path), str(tmp_path / "hf"), "--requantize", "rest", "--bits", "6"]) == 0
    experts = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").model.layers[0].mlp.experts
    assert isinstance(experts, QuantFusedExperts)
    assert {p: (getattr(experts, p).bits, getattr(experts, p).group_size) for p in source} == {
        p: (4 if p in exact else 6, 32) for p in source}
    for p in exact:
        layer = getattr(experts, p)
        got = mx.dequantize(mx.array(layer.qweight.numpy()), mx.array(layer.scales.numpy()),
                            mx.array(layer.biases.numpy()), group_size=32, bits=4)
        rows = [decoded[f"blk.0.ffn_{part}_exps.weight"] for part in parts[p]]
        np.testing.assert_array_equal(np.array(got), np.concatenate(rows, axis=1))


def test_convert_gguf_to_transformers(gguf_path, tmp_path):
    out = tmp_path / "hf"
    assert main(["convert", str(gguf_path), str(out), "--requantize", "all", "--bits", "8", "--group-size", "32"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(reloaded.model.layers[0].self_attn.q_proj, QuantLinear)
    from_gguf = transformers.LlamaForCausalLM(reloaded.config)
    load_gguf_llama(from_gguf, GGUFFile(gguf_path))
    err = (_logits(reloaded) - _logits(from_gguf)).abs().max() / _logits(from_gguf).abs().max()
    assert err < 0.02  # re-quantized at 8 bits


def test_inspect_lists_layers_formats_and_bytes(gguf_path, tmp_path, capsys):
    assert main(["inspect", str(gguf_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    layers = {r["layer"]: r for r in report["layers"]}
    assert layers["blk.0.attn_q.weight"]["format"] == "Q8_0" and layers["token_embd.weight"]["format"] == "Q4_0"
    assert sum(r["bytes"] for r in report["layers"]) == sum(t.nbytes for t in GGUFFile(gguf_path).tensors.values())

    out = tmp_path / "mlx"
    main(["convert", str(gguf_path), str(out), "--format", "mlx"])
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj" in text and "affine b8 gs32" in text and "quantization=mlx" in text


def _saved_state_folder(folder):
    """A state_dict saved with safetensors (no config.json): QuantLinear layers of two formats, a
    GGUFLinear, a QuantEmbedding and a float layer."""
    from safetensors.torch import save_file

    from torch_qmm.interop import GGUFLinear

    torch.manual_seed(15)
    model = torch.nn.ModuleDict({
        "a": QuantLinear(64, 32, bits=8, group_size=32), "b": QuantLinear(128, 16, bits=3, group_size=64),
        "k": GGUFLinear(512, 4, int(T.Q6_K)), "e": QuantEmbedding(10, 64, bits=4, group_size=32),
        "m": QuantLinear(64, 8, mode="mxfp4"), "n": QuantEmbedding(10, 32, mode="nvfp4"),
        "f": torch.nn.Linear(8, 2)})
    folder.mkdir()
    save_file(model.state_dict(), folder / "model.safetensors")
    return folder


def test_inspect_shows_the_format_each_layer_saved(tmp_path, capsys):
    folder = _saved_state_folder(tmp_path / "state")
    assert main(["inspect", str(folder), "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert sorted(rows) == ["a", "b", "e", "f.bias", "f.weight", "k", "m", "n"]
    assert (rows["a"]["format"], rows["a"]["shape"]) == ("affine b8 gs32 (F32)", [32, 64])
    assert (rows["m"]["format"], rows["m"]["shape"]) == ("mxfp4 b4 gs32 (U8)", [8, 64])
    assert (rows["n"]["format"], rows["n"]["shape"]) == ("nvfp4 b4 gs16 (U8)", [10, 32])
    assert (rows["b"]["format"], rows["b"]["shape"]) == ("affine b3 gs64 (F32)", [16, 128])
    assert (rows["e"]["format"], rows["e"]["shape"]) == ("affine b4 gs32 (F32)", [10, 64])
    assert (rows["k"]["format"], rows["k"]["shape"]) == ("GGUF Q6_K", [4, 512])
    assert rows["k"]["bytes"] == 4 * 2 * 210 + 4  # two Q6_K super-blocks per row, the int32 type


def test_inspect_shows_a_saved_format_that_config_json_contradicts(tmp_path, capsys):
    folder = _saved_state_folder(tmp_path / "state")
    (folder / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "torch_qmm", "bits": 8, "group_size": 32}}))
    assert main(["inspect", str(folder), "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert rows["a"]["format"] == "affine b8 gs32 (F32)"
    assert rows["b"]["format"] == "affine b3 gs64 (F32; config.json says affine b8 gs32)"
    assert rows["m"]["format"] == "mxfp4 b4 gs32 (U8; config.json says affine b8 gs32)"


@pytest.mark.parametrize("bad", [torch.tensor([8.0, 32.0]), torch.zeros(2, 2, dtype=torch.int32),
                                 torch.zeros(5000, dtype=torch.int32)], ids=["float", "2-D", "long"])
def test_inspect_refuses_a_malformed_format_tensor(tmp_path, capsys, bad):
    from safetensors.torch import load_file, save_file

    folder = _saved_state_folder(tmp_path / "state")
    state = load_file(folder / "model.safetensors")
    save_file({**state, "a._extra_state": bad}, folder / "model.safetensors")
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors: tensor 'a._extra_state' must be an integer tensor" in err and len(err.splitlines()) == 1


def test_inspect_refuses_an_unsupported_saved_format(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _saved_state_folder(tmp_path / "state")
    state = load_file(folder / "model.safetensors")
    save_file({**state, "a._extra_state": torch.tensor([7, 32], dtype=torch.int32)}, folder / "model.safetensors")
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors: tensor 'a._extra_state' holds an unsupported format" in err and "bits" in err
    mode_codes = torch.tensor([4, 32, 120, 120, 0, 0, 0, 0, 0, 0], dtype=torch.int32)  # "xx"
    save_file({**state, "a._extra_state": mode_codes}, folder / "model.safetensors")
    assert main(["inspect", str(folder)]) == 1
    assert "holds an unsupported format: argument 'mode' must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [m for m, f in FORMATS.items() if not f.has_biases])
def test_convert_with_a_mode_to_mlx_and_to_transformers(hf_folder, tmp_path, capsys, mode):
    bits, group_size = FORMATS[mode].default_bits, FORMATS[mode].default_group_size
    out = tmp_path / "mlx"
    assert main(["convert", str(hf_folder), str(out), "--format", "mlx", "--mode", mode]) == 0
    assert f"{mode} b{bits} gs{group_size}" in capsys.readouterr().out
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["mode"], q["bits"], q["group_size"]) == (mode, bits, group_size)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_mlx(model, out)
    assert model.model.embed_tokens.mode == model.model.layers[0].mlp.up_proj.mode == mode
    from test_interop_mlx import assert_same_tensors

    assert_same_tensors(model, mx.load(str(out / "model.safetensors")))
    assert main(["inspect", str(out), "--json"]) == 0
    rows = {r["layer"]: r["format"] for r in json.loads(capsys.readouterr().out)["layers"]}
    assert rows["model.layers.0.mlp.up_proj"] == f"{mode} b{bits} gs{group_size} (U8)"

    hf_out = tmp_path / "hf"
    assert main(["convert", str(hf_folder), str(hf_out), "--mode", mode]) == 0
    capsys.readouterr()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_out)
    expected = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, quantization_config=TorchQmmConfig(mode=mode))
    assert reloaded.model.layers[0].mlp.up_proj.mode == mode
    assert torch.equal(_logits(reloaded), _logits(expected))
    assert main(["inspect", str(hf_out), "--json"]) == 0
    rows = {r["layer"]: r["format"] for r in json.loads(capsys.readouterr().out)["layers"]}
    assert rows["model.layers.0.mlp.up_proj"] == f"{mode} b{bits} gs{group_size} (U8)"


def test_convert_mode_arguments_are_checked(hf_folder, tmp_path, capsys):
    assert main(["convert", str(hf_folder), str(tmp_path / "o"), "--mode", "mxfp4", "--bits", "8"]) == 2
    assert "--bits must be 4, got 8 (--mode 'mxfp4')" in capsys.readouterr().err
    assert main(["convert", str(hf_folder), str(tmp_path / "o"), "--mode", "nvfp4", "--method", "mse"]) == 2
    assert "--method mse writes the affine format; --mode nvfp4 is quantized with --method rtn" in capsys.readouterr().err


def test_inspect_and_convert_bad_input(tmp_path, capsys):
    """One line on stderr naming the file or argument; exit 1 for a bad file, 2 for a bad argument."""
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(30))
    assert main(["inspect", str(tmp_path / "bad.gguf")]) == 1
    err = capsys.readouterr().err
    assert "bad.gguf: GGUF version 0 is not supported" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main(["convert", str(tmp_path / "bad.gguf"), str(tmp_path / "out"), "--bits", "7"])
    assert e.value.code == 2 and "argument --bits: invalid choice: 7" in capsys.readouterr().err


def test_inspect_reads_per_layer_bits_of_a_torch_qmm_config_and_says_when_there_is_none(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _saved_state_folder(tmp_path / "state")
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.endswith("._extra_state")}
    save_file({k: v for k, v in state.items() if k.split(".")[0] in ("a", "b", "f")}, folder / "model.safetensors")
    assert main(["inspect", str(folder), "--json"]) == 0  # no saved format, no config.json
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert (rows["a"]["format"], rows["a"]["shape"]) == ("affine (no config)", [32, 16])
    (folder / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "torch_qmm", "bits": {"*": 3, "a": 8}, "group_size": 64}}))
    # one group size for the folder: 64, b's; a (8 bits, 16 words and 2 scales a row) is read by its
    # own entry, b by "*"
    assert main(["inspect", str(folder), "--json"]) == 1
    assert "layer 'a': qweight [32, 16] does not fit its scales [32, 2]: affine b8 gs64 packs 128 values per row " \
           "in 32 words" in capsys.readouterr().err
    save_file({k: v for k, v in state.items() if k.split(".")[0] in ("b", "f")}, folder / "model.safetensors")
    assert main(["inspect", str(folder), "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert (rows["b"]["format"], rows["b"]["shape"]) == ("affine b3 gs64 (F32)", [16, 128])
    (folder / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "torch_qmm", "bits": {"*": 8, "b": 3}, "group_size": 64}}))
    assert main(["inspect", str(folder), "--json"]) == 0  # b's own entry, not "*"'s 8 bits
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert (rows["b"]["format"], rows["b"]["shape"]) == ("affine b3 gs64 (F32)", [16, 128])


@pytest.mark.parametrize("bad", ["scales", "biases"])
def test_inspect_refuses_scales_or_biases_that_do_not_fit_the_codes(tmp_path, capsys, bad):
    """A layer config.json calls quantized whose scales (or biases) are not [N, K / group_size] beside
    its codes [N, words], say transposed: load_mlx refuses it, and so does inspect (with or without
    --verify), naming the layer, instead of listing it as an unconfigured one."""
    from safetensors.torch import save_file

    folder = tmp_path / "mlx"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization": {"bits": 4, "group_size": 32}}))
    good = torch.zeros(32, 4)  # 32 rows of 128 values: 4 groups of 32, 16 words of 4-bit codes
    tensors = {"a.weight": torch.zeros(32, 16, dtype=torch.int32), "a.scales": good, "a.biases": good}
    tensors[f"a.{bad}"] = good.t().contiguous()
    save_file(tensors, folder / "model.safetensors")
    for verify in ([], ["--verify"]):
        assert main(["inspect", str(folder), *verify]) == 1
        err = capsys.readouterr().err
        assert {"scales": "layer 'a': scales [4, 32] do not fit weight [32, 16]: affine b4 gs32 needs scales [32, 4]",
                "biases": "layer 'a': biases [4, 32] do not fit scales [32, 4]: one bias per scale"}[bad] in err, err
    model = torch.nn.Sequential()
    model.add_module("a", torch.nn.Linear(128, 32, bias=False))
    with pytest.raises(ValueError, match="'a'"):
        load_mlx(model, folder)


@pytest.mark.parametrize("ggml_type, blocks, message", [
    (8, None, r"holds GGUF type 8 \(Q8_0\); GGUFLinear holds Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"),
    (14, torch.zeros(4, 419, dtype=torch.uint8), r"tensor 'k.blocks' of Q6_K blocks must be \[rows, a multiple of 210\], "
                                                  r"got \[4, 419\]"),
], ids=["type", "blocks"])
def test_inspect_refuses_gguf_blocks_it_cannot_describe(tmp_path, capsys, ggml_type, blocks, message):
    from safetensors.torch import load_file, save_file

    folder = _saved_state_folder(tmp_path / "state")
    state = load_file(folder / "model.safetensors")
    state["k._extra_state"] = torch.tensor([ggml_type], dtype=torch.int32)
    if blocks is not None:
        state["k.blocks"] = blocks
    save_file(state, folder / "model.safetensors")
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("writer", ["mlx_lm", "torch_qmm"])
def test_inspect_shows_stacked_experts_like_two_dimensional_weights(writer, tmp_path, capsys):
    # MoE experts are stored stacked: words [E, N, K*bits/32], scales [E, N, K/group_size]. Their
    # rows show the format and the logical shape [E, N, K], as a 2-D weight's do.
    from moe_helpers import tiny_moe

    if writer == "mlx_lm":  # mlx_lm quantizes and saves; its own modules are the reference
        import mlx_lm.utils as mlx_lm_utils
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear
        from test_moe_mlx_lm import mlx_lm_quantized_folder

        folder = mlx_lm_quantized_folder("mixtral", "affine", tmp_path)
        theirs, _ = mlx_lm_utils.load_model(folder)
        want = {name: (f"affine b{m.bits} gs{m.group_size} (F32)", [m.num_experts, m.output_dims, m.input_dims])
                for name, m in theirs.named_modules() if isinstance(m, QuantizedSwitchLinear)}
    else:  # transformers quantizes (TorchQmmConfig) and saves; the float model's expert tensors are the reference
        model = tiny_moe("mixtral")
        model.save_pretrained(tmp_path / "float")
        want = {name: ("affine b4 gs32 (F32)", list(p.shape)) for name, p in model.named_parameters() if p.dim() == 3}
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "float", quantization_config=TorchQmmConfig(bits=4, group_size=32), dtype=torch.float32)
        folder = tmp_path / "hf"
        quantized.save_pretrained(folder)
    assert len(want) == 2 * (3 if writer == "mlx_lm" else 2)
    capsys.readouterr()
    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # transformers saves Mixtral's MoE block (the model's `mlp`) under the checkpoint name block_sparse_moe
    rows = {r["layer"]: (r["format"], r["shape"]) for r in report["layers"]}
    rows.update({name.replace(".block_sparse_moe.", ".mlp."): row for name, row in rows.items()})
    assert {name: rows.get(name) for name in want} == want
    assert not any(kind == "affine" or "no config" in kind for kind in report["totals"]), report["totals"]


@pytest.mark.parametrize("tensors", [1, 400])
def test_inspect_into_a_pipe_nobody_reads_stops_quietly(tmp_path, tensors):
    # `inspect ... | head`: the reader closes the pipe before the table is written. One tensor: the
    # table is written at the final flush; 400: while the table is printed.
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({f"t{i}": torch.zeros(2, 2) for i in range(tensors)}, tmp_path / "m.safetensors")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout holding torch_qmm
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "torch_qmm", "inspect", str(tmp_path / "m.safetensors")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert (p.wait(timeout=120), err) == (141, "")  # 128 + SIGPIPE, as a shell's commands exit
