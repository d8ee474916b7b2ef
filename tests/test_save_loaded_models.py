"""Saving a transformers model that load_gguf_llama / load_mlx filled with torch_qmm layers.

save_pretrained of such a model either writes a folder from_pretrained rebuilds into the same
layers (a quantization_config recorded by the loader: QuantLinear and QuantEmbedding layers, a
head tied to a quantized embedding) or one whose reload is a ValueError saying why (GGUFLinear
layers, which a quantization_config cannot describe), never one transformers reloads with random
weights in place of those layers. save_mlx refuses GGUFLinear layers (GGUF blocks, which MLX cannot read).
The expected logits come from the same architecture holding the file's weights as the gguf
package decodes them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from test_interop_gguf_llama import hf_model, write_llama_gguf
from torch_qmm.interop import GGUFLinear, QuantEmbedding, load_mlx, save_mlx
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
from torch_qmm.nn import QuantLinear

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2]])
AFFINE_LINEARS = {"q_proj": T.Q8_0, "k_proj": T.Q4_0, "v_proj": T.Q5_1, "o_proj": T.Q4_1, "gate_proj": T.Q5_0,
                  "up_proj": T.Q8_0, "down_proj": T.Q4_0}


def load(path, on_meta: bool):
    f = GGUFFile(path)
    if on_meta:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config_from_gguf(f))
    else:
        model = transformers.LlamaForCausalLM(llama_config_from_gguf(f))
    load_gguf_llama(model, f, progress=False)
    return model.eval()


def expected_logits(held, tied: bool) -> torch.Tensor:
    model = hf_model(tied)
    model.load_state_dict(held, strict=False)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        return model(IDS).logits


# Float embedding and head, every linear layer of a 32-weight type (QuantLinear); with a Q8_0
# embedding (a QuantEmbedding) tied to the head (TiedQuantLinear), or a Q4_0 embedding and a Q8_0
# head of their own.
RELOADABLE = {"affine-linears": (AFFINE_LINEARS, False),
              "quantized-embedding-tied": ({**AFFINE_LINEARS, "embed": T.Q8_0}, True),
              "quantized-embedding-and-head": ({**AFFINE_LINEARS, "embed": T.Q4_0, "lm_head": T.Q8_0}, False)}


def check_reloaded(reloaded, types, tied):
    layer = reloaded.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantLinear) and layer.self_attn.q_proj.bits == 8
    assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.bits == 4
    embedding, head = reloaded.model.embed_tokens, reloaded.lm_head
    if "embed" not in types:
        assert type(embedding) is torch.nn.Embedding and type(head) is torch.nn.Linear
    else:
        assert isinstance(embedding, QuantEmbedding) and embedding.bits == (8 if types["embed"] == T.Q8_0 else 4)
        assert (head.embedding is embedding) if tied else (isinstance(head, QuantLinear) and head.bits == 8)


@pytest.mark.parametrize("on_meta", [False, True])
@pytest.mark.parametrize("case", RELOADABLE)
def test_save_pretrained_of_a_gguf_model_with_affine_layers_reloads_them(tmp_path, on_meta, case):
    types, tied = RELOADABLE[case]
    held = write_llama_gguf(hf_model(tied=tied), tmp_path / "m.gguf", types, np.random.default_rng(0))
    model = load(tmp_path / "m.gguf", on_meta)
    model.save_pretrained(tmp_path / "out")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    check_reloaded(reloaded, types, tied)
    with torch.no_grad():
        got = reloaded(IDS).logits
    want = expected_logits(held, tied=tied)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_save_pretrained_of_a_gguf_model_a_config_cannot_describe_does_not_reload_random_weights(tmp_path):
    write_llama_gguf(hf_model(tied=True), tmp_path / "m.gguf", {**AFFINE_LINEARS, "down_proj": T.Q4_K},
                     np.random.default_rng(0))
    model = load(tmp_path / "m.gguf", on_meta=True)
    odd = "model.layers.0.mlp.down_proj"
    assert isinstance(model.get_submodule(odd), GGUFLinear)
    model.save_pretrained(tmp_path / "out")

    with pytest.raises(ValueError, match=r"from_pretrained cannot rebuild") as e:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert odd in str(e.value) and "load_gguf_llama" in str(e.value)
    # save_mlx refuses GGUF blocks: convert is the way, not save_mlx
    assert "save_mlx" not in str(e.value) and "torch_qmm convert" in str(e.value)


@pytest.mark.parametrize("case", ["quantized-embedding-tied", "quantized-embedding-and-head"])
def test_save_pretrained_of_an_mlx_folder_with_a_quantized_embedding_reloads(tmp_path, case):
    types, tied = RELOADABLE[case]
    held = write_llama_gguf(hf_model(tied=tied), tmp_path / "m.gguf", types, np.random.default_rng(0))
    save_mlx(load(tmp_path / "m.gguf", on_meta=True), tmp_path / "mlx")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "mlx")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    load_mlx(model, tmp_path / "mlx", progress=False)
    want = expected_logits(held, tied=tied)
    with torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization" not in saved and saved["quantization_config"]["quant_method"] == "torch_qmm"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    check_reloaded(reloaded, types, tied)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, got)
    # a torch_qmm folder, not an MLX one: convert writes it back to MLX, the layers as they are
    from torch_qmm.__main__ import main

    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "mlx-again"), "--format", "mlx"]) == 0
    with torch.device("meta"):
        again = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "mlx-again"))
    load_mlx(again, tmp_path / "mlx-again", progress=False)
    with torch.no_grad():
        assert torch.equal(again.eval()(IDS).logits, got)


def test_save_mlx_refuses_gguf_blocks(tmp_path):
    write_llama_gguf(hf_model(tied=False), tmp_path / "m.gguf", {**AFFINE_LINEARS, "down_proj": T.Q6_K},
                     np.random.default_rng(0))
    model = load(tmp_path / "m.gguf", on_meta=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj \(Q6_K\).*convert") as e:
        save_mlx(model, tmp_path / "mlx")
    assert "GGUFLinear" in str(e.value)
    assert not (tmp_path / "mlx").exists()


def test_convert_of_an_mlx_folder_says_it_reads_no_mlx_folders(tmp_path, capsys):
    from torch_qmm import quantize_model
    from torch_qmm.__main__ import main

    model = hf_model(tied=False)
    quantize_model(model, bits=4, group_size=64)
    save_mlx(model, tmp_path / "mlx")  # config.json with MLX's "quantization" (and quantization_config) entry
    for fmt in ("transformers", "mlx"):
        assert main(["convert", str(tmp_path / "mlx"), str(tmp_path / f"out-{fmt}"), "--format", fmt]) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path / 'mlx'} is an MLX folder" in err and "load_mlx" in err and "quant_method" not in err
        assert not (tmp_path / f"out-{fmt}").exists()


def gpt2_folder(path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj"]


def test_quantize_model_names_the_conv1d_layers_it_leaves_float(tmp_path):
    from torch_qmm import quantize_model

    conv1d = gpt2_folder(tmp_path / "gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    assert all(type(model.get_submodule(n)).__name__ == "Conv1D" for n in conv1d)
    with pytest.warns(UserWarning, match=r"transformer\.h\.0\.attn\.c_attn \(a transformers Conv1D"):
        summary = quantize_model(model, bits=4, group_size=64)
    assert set(conv1d) <= set(summary.skipped) and not summary.converted


@pytest.mark.parametrize("fmt", ["transformers", "mlx"])
def test_convert_reports_the_conv1d_layers_it_leaves_float(tmp_path, fmt, capsys):
    from torch_qmm.__main__ import main

    conv1d = gpt2_folder(tmp_path / "gpt2")
    assert main(["convert", str(tmp_path / "gpt2"), str(tmp_path / "out")] + ["--format", fmt]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in conv1d:
        assert any(line.split() and line.split()[0] == name and "Conv1D" in line and "kept float" in line
                   for line in lines), name
