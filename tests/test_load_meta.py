"""Loading a quantized checkpoint into a model built on the meta device (load_mlx, load_gguf_llama,
load_mxfp4_checkpoint):
the loaded model computes bit for bit what the same file loaded into a model built in float
computes, holds no meta tensor, and the load peaks near the file's size instead of the float
model's. Files without a tensor the model needs, and computed buffers no initialization can
compute, are errors naming them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from torch_qmm.convert import quantize_model
from torch_qmm.interop import QuantEmbedding, TiedQuantLinear, load_mlx, save_mlx
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
from torch_qmm.interop.meta import compute_buffers, meta_tensors
from torch_qmm.interop.mxfp4_blocks import load_mxfp4_checkpoint
from torch_qmm.nn import QuantLinear
from torch_qmm.nn_moe import QuantFusedExperts

transformers = pytest.importorskip("transformers")

from test_interop_gguf_llama import MIXES, hf_model, write_llama_gguf  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2, 17, 64, 3, 80]])
TESTS = Path(__file__).parent


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def assert_same_model(meta_built: nn.Module, float_built: nn.Module) -> None:
    """Same modules, same tensors bit for bit (the non-persistent buffers included), none on meta."""
    assert meta_tensors(meta_built) == []
    assert [type(m) for m in meta_built.modules()] == [type(m) for m in float_built.modules()]
    a = dict(meta_built.named_buffers(remove_duplicate=False))
    b = dict(float_built.named_buffers(remove_duplicate=False))
    a.update(meta_built.state_dict())
    b.update(float_built.state_dict())
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
            assert torch.equal(a[k], b[k]), k


def assert_rotary_as_transformers_computes(model: nn.Module, config) -> None:
    """The rotary embedding's computed frequencies are those transformers computes (and keeps in
    float32 whatever the model's dtype, as from_pretrained does): the same model class built from
    the config, never cast. A loader casting them to bfloat16 moves the angles of far positions."""
    reference = type(model)(config).model.rotary_emb
    for name in ("inv_freq", "original_inv_freq"):
        got, want = getattr(model.model.rotary_emb, name), getattr(reference, name)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), name


def assert_rotary_matters(model: nn.Module, want: torch.Tensor) -> None:
    """The logit comparison sees a wrong rotary embedding: frequencies off by 4 units in the last
    place of the logits' dtype (about 5e-7 relative in float32, 3e-2 in bfloat16) change the
    logits. So equal logits of the meta-built model mean its recomputed frequencies are the
    float-built one's."""
    rotary = model.model.rotary_emb
    saved = rotary.inv_freq.clone()
    with torch.no_grad():
        rotary.inv_freq.mul_(1 + 4 * torch.finfo(want.dtype).eps)
    try:
        assert not torch.equal(rotary.inv_freq, saved)
        assert not torch.equal(logits(model), want)
    finally:
        with torch.no_grad():
            rotary.inv_freq.copy_(saved)


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mix", list(MIXES))
def test_gguf_meta_built_load_equals_the_float_built_load(tmp_path, mix, tied, dtype):
    write_llama_gguf(hf_model(tied), tmp_path / "m.gguf", MIXES[mix], np.random.default_rng(1))
    f = GGUFFile(tmp_path / "m.gguf")
    float_built = transformers.LlamaForCausalLM(llama_config_from_gguf(f)).eval()
    load_gguf_llama(float_built, f, dtype=dtype)
    with torch.device("meta"):
        meta_built = transformers.LlamaForCausalLM(llama_config_from_gguf(f)).eval()
    report = load_gguf_llama(meta_built, f, dtype=dtype)

    want = logits(float_built)
    assert torch.equal(logits(meta_built), want)
    assert_rotary_matters(meta_built, want)
    for built in (float_built, meta_built):
        assert_rotary_as_transformers_computes(built, llama_config_from_gguf(f))
    assert_same_model(meta_built, float_built)
    if tied:  # the output layer is the embedding's table, one tensor
        assert report.tied == ["lm_head -> model.embed_tokens"]
        if isinstance(meta_built.lm_head, TiedQuantLinear):
            assert meta_built.lm_head.embedding is meta_built.model.embed_tokens
        else:
            assert meta_built.lm_head.weight is meta_built.model.embed_tokens.weight


def test_gguf_meta_built_model_without_a_tensor_in_the_file_names_it(tmp_path):
    write_llama_gguf(hf_model(False), tmp_path / "m.gguf", MIXES["q8_0"], np.random.default_rng(1),
                     drop=("blk.1.ffn_norm.weight",))
    config = hf_model(False).config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"m.gguf: the file has no tensors for "
                                         r"\['model.layers.1.post_attention_layernorm.weight'\]"):
        load_gguf_llama(model, tmp_path / "m.gguf")
    # without strict, the norm the file lacks is still on meta after the load: an error naming it
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"load_gguf_llama: .*m.gguf: the model was built on the meta device and 1 "
                                         r"of its tensors have no values after the load \(the file does not hold "
                                         r"them\): \['model.layers.1.post_attention_layernorm.weight'\]"):
        load_gguf_llama(model, tmp_path / "m.gguf", strict=False)


def test_device_is_for_meta_built_models(tmp_path):
    write_llama_gguf(hf_model(False), tmp_path / "m.gguf", {}, np.random.default_rng(1))
    model = transformers.LlamaForCausalLM(hf_model(False).config)
    with pytest.raises(ValueError, match=r"load_gguf_llama: argument 'device' applies to a model built on the meta "
                                         r"device .* move it with model.to\('cpu'\) instead"):
        load_gguf_llama(model, tmp_path / "m.gguf", device="cpu")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_model(False).config)
    with pytest.raises(ValueError, match=r"load_gguf_llama: argument 'device' must be a device that holds values"):
        load_gguf_llama(model, tmp_path / "m.gguf", device="meta")
    load_gguf_llama(model, tmp_path / "m.gguf", device=torch.device("cpu"))
    assert meta_tensors(model) == [] and model.lm_head.weight.device == torch.device("cpu")


# ---------------------------------------------------------------- MLX


def _llama_config(tied: bool):
    # llama3 rotary scaling, so that the frequencies are computed by their rope type, not the default
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )


def _saved_llama(folder: Path, tied: bool, dtype: torch.dtype, quantized_embedding: bool) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(tied)).eval().to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    quantize_model(model, bits=4, group_size=32)
    if quantized_embedding:
        model.model.embed_tokens = QuantEmbedding.from_embedding(model.model.embed_tokens, bits=8, group_size=32)
        if tied:
            model.lm_head = TiedQuantLinear(model.model.embed_tokens)
    save_mlx(model, folder)
    return folder


@pytest.mark.filterwarnings("ignore:quantize_model skipped lm_head")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied,quantized_embedding", [(False, False), (True, False), (True, True)])
def test_mlx_meta_built_load_equals_the_float_built_load(tmp_path, tied, quantized_embedding, dtype):
    folder = _saved_llama(tmp_path, tied, dtype, quantized_embedding)
    config = transformers.AutoConfig.from_pretrained(folder)
    float_built = transformers.AutoModelForCausalLM.from_config(config).eval()
    load_mlx(float_built, folder)
    with torch.device("meta"):
        meta_built = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = load_mlx(meta_built, folder)

    assert meta_built.model.rotary_emb.rope_type == "llama3"
    want = logits(float_built)
    assert torch.equal(logits(meta_built), want)
    assert_rotary_matters(meta_built, want)
    for built in (float_built, meta_built):
        assert_rotary_as_transformers_computes(built, config)
    assert_same_model(meta_built, float_built)
    assert isinstance(meta_built.model.layers[0].mlp.down_proj, QuantLinear)
    if tied and quantized_embedding:
        assert report.tied == ["lm_head -> model.embed_tokens"]
        assert meta_built.lm_head.embedding is meta_built.model.embed_tokens
    elif tied:
        assert meta_built.lm_head.weight is meta_built.model.embed_tokens.weight


def test_mlx_folder_written_by_mlx_loads_into_a_meta_built_model(tmp_path):
    mx = pytest.importorskip("mlx.core")  # noqa: F841
    from test_interop_mlx import TorchToy, _mlx_quantized_toy, _save_mlx_checkpoint

    quant = {"group_size": 64, "bits": 4}
    _save_mlx_checkpoint(_mlx_quantized_toy(True, torch.float32, quant), tmp_path, quant)
    float_built = TorchToy(True)
    load_mlx(float_built, tmp_path)
    with torch.device("meta"):
        meta_built = TorchToy(True)
    load_mlx(meta_built, tmp_path)
    assert_same_model(meta_built, float_built)
    ids = IDS.clamp(max=95)
    with torch.no_grad():
        assert torch.equal(meta_built(ids), float_built(ids))


@pytest.mark.parametrize("case", ["mlx_lm_qwen3_moe", "float_qwen3_moe", "quantized_gpt_oss"])
def test_mlx_moe_meta_built_load_equals_the_float_built_load(tmp_path, case):
    pytest.importorskip("mlx_lm")
    from moe_helpers import FAMILIES, tiny_moe

    if case == "mlx_lm_qwen3_moe":  # written by mlx_lm: quantized experts, the router dequantized
        from test_moe_mlx_lm import mlx_lm_quantized_folder

        folder = mlx_lm_quantized_folder("qwen3_moe", "affine", tmp_path)
        family = "qwen3_moe"
    else:
        family = case.split("_", 1)[1]
        model = tiny_moe(family)
        if case.startswith("quantized"):
            quantize_model(model, group_size=32)
        folder = tmp_path / "mlx"
        save_mlx(model, folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    float_built = FAMILIES[family][1](config).eval()
    report = load_mlx(float_built, folder)
    with torch.device("meta"):
        meta_built = FAMILIES[family][1](config).eval()
    assert load_mlx(meta_built, folder).quantized == report.quantized
    assert any(isinstance(m, QuantFusedExperts) for m in meta_built.modules()) == (case != "float_qwen3_moe")
    ids = IDS.clamp(max=config.vocab_size - 1)
    assert torch.equal(logits(meta_built, ids), logits(float_built, ids))
    assert_same_model(meta_built, float_built)


def test_mlx_meta_built_model_without_a_tensor_in_the_checkpoint_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _saved_llama(tmp_path, False, torch.float32, False)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "mlx"})
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"with0: checkpoint does not match the model: missing "
                                         r"\['model.norm.weight'\]"):
        load_mlx(model, folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"load_mlx: .*with0: the model was built on the meta device "
                                         r"and 1 of its tensors have no values after the load .*"
                                         r"\['model.norm.weight'\]"):
        load_mlx(model, folder, strict=False)


# ---------------------------------------------------------------- gpt-oss mxfp4


def write_gpt_oss_mxfp4(folder: Path, config, dtype: torch.dtype = torch.float32, seed: int = 0,
                        drop: tuple[str, ...] = ()) -> Path:
    """A gpt-oss mxfp4 checkpoint of `config` (transformers' layout: the experts as random
    `*_blocks` / `*_scales`, every other tensor random float of `dtype`), written without building
    the float model; the tensors named in `drop` left out."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.GptOssForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k, shape in shapes.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            e, cols, rows = shape
            tensors[f"{k}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            tensors[f"{k}_scales"] = torch.randint(119, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        elif "norm" in k:
            tensors[k] = torch.rand(shape, generator=g) * 0.6 + 0.7
        else:
            std = 0.5 if "embed" in k or "lm_head" in k else 0.1 if k.endswith(("bias", "sinks")) else shape[-1] ** -0.5
            tensors[k] = torch.randn(shape, generator=g) * std
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items() if k not in drop}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config.to_dict(),
                                                    "quantization_config": {"quant_method": "mxfp4"}}))
    return folder


def _tiny_gpt_oss_config():
    from moe_helpers import tiny_moe

    return tiny_moe("gpt_oss").config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_meta_built_load_equals_the_float_built_load(tmp_path, dtype):
    folder = write_gpt_oss_mxfp4(tmp_path, _tiny_gpt_oss_config(), dtype)
    config = transformers.AutoConfig.from_pretrained(folder)
    float_built = transformers.GptOssForCausalLM(config).eval()
    report = load_mxfp4_checkpoint(float_built, folder)
    with torch.device("meta"):
        meta_built = transformers.GptOssForCausalLM(config).eval()
    assert load_mxfp4_checkpoint(meta_built, folder).quantized == report.quantized
    assert len(report.quantized) == config.num_hidden_layers
    for layer in meta_built.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, QuantFusedExperts) and experts.gate_up_proj.mode == "mxfp4"
        assert experts.gate_up_proj.qweight.device == torch.device("cpu")

    want = logits(float_built)
    assert torch.equal(logits(meta_built), want)
    assert_rotary_matters(meta_built, want)
    assert_same_model(meta_built, float_built)
    for built in (float_built, meta_built):
        assert_rotary_as_transformers_computes(built, config)


def test_mxfp4_meta_built_model_without_a_tensor_in_the_checkpoint_names_it(tmp_path):
    folder = write_gpt_oss_mxfp4(tmp_path, _tiny_gpt_oss_config(), drop=("model.layers.1.mlp.router.weight",))
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match=re.escape(f"{folder}: checkpoint does not match the model: missing "
                                                   "['model.layers.1.mlp.router.weight']")):
        load_mxfp4_checkpoint(model, folder)
    # without strict, the router the file lacks is still on meta after the load: an error naming it
    with pytest.raises(ValueError, match=re.escape(f"load_mxfp4_checkpoint: {folder}: the model was built on the meta "
                                                   "device and 1 of its tensors have no values after the load (the "
                                                   "file does not hold them): ['model.layers.1.mlp.router.weight']")):
        load_mxfp4_checkpoint(model, folder, strict=False)


def test_mxfp4_device_is_for_meta_built_models(tmp_path):
    folder = write_gpt_oss_mxfp4(tmp_path, _tiny_gpt_oss_config())
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match=r"load_mxfp4_checkpoint: argument 'device' applies to a model built on "
                                         r"the meta device .* move it with model.to\('cpu'\) instead"):
        load_mxfp4_checkpoint(model, folder, device="cpu")
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match=r"load_mxfp4_checkpoint: argument 'device' must be a device that holds"):
        load_mxfp4_checkpoint(model, folder, device="meta")
    load_mxfp4_checkpoint(model, folder, device=torch.device("cpu"))
    assert meta_tensors(model) == [] and model.lm_head.weight.device == torch.device("cpu")


class _Scaled(nn.Module):
    """A layer with a buffer it computes at construction and no transformers model to recompute it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 64), persistent=False)

    def forward(self, x):
        return self.linear(x) * self.scale


def test_computed_buffer_nothing_can_recompute_is_an_error(tmp_path):
    save_mlx(_Scaled(), tmp_path)
    # Moved to meta rather than built under torch.device("meta"): once transformers has loaded a
    # model in this process, torch.linspace may no longer follow that context (torch caches its
    # list of factory functions, and transformers swaps torch.linspace for a wrapper while it
    # builds a model on meta; a cache filled then holds the wrapper).
    model = _Scaled().to("meta")
    assert model.scale.is_meta
    with pytest.raises(ValueError, match=r"load_mlx: .*c0: the model was built on the meta device and its "
                                         r"computed buffers \['scale'\] are in no file; they could not be computed "
                                         r"again .* Build the model with its buffers in memory"):
        load_mlx(model, tmp_path)
    # with its buffers in memory (parameters only on meta) it loads, the buffer as built
    from torch_qmm.distributed import empty_parameters

    with empty_parameters():
        model = _Scaled()
    load_mlx(model, tmp_path)
    assert meta_tensors(model) == [] and torch.equal(model.scale, _Scaled().scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_an_initialization_that_writes_part_of_a_buffer_is_an_error(dtype):
    # The check behind compute_buffers: an init that leaves any element as it was is refused, for
    # integer and bool buffers too (whose fills, unlike a float NaN, equal themselves: the two runs
    # must start from different fills for the kept elements to differ).
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.ones(8, dtype=dtype), persistent=False)

    class Model(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.half = Half()

        def _init_weights(self, module):
            if isinstance(module, Half):
                module.freq[:4] = True if dtype == torch.bool else 2

    with torch.device("meta"):
        model = Model(transformers.PretrainedConfig())
    with pytest.raises(ValueError, match=r"computed buffers \['half.freq'\] are in no file"):
        compute_buffers(model, torch.device("cpu"), "here")


def test_recomputing_a_buffer_leaves_the_loaded_parameters_of_its_module_alone():
    # A module with a loaded parameter beside its computed buffer, whose initialization (as
    # transformers' do) writes the parameter in place too: only the buffer may be written, the
    # parameter keeps the values the file gave it.
    class ScaledLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 8))
            self.register_buffer("scale", torch.arange(1.0, 5.0), persistent=False)

    class Model(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.layer = ScaledLinear()

        def _init_weights(self, module):
            if isinstance(module, ScaledLinear):
                module.weight.normal_()
                module.scale.copy_(torch.arange(1.0, 5.0))

    with torch.device("meta"):
        model = Model(transformers.PretrainedConfig())
    loaded = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)
    model.layer.weight = nn.Parameter(loaded.clone())  # as a loader fills it
    assert compute_buffers(model, torch.device("cpu"), "here") == ["layer.scale"]
    assert torch.equal(model.layer.weight, loaded)
    assert torch.equal(model.layer.scale, torch.arange(1.0, 5.0))
    assert meta_tensors(model) == []


def test_a_buffer_is_computed_by_the_innermost_transformers_model_that_holds_it():
    # A composite model (a transformers model inside another, as a multimodal one holds its language
    # model): the outer model's initialization does not know the inner one's modules; the inner
    # model's computes the buffer, as it did when the model was built in memory.
    class Freq(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 10000.0 ** -torch.arange(0.0, 1.0, 0.125), persistent=False)

    class Inner(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.freq = Freq()

        def _init_weights(self, module):
            if isinstance(module, Freq):
                module.inv_freq.copy_(10000.0 ** -torch.arange(0.0, 1.0, 0.125))

    class Outer(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.inner = Inner(config)

        def _init_weights(self, module):
            pass

    float_built = Outer(transformers.PretrainedConfig())
    with torch.device("meta"):
        model = Outer(transformers.PretrainedConfig())
    assert compute_buffers(model, torch.device("cpu"), "here") == ["inner.freq.inv_freq"]
    assert torch.equal(model.inner.freq.inv_freq, float_built.inner.freq.inv_freq)


class _Counted(nn.Module):
    """A layer with a persistent buffer: the file holds it, nothing computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("steps", torch.arange(4.0))


def test_meta_built_model_without_a_persistent_buffer_in_the_checkpoint_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    save_mlx(_Counted(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["steps"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "mlx"})
    with torch.device("meta"):
        model = _Counted()
    with pytest.raises(ValueError, match=r"load_mlx: .*: the model was built on the meta device and 1 of its "
                                         r"tensors have no values after the load .*\['steps'\]"):
        load_mlx(model, tmp_path, strict=False)


class _Carrier(nn.Module):
    """A layer with an empty non-persistent buffer (a dtype carrier: it holds no values, only a
    dtype) and no transformers model to compute anything."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("carrier", torch.empty(0, 3, dtype=torch.bfloat16), persistent=False)


def test_an_empty_computed_buffer_gets_storage_without_an_initialization(tmp_path):
    # No file holds the buffer and no initialization computes it, but it has no values to compute:
    # it is given (empty) storage on the device, its shape and dtype kept, and the load goes on.
    save_mlx(_Carrier(), tmp_path)
    # moved to meta, not built there (see test_computed_buffer_nothing_can_recompute_is_an_error)
    model = _Carrier().to("meta")
    assert model.carrier.is_meta
    load_mlx(model, tmp_path)
    float_built = _Carrier()
    load_mlx(float_built, tmp_path)
    assert meta_tensors(model) == []
    assert model.carrier.device == torch.device("cpu") and model.carrier.shape == (0, 3)
    assert model.carrier.dtype == float_built.carrier.dtype
    model = _Carrier().to("meta")
    assert compute_buffers(model, torch.device("cpu"), "here") == []
    assert model.carrier.device == torch.device("cpu") and model.carrier.shape == (0, 3)
    assert model.carrier.dtype == torch.bfloat16


@pytest.mark.parametrize("error", ["item", "not-implemented", "key"])
def test_an_initialization_that_fails_on_the_stand_ins_is_the_error_naming_the_buffer(error):
    # compute_buffers runs the initialization with meta stand-ins for the module's parameters; one
    # that needs their values (Tensor.item() raises a RuntimeError on meta) or fails in another way
    # cannot compute the buffer: the ValueError naming it, whatever the initialization raised.
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 8))
            self.register_buffer("scale", torch.ones(4), persistent=False)

    class Model(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.layer = Scaled()

        def _init_weights(self, module):
            if isinstance(module, Scaled):
                if error == "item":
                    module.scale.fill_(module.weight.abs().max().item())
                elif error == "not-implemented":
                    raise NotImplementedError("no such rope type")
                else:
                    module.scale.copy_({"default": torch.ones(4)}[getattr(module, "rope_type", "yarn")])

    with torch.device("meta"):
        model = Model(transformers.PretrainedConfig())
    model.layer.weight = nn.Parameter(torch.full((4, 8), 2.0))  # as a loader fills it
    with pytest.raises(ValueError, match=r"here: the model was built on the meta device and its computed buffers "
                                         r"\['layer.scale'\] are in no file; they could not be computed again"):
        compute_buffers(model, torch.device("cpu"), "here")
    assert torch.equal(model.layer.weight, torch.full((4, 8), 2.0))


# ---------------------------------------------------------------- peak memory


def smollm2_gguf() -> Path:
    from test_interop_mlx_lm import smollm2_gguf as find

    return find()


_MEASURE = textwrap.dedent("""
    import json, sys, torch, transformers
    from torch_qmm.interop.gguf import GGUFFile
    from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
    from torch_qmm.interop import load_mlx
    from torch_qmm.interop.mxfp4_blocks import load_mxfp4_checkpoint

    def status(field):  # kB
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    kind, how, path = sys.argv[1:4]
    if kind == "gguf":
        config = llama_config_from_gguf(GGUFFile(path))
    else:
        config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):  # imports the model's code: not part of either load
        transformers.AutoModelForCausalLM.from_config(config)
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    before = status("VmRSS")
    if how == "meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    if kind == "gguf":
        load_gguf_llama(model, path, progress=False)
    elif kind == "mxfp4":
        load_mxfp4_checkpoint(model, path)
    else:
        load_mlx(model, path, progress=False)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    assert not any(t.is_meta for t in tensors), "a tensor of the loaded model is still on meta"
    held = sum(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"peak": status("VmHWM") - before, "rss": status("VmRSS") - before, "held": held}))
""")


def _peak(kind: str, how: str, path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _MEASURE, kind, how, str(path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_proc = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="the peak RSS is reset through Linux's /proc/self/clear_refs")



def _peaks(kind: str, path, size: int) -> tuple[int, int]:
    """Peak bytes of a load of `path` into a meta-built and a float-built model (each in a child
    process), printed with the file's size."""
    meta, floated = _peak(kind, "meta", path), _peak(kind, "float", path)
    print(f"{kind} {size / 2**20:.0f} MiB, peak: meta-built +{meta['peak'] / 2**20:.0f} MiB, "
          f"float-built +{floated['peak'] / 2**20:.0f} MiB; {meta}, {floated}")
    return meta["peak"], floated["peak"]


@needs_proc
def test_meta_built_gguf_load_peaks_near_the_file_size():
    # SmolLM2-135M-Instruct Q4_1 (94 MiB file), float32; peak RSS over the model's construction
    # and load, each in a child process. Measured (x86-64, 2 cores): float-built +727 MiB,
    # meta-built +214 MiB = the loaded model (110 MiB: the file's blocks as QuantLinear /
    # QuantEmbedding buffers, scales and biases in float32) + the file's pages, mapped while it is
    # read (94 MiB) + ~8 MiB of one tensor's conversion. Bounds from the file's size: the
    # meta-built load below 2.5x (model ~1.2x + mapped file 1x), the float-built one above 5x
    # (4 bytes a weight against ~4.5 bits).
    path = smollm2_gguf()
    size = path.stat().st_size
    meta, floated = _peaks("gguf", path, size)
    assert floated > 5 * size
    assert meta < 2.5 * size


@needs_proc
def test_meta_built_mlx_load_peaks_near_the_checkpoint_size(tmp_path):
    # SmolLM2-135M's GGUF loaded (meta-built) and saved as an MLX folder (Q4_1 -> affine 4-bit
    # gs32, the Q8_0 embedding -> affine 8-bit gs32, bfloat16 scales; 94 MiB of safetensors),
    # loaded as bfloat16. Measured: float-built +624 MiB (the model is built in float32, then
    # cast), meta-built +125 MiB = the loaded model (94 MiB, the checkpoint's tensors) + one
    # tensor read at a time. Bounds from the checkpoint's size: meta-built below 2x, float-built
    # above 5x.
    path = smollm2_gguf()
    f = GGUFFile(path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config_from_gguf(f))
    load_gguf_llama(model, f, dtype=torch.bfloat16, progress=False)
    folder = tmp_path / "mlx"
    save_mlx(model, folder)
    del model
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    meta, floated = _peaks("mlx", folder, size)
    assert floated > 5 * size
    assert meta < 2 * size


@needs_proc
def test_meta_built_mxfp4_load_peaks_near_the_checkpoint_size(tmp_path):
    # A gpt-oss mxfp4 checkpoint written here (2 layers of 32 experts, hidden and intermediate
    # size 512: 192 MiB of float32 experts stored as 25.5 MiB of blocks and scales; 32 MiB of
    # safetensors in all), loaded as float32; peak RSS over the model's construction and load,
    # each in a child process. Measured (x86-64, 2 cores): float-built +236 MiB (the float experts
    # exist until they are replaced), meta-built +36 MiB (the loaded model, 32 MiB, + one tensor
    # read at a time: the float experts are never allocated). Bounds from the checkpoint's size:
    # meta-built below 2x, float-built above 5x.
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_local_experts=32,
        num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=128, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    folder = write_gpt_oss_mxfp4(tmp_path, config)
    size = (folder / "model.safetensors").stat().st_size
    meta, floated = _peaks("mxfp4", folder, size)
    assert floated > 5 * size
    assert meta < 2 * size
