"""transformers: TorchQmmConfig quantizes on load (the same layers and bits as quantize_model on
the float model), a saved torch_qmm model reloads with from_pretrained. Small models from configs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torch_qmm.convert import quantize_model
from torch_qmm.formats import FORMATS
from torch_qmm.nn import QuantLinear

transformers = pytest.importorskip("transformers")
from torch_qmm.interop.transformers import TorchQmmConfig  # noqa: E402

IDS = torch.tensor([[1, 2, 3, 50, 95, 0, 7]])


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    # intermediate 192: down_proj (in 192) is not a multiple of group_size 128 -> stays float there.
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("float")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _quantized_layers(model) -> dict[str, tuple[int, int]]:
    return {n: (m.bits, m.group_size) for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group_size", [(4, 64), (3, 128), (8, 32)])
def test_quantize_on_load_equals_quantize_model(float_folder, bits, group_size, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_folder, quantization_config=TorchQmmConfig(bits=bits, group_size=group_size), dtype=dtype
    )
    expected = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=dtype)
    quantize_model(expected, bits=bits, group_size=group_size, filter_fn=lambda name, _: name != "lm_head")
    assert _quantized_layers(model) == _quantized_layers(expected)
    assert isinstance(model.lm_head, torch.nn.Linear)  # transformers' default skip: the output head
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) == (192 % group_size == 0)
    for (name, a), (_, b) in zip(model.named_buffers(), expected.named_buffers()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected(IDS).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_model_reloads_with_from_pretrained(float_folder, tmp_path, dtype):
    config = TorchQmmConfig(bits=4, group_size=128, modules_to_not_convert=["lm_head", "v_proj"])
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, quantization_config=config, dtype=dtype)
    assert not isinstance(model.model.layers[1].self_attn.v_proj, QuantLinear)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (saved["quant_method"], saved["bits"], saved["group_size"]) == ("torch_qmm", 4, 128)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _quantized_layers(reloaded) == _quantized_layers(model)
    state, state_reloaded = model.state_dict(), reloaded.state_dict()
    assert state.keys() == state_reloaded.keys()
    for name, t in state.items():
        assert t.dtype == state_reloaded[name].dtype and torch.equal(t, state_reloaded[name]), name
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match=r"argument 'bits' must be one of \(2, 3, 4, 5, 6, 8\), got 7"):
        TorchQmmConfig(bits=7)
    with pytest.raises(ValueError, match="argument 'group_size'"):
        TorchQmmConfig(group_size=100)


def _formats(model) -> dict[str, tuple]:
    return {n: (m.mode, m.bits, m.group_size) for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _assert_same_state(a, b) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, t in state_a.items():
        assert t.dtype == state_b[name].dtype and torch.equal(t, state_b[name]), name


@pytest.mark.parametrize("mode", [m for m, f in FORMATS.items() if not f.has_biases])
def test_fp_mode_quantizes_on_load_saves_and_reloads(float_folder, tmp_path, mode):
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, quantization_config=TorchQmmConfig(mode=mode))
    expected = transformers.AutoModelForCausalLM.from_pretrained(float_folder)
    quantize_model(expected, mode=mode, filter_fn=lambda name, _: name != "lm_head")
    assert _formats(model) == _formats(expected) and len(_formats(model)) == 14  # down_proj too (192 = 6 * 32)
    assert {f[0] for f in _formats(model).values()} == {mode}
    _assert_same_state(model, expected)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (saved["mode"], saved["bits"], saved["group_size"]) == (mode, FORMATS[mode].default_bits,
                                                                  FORMATS[mode].default_group_size)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _formats(reloaded) == _formats(model)
    _assert_same_state(reloaded, model)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_fp_mode_config_is_checked():
    with pytest.raises(ValueError, match=r"argument 'bits' must be 4, got 8 \(mode 'mxfp4'\)"):
        TorchQmmConfig(bits=8, mode="mxfp4")
    with pytest.raises(ValueError, match=r"per-layer bits are for mode 'affine', got mode='nvfp4'"):
        TorchQmmConfig(bits={"*": 4}, mode="nvfp4")


MIXED = {
    "mapping": {"*": 4, "model.layers.0.mlp.up_proj": 8, "model.layers.1.self_attn.q_proj": 2},
    "budget": "MixedBits",
}


@pytest.mark.parametrize("which", list(MIXED))
def test_mixed_bits_round_trip_through_save_pretrained(float_folder, tmp_path, which):
    from torch_qmm.quantizers import MixedBits

    bits = MIXED[which] if which == "mapping" else MixedBits(5.0, low=4, high=8)
    config = TorchQmmConfig(bits=bits, group_size=64)
    assert TorchQmmConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()  # also before loading
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, quantization_config=config)
    got = {n: b for n, (_, b, _) in _formats(model).items()}
    assert len(set(got.values())) > 1, got  # really mixed
    if which == "mapping":
        assert got == {n: MIXED["mapping"].get(n, 4) for n in got}
    expected = transformers.AutoModelForCausalLM.from_pretrained(float_folder)
    quantize_model(expected, bits=bits, group_size=64, filter_fn=lambda name, m: name in got)
    assert _formats(expected) == _formats(model)
    _assert_same_state(model, expected)

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["bits"] == got  # the bits every layer got, whatever asked for them
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _formats(reloaded) == _formats(model)
    _assert_same_state(reloaded, model)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


BAD_CONFIGS = [
    (dict(bits={1: 4}), ValueError, r"argument 'bits' must map layer names to bits, got the key 1"),
    (dict(bits={"*": 4, "model.layers.0.mlp.up_proj": 7}), ValueError, r"argument 'bits' must be one of .*got 7"),
    (dict(bits=[4, 8]), TypeError, r"argument 'bits' must be an int, a mapping name -> bits or MixedBits, got list"),
    (dict(bits=4, mixed_bits={"average": 4.5, "low": 4, "high": 6}), ValueError,
     r"argument 'mixed_bits' must be a dict \(average, low, high\) and comes without 'bits'"),
    (dict(mixed_bits=[4.5, 4, 6]), ValueError, r"argument 'mixed_bits' must be a dict"),
    # config.json's mixed_bits of other JSON types: not "'<=' not supported between 'int' and 'str'"
    (dict(mixed_bits={"average": "4.5"}), TypeError, r"MixedBits average must be a number of bits, got '4.5'"),
    (dict(mixed_bits={"average": True}), TypeError, r"MixedBits average must be a number of bits, got True"),
    (dict(mixed_bits={"average": 4.5, "low": 4.0}), TypeError, r"MixedBits low must be an integer .* got 4.0"),
    (dict(mixed_bits={"average": 4.5, "high": [6]}), TypeError, r"MixedBits high must be an integer .* got \[6\]"),
    (dict(bits={"*": 4}, mode="mxfp4"), ValueError,
     r"argument 'bits': per-layer bits are for mode 'affine', got mode='mxfp4'"),
    (dict(bits={"*": 4, "a.up": 8}, group_size=48), ValueError, r"argument 'group_size' must be one of .*got 48"),
    (dict(bits=8, mode="nvfp4"), ValueError, r"argument 'bits' must be 4, got 8 \(mode 'nvfp4'\)"),
    (dict(mode="int4"), ValueError, r"argument 'mode' must be one of .*got 'int4'"),
    # a saved config.json read back: not "'int' object is not iterable" while building the model
    (dict(modules_to_not_convert=5), TypeError, r"argument 'modules_to_not_convert' must be a list of module names"),
    (dict(modules_to_not_convert="lm_head"), TypeError, r"'modules_to_not_convert' must be a list .* got 'lm_head'"),
    (dict(modules_to_not_convert=["lm_head", 3]), TypeError, r"'modules_to_not_convert' must be a list"),
    (dict(embeddings="model.embed_tokens"), TypeError, r"argument 'embeddings' must be a list of module names"),
    (dict(embeddings=[0]), TypeError, r"argument 'embeddings' must be a list of module names or None, got \[0\]"),
    (dict(mixed_bits={"average": 4.5}, embeddings=["model.embed_tokens"]), ValueError,
     r"argument 'embeddings': quantized embeddings take their bits from 'bits' as an int or a mapping"),
    (dict(embeddings=["model.embed_tokens", "model.embed_tokens"]), ValueError,
     r"argument 'embeddings' names 'model\.embed_tokens' more than once"),
    (dict(embeddings=["model.embed_tokens"], modules_to_not_convert=["lm_head", "model.embed_tokens"]), ValueError,
     r"argument 'embeddings' names 'model\.embed_tokens', which 'modules_to_not_convert' keeps float"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_CONFIGS, ids=[str(c[0]) for c in BAD_CONFIGS])
def test_bad_per_layer_config_is_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        TorchQmmConfig(**kwargs)


def test_per_layer_bits_of_a_saved_config():
    cfg = TorchQmmConfig(bits={"*": 4, "a.up": 8}, group_size=64)
    assert (cfg.layer_bits("a.up"), cfg.layer_bits("b.up"), cfg.group_size) == (8, 4, 64)
    assert TorchQmmConfig(bits=3).layer_bits("anything") == 3
    with pytest.raises(ValueError, match=r"gives no bits for layer 'b\.up'"):
        TorchQmmConfig(bits={"a.up": 8}).layer_bits("b.up")
    again = TorchQmmConfig(**{k: v for k, v in cfg.to_dict().items() if k != "quant_method"})
    assert again.bits == {"*": 4, "a.up": 8} and again.group_size == 64


def test_offloading_to_disk_is_refused():
    from torch_qmm.interop.transformers import TorchQmmHfQuantizer

    quantizer = TorchQmmHfQuantizer(TorchQmmConfig())
    with pytest.raises(ValueError, match=r"does not support offloading layers to disk"):
        quantizer.validate_environment(device_map={"model.layers.0": "cpu", "model.layers.1": "disk"})
    quantizer.validate_environment(device_map={"": "cpu"})


def test_modules_to_not_convert_naming_a_parent_keeps_its_children_float(float_folder):
    # transformers' own convention: a name in modules_to_not_convert covers that module's subtree.
    config = TorchQmmConfig(bits=4, group_size=64, modules_to_not_convert=["lm_head", "model.layers.0"])
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, quantization_config=config)
    layer0 = [n for n, m in model.model.layers[0].named_modules() if type(m) is torch.nn.Linear]
    assert set(layer0) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert isinstance(model.model.layers[1].self_attn.q_proj, QuantLinear)
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)


@pytest.mark.parametrize("kwargs", [dict(bits=4, group_size=64), dict(bits={"*": 4, "model.layers.0.mlp.down_proj": 8}, group_size=64),
                                    dict(mode="mxfp4")], ids=["b4", "per-layer-bits", "mxfp4"])
def test_quantize_model_then_save_pretrained_reloads_the_same_layers(float_folder, tmp_path, kwargs):
    """quantize_model on a transformers model records its layers' torch_qmm config, so that
    save_pretrained + from_pretrained give back exactly these layers (the head too: quantize_model
    quantizes it) and the same logits, not float layers with fresh weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder)
    quantize_model(model, **kwargs)
    assert isinstance(model.lm_head, QuantLinear)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "torch_qmm"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _formats(reloaded) == _formats(model)
    _assert_same_state(reloaded, model)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_quantize_model_of_a_wrapper_records_the_transformers_models_inside(float_folder, tmp_path):
    """A transformers model inside another module (a sentence-transformers model, a user's wrapper)
    saves through its own save_pretrained: quantize_model on the wrapper records the config on each
    outermost transformers model in it, so that reload gives these layers back, not float layers
    with fresh weights; a model that one config cannot describe is named in the warning."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.head = torch.nn.Linear(128, 64)

    wrapper = Wrapper(transformers.AutoModelForCausalLM.from_pretrained(float_folder))
    # The head left float: recorded on the outer model (not on its inner LlamaModel, which shares
    # its config) the config names it "lm_head" among the layers to leave float.
    quantize_model(wrapper, bits=4, group_size=64, filter_fn=lambda name, _: not name.endswith("lm_head"))
    assert isinstance(wrapper.head, QuantLinear) and type(wrapper.inner.lm_head) is torch.nn.Linear
    wrapper.inner.save_pretrained(tmp_path)
    recorded = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert recorded["quant_method"] == "torch_qmm" and "lm_head" in recorded["modules_to_not_convert"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _formats(reloaded) == _formats(wrapper.inner)
    _assert_same_state(reloaded, wrapper.inner)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, wrapper.inner(IDS).logits)

    mixed = Wrapper(transformers.AutoModelForCausalLM.from_pretrained(float_folder))
    quantize_model(mixed, bits=4, group_size=64, filter_fn=lambda name, _: "mlp" in name)
    with pytest.warns(UserWarning, match="save_pretrained cannot record inner's torch_qmm layers"):
        quantize_model(mixed, bits=4, group_size=32, filter_fn=lambda name, _: "mlp" not in name)


def test_outermost_transformers_models_by_identity(float_folder):
    """Which transformers models in a module get a config of their own (convert._transformers_models):
    the outermost ones, each once, whatever names the wrapper gives them or their parts."""
    from torch_qmm.convert import _transformers_models

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(float_folder)

    class Parts(torch.nn.Module):  # a part of the model registered first, under another name
        def __init__(self, m):
            super().__init__()
            self.backbone = m.model
            self.inner = m

    parts = Parts(load())
    assert [n for n, _ in _transformers_models(parts)] == ["inner"]

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = load(), load()

    assert [n for n, _ in _transformers_models(Two())] == ["a", "b"]
    outer = load()  # a transformers model holding another one inside a plain container
    outer.extra = torch.nn.ModuleDict({"enc": load().model})
    assert [n for n, _ in _transformers_models(outer)] == [""]
    assert _transformers_models(torch.nn.Linear(2, 2)) == []


def test_quantize_model_warns_when_one_config_cannot_hold_the_layers(float_folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder)
    quantize_model(model, bits=4, group_size=64, filter_fn=lambda name, _: "mlp" in name)
    with pytest.warns(UserWarning, match="save_pretrained cannot record"):
        quantize_model(model, bits=4, group_size=32, filter_fn=lambda name, _: "mlp" not in name)


@pytest.mark.parametrize("mode, key, dtype, stored", [
    ("affine", "qweight", torch.float32, "torch.float32"),  # was cast to uint32: the words rounded, garbage out
    ("affine", "qweight", torch.int32, "torch.int32"),  # was assigned as stored: qmm refused it at the first forward
    ("affine", "scales", torch.int32, "torch.int32"),
    ("mxfp4", "scales", torch.float32, "torch.float32"),  # scale codes rounded through float
])
def test_saved_tensor_of_another_dtype_is_refused_on_reload(float_folder, tmp_path, mode, key, dtype, stored):
    """transformers casts a float checkpoint tensor to the model tensor's dtype and assigns an
    integer one as stored: a saved layer's codes or scales in another dtype fail the load, naming
    the tensor, instead of loading other values or failing at the first forward."""
    from safetensors.torch import load_file, save_file

    config = TorchQmmConfig(mode=mode) if mode != "affine" else TorchQmmConfig(bits=4, group_size=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, quantization_config=config)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = f"model.layers.1.mlp.up_proj.{key}"
    tensors[name] = tensors[name].to(torch.int64).to(dtype)  # the same values, another dtype
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"stores '{name}' as {stored}; the torch_qmm layer"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_torch_qmm_config_over_a_float_checkpoint_is_refused(float_folder, tmp_path):
    """A folder whose config.json names torch_qmm while its weights are float (a config copied, or
    recorded by quantize_model into a config object another model was built from): the load fails
    naming the missing codes, instead of a model whose codes and scales are allocated garbage."""
    import shutil

    folder = tmp_path / "float-with-torch_qmm-config"
    shutil.copytree(float_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "torch_qmm", "bits": 4, "group_size": 32, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"makes 'model\.layers\.0\.self_attn\.q_proj' and \d+ more torch_qmm "
                                         r"layers, but the checkpoint holds no torch_qmm codes"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("drop", [
    ["model.layers.1.mlp.up_proj.scales"],
    ["model.layers.0.self_attn.k_proj.qweight", "model.layers.0.self_attn.k_proj.scales",
     "model.layers.0.self_attn.k_proj.biases"],
])
def test_saved_model_missing_tensors_is_refused(float_folder, tmp_path, drop):
    """A torch_qmm checkpoint without some of its layers' tensors (a file cut short by hand, or
    saved from another model): the load fails naming them, instead of leaving them as
    transformers allocates them (uninitialized memory)."""
    from safetensors.torch import load_file, save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_folder, quantization_config=TorchQmmConfig(bits=4, group_size=64))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in drop:
        del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    layer = drop[0].rpartition(".")[0]
    with pytest.raises(ValueError, match=rf"model\.safetensors: the checkpoint lacks {len(drop)} tensor\(s\) of 1 torch_qmm layer\(s\).*"
                                         rf"'{drop[0]}' \(layers: {layer}\)"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_sharded_save_missing_tensors_names_the_folder_and_its_files(float_folder, tmp_path):
    """A sharded torch_qmm checkpoint (model.safetensors.index.json and its shards) without one of
    its layers' tensors: the error names the folder and the number of files, not one shard as if
    it were the whole checkpoint."""
    from safetensors.torch import load_file, save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_folder, quantization_config=TorchQmmConfig(bits=4, group_size=64))
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    key = "model.layers.1.mlp.up_proj.scales"
    shard = tmp_path / index["weight_map"].pop(key)
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert str(e.value).startswith(f"{tmp_path} ({len(shards)} files): the checkpoint lacks 1 tensor(s) of 1 "
                                   f"torch_qmm layer(s)"), str(e.value)
    assert f"'{key}'" in str(e.value)


def test_missing_tensor_check_steps_aside_when_no_tensor_is_marked_loaded():
    """_check_every_buffer_loaded tells loaded tensors from missing ones by transformers' mark
    (`_is_hf_initialized`). Some of a model's torch_qmm tensors marked and others not: the
    unmarked are named. None marked (a way of loading that marks nothing): no error, since
    nothing can be told apart."""
    from torch_qmm.interop.transformers import _check_every_buffer_loaded

    model = torch.nn.Sequential(QuantLinear(64, 8, bits=4, group_size=32), QuantLinear(64, 8, bits=4, group_size=32))
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    assert {"0.qweight", "0.scales", "1.qweight", "1.scales"} <= set(buffers)
    _check_every_buffer_loaded(model, buffers, ["/some/model.safetensors"])  # none marked: nothing checked
    for name in buffers:
        if not name.startswith("1."):
            model.get_buffer(name)._is_hf_initialized = True
    with pytest.raises(ValueError, match=r"^/some/model\.safetensors: the checkpoint lacks \d+ tensor\(s\) of 1 "
                                         r"torch_qmm layer\(s\) .*\(layers: 1\)"):
        _check_every_buffer_loaded(model, buffers, ["/some/model.safetensors"])
    for name in buffers:
        model.get_buffer(name)._is_hf_initialized = True
    _check_every_buffer_loaded(model, buffers, ["/some/model.safetensors"])  # all marked: all loaded


_RELOAD_SCRIPT = r"""
import sys
import torch
from safetensors.torch import load_file
if sys.argv[2] == "torch_qmm-first":
    import torch_qmm
    from transformers import AutoModelForCausalLM
else:
    from transformers import AutoModelForCausalLM
    import torch_qmm
folder = sys.argv[1]
state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
stored = {k: t for k, t in load_file(folder + "/model.safetensors").items() if not k.endswith("._extra_state")}
assert any(k.endswith(".qweight") for k in stored)
print("differ:", sorted(k for k, t in stored.items() if k not in state or not torch.equal(state[k], t)))
"""


@pytest.mark.parametrize("order", ["torch_qmm-first", "transformers-first"])
def test_import_torch_qmm_is_enough_to_reload_a_saved_folder(float_folder, tmp_path, order):
    """A fresh interpreter that imports torch_qmm (before or after transformers) and nothing of
    its interop loads every stored tensor with AutoModelForCausalLM.from_pretrained; transformers
    alone would only warn about the unknown quant_method and initialise float layers at random.
    The registration is per process, hence the child."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder)
    quantize_model(model, bits=4, group_size=64)
    model.save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.run([sys.executable, "-c", _RELOAD_SCRIPT, str(tmp_path), order], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "differ: []" in p.stdout.splitlines()


def test_torch_qmm_config_repr_shows_its_settings():
    # as transformers' own quantization configs print theirs (their JSON)
    text = repr(TorchQmmConfig(bits=4, group_size=64))
    assert text.startswith("TorchQmmConfig {") and '"bits": 4' in text and '"group_size": 64' in text
    assert '"mode": "affine"' in text


def test_a_loaded_model_owns_its_config_and_sub_configs():
    # The loaders record the quantization in model.config: the model gets a copy of the config the
    # caller built it from, and every module holding it or one of its sub-configs (a multimodal
    # model's text / vision configs) holds the copy's, so settings made through model.config
    # reach them.
    from torch_qmm.interop.transformers import record_loaded_model

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config)
    before = config.to_dict()
    record_loaded_model(model, "load_mlx")
    assert model.config is not config and config.to_dict() == before
    assert model.model.config is model.config
    assert model.model.language_model.config is model.config.text_config
    assert model.model.vision_tower.config is model.config.vision_config
    assert all(m.config in (model.config, model.config.text_config, model.config.vision_config)
               for m in model.modules() if "config" in m.__dict__)


def _tiny_folder(path, family: str, tied: bool, hidden: int = 128):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM)}[family]
    config = cls[0](vocab_size=96, hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                    tie_word_embeddings=tied)
    torch.manual_seed(0)
    cls[1](config).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("gemma", True)])
def test_embeddings_quantize_on_load_save_and_reload(tmp_path, family, tied, dtype):
    """TorchQmmConfig(embeddings=...): the embedding becomes MLX's quantization of its table (codes,
    scales and biases as mx.quantize gives them from the same float table), a head sharing its weight
    reads it (TiedQuantLinear), Gemma's lookups keep their scale; save_pretrained lists the embedding
    and from_pretrained rebuilds the same model, bit for bit."""
    mx = pytest.importorskip("mlx.core")
    from torch_qmm.interop.modules import QuantEmbedding, TiedQuantLinear

    folder = _tiny_folder(tmp_path / "float", family, tied)
    config = TorchQmmConfig(bits={"*": 4, "model.embed_tokens": 8}, group_size=64, embeddings=["model.embed_tokens"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype).eval()
    table = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).model.embed_tokens.weight.detach()
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and (emb.bits, emb.group_size, emb.compute_dtype) == (8, 64, dtype)
    assert emb.embed_scale == (128 ** 0.5 if family == "gemma" else None)
    wq, scales, biases = mx.quantize(mx.array(table.float().numpy()).astype(
        mx.bfloat16 if dtype == torch.bfloat16 else mx.float32), group_size=64, bits=8)
    assert np.array_equal(np.array(wq).view(np.uint32), emb.qweight.numpy())
    assert torch.equal(torch.from_numpy(np.array(scales.astype(mx.float32))).to(dtype), emb.scales)
    assert torch.equal(torch.from_numpy(np.array(biases.astype(mx.float32))).to(dtype), emb.biases)
    if tied:
        assert isinstance(model.lm_head, TiedQuantLinear) and model.lm_head.embedding is emb
    else:  # transformers' default leaves the head float
        assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["embeddings"] == ["model.embed_tokens"] and saved["bits"]["model.embed_tokens"] == 8
    assert "model.embed_tokens" not in saved["modules_to_not_convert"]

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=dtype).eval()
    again = reloaded.model.embed_tokens
    assert isinstance(again, QuantEmbedding) and again.embed_scale == emb.embed_scale
    assert isinstance(reloaded.lm_head, TiedQuantLinear if tied else torch.nn.Linear)
    _assert_same_state(model, reloaded)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("embeddings, hidden, bits, message", [
    (["model.embeddings"], 128, 4, r"'embeddings' names 'model\.embeddings', which is not a module of this "
                                   r"LlamaForCausalLM"),
    (["lm_head"], 128, 4, r"'embeddings' names 'lm_head', a Linear; expected an nn\.Embedding"),
    (["model.embed_tokens"], 96, 4, r"'embeddings' names 'model\.embed_tokens', whose width 96 is not a multiple of "
                                    r"group_size 64"),
    (["model.embed_tokens"], 128, {"model.layers.0.mlp.up_proj": 8}, r"argument 'bits' gives no bits for the "
                                                                     r"embedding 'model\.embed_tokens'"),
])
def test_embeddings_the_model_cannot_quantize_are_named(tmp_path, embeddings, hidden, bits, message):
    folder = _tiny_folder(tmp_path / "float", "llama", tied=False, hidden=hidden)
    with pytest.raises(ValueError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=TorchQmmConfig(bits=bits, group_size=64, embeddings=embeddings))


def test_only_an_input_embedding_no_other_embedding_shares_is_quantized(tmp_path):
    """A position embedding (GPT-2's wpe: another module's code may read its .weight) and an
    embedding whose weight other embeddings share (T5's shared, the encoder's and decoder's
    embed_tokens: they would keep reading the float table) are refused before loading, by name."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=96,
                                                               n_positions=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"names 'transformer\.wpe', which is not the model's input embedding "
                                         r"\(transformer\.wte\)"):
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "gpt2", quantization_config=TorchQmmConfig(bits=4, group_size=64, embeddings=["transformer.wpe"]))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4))
    t5.save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match=r"names 'shared', whose weight (encoder|decoder)\.embed_tokens, "
                                         r"(encoder|decoder)\.embed_tokens share\(s\) too"):
        transformers.T5ForConditionalGeneration.from_pretrained(
            tmp_path / "t5", quantization_config=TorchQmmConfig(bits=4, group_size=64, embeddings=["shared"]))


def test_a_tied_head_the_defaults_would_keep_float_reads_the_quantized_embedding_without_a_warning(tmp_path):
    import warnings

    from torch_qmm.interop.modules import TiedQuantLinear

    folder = _tiny_folder(tmp_path / "float", "llama", tied=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kept float so that the tie holds" for the head
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=TorchQmmConfig(
            bits=4, group_size=64, modules_to_not_convert=[], embeddings=["model.embed_tokens"]))
    assert isinstance(model.lm_head, TiedQuantLinear) and model.lm_head.embedding is model.model.embed_tokens


def test_a_head_of_its_own_that_the_config_ties_is_not_recorded_as_reloadable(tmp_path):
    """A quantized embedding next to an output layer of its own that the config ties to it: a
    reload would tie that layer to the embedding and drop its weights; the config records why it
    cannot be reloaded instead."""
    from torch_qmm.interop.modules import QuantEmbedding
    from torch_qmm.interop.transformers import NOT_RELOADABLE, record_quantization_config

    folder = _tiny_folder(tmp_path / "float", "llama", tied=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with pytest.warns(UserWarning, match="lm_head"):  # kept float: it shares the embedding's weight
        quantize_model(model, bits=4, group_size=64)
    model.model.embed_tokens = QuantEmbedding.from_embedding(model.model.embed_tokens, bits=4, group_size=64)
    why = record_quantization_config(model)
    assert why is not None and "lm_head (a Linear of its own, which the config ties to model.embed_tokens)" in why
    from torch_qmm.convert import record_loaded_model

    record_loaded_model(model, "load_mlx")
    assert "lm_head (a Linear of its own" in model.config.quantization_config[NOT_RELOADABLE]


def test_a_vision_language_model_reloads_its_quantized_vision_tower(tmp_path):
    """Gemma 3 (SigLIP vision tower): transformers' initialization after loading reads the
    attention's and MLP's `.weight` from the block (SigLIP's _init_weights), which the rebuilt
    QuantLinear layers do not have; the reload skips those blocks (their layers come from the
    checkpoint) and rebuilds the same model, text embedding included."""
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "float")
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "float", quantization_config=TorchQmmConfig(
        bits=4, group_size=32, embeddings=["model.language_model.embed_tokens"])).eval()
    vision = [n for n, m in model.named_modules() if n.startswith("model.vision_tower.") and isinstance(m, QuantLinear)]
    assert any(n.endswith("self_attn.q_proj") for n in vision) and any(n.endswith("mlp.fc1") for n in vision)
    model.save_pretrained(tmp_path / "q")
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "q").eval()
    _assert_same_state(model, reloaded)
    ids, pixels = torch.tensor([[2, 5, 9, 40, 7]]), torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        got, want = reloaded.model.get_image_features(pixels), model.model.get_image_features(pixels)
    got, want = (getattr(t, "pooler_output", t) for t in (got, want))
    assert torch.equal(got, want)


def test_an_embedding_mapping_with_a_default_gives_the_embedding_the_default_bits(tmp_path):
    """bits as a mapping whose '*' default covers the embedding (no entry of its own): the
    embedding is quantized with the default's bits, its codes, scales and biases those of
    mx.quantize of the float table with those bits; the entry of another layer does not reach it."""
    mx = pytest.importorskip("mlx.core")
    from torch_qmm.interop.modules import QuantEmbedding

    folder = _tiny_folder(tmp_path / "float", "llama", tied=False)
    config = TorchQmmConfig(bits={"*": 4, "model.layers.0.mlp.down_proj": 8}, group_size=64,
                            embeddings=["model.embed_tokens"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config)
    table = transformers.AutoModelForCausalLM.from_pretrained(folder).model.embed_tokens.weight.detach()
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and (emb.bits, emb.group_size) == (4, 64)
    assert model.model.layers[0].mlp.down_proj.bits == 8
    wq, scales, biases = mx.quantize(mx.array(table.numpy()), group_size=64, bits=4)
    assert np.array_equal(np.array(wq).view(np.uint32), emb.qweight.numpy())
    assert torch.equal(torch.from_numpy(np.array(scales)), emb.scales)
    assert torch.equal(torch.from_numpy(np.array(biases)), emb.biases)


def test_an_embedding_whose_weight_one_other_embedding_shares_is_refused(tmp_path):
    """T5EncoderModel: encoder.embed_tokens shares the input embedding's (shared) weight, one
    embedding alone (T5ForConditionalGeneration has two); quantizing `shared` would leave it reading
    the float table, so the load is refused naming it."""
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=128,
                                                           num_layers=1, num_heads=4))
    assert t5.encoder.embed_tokens is not t5.shared and t5.encoder.embed_tokens.weight is t5.shared.weight
    t5.save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match=r"names 'shared', whose weight encoder\.embed_tokens share\(s\) too"):
        transformers.T5EncoderModel.from_pretrained(
            tmp_path / "t5", quantization_config=TorchQmmConfig(bits=4, group_size=64, embeddings=["shared"]))


def _saved_and_reloaded(model, folder):
    from torch_qmm.interop.transformers import NOT_RELOADABLE, record_loaded_model

    record_loaded_model(model, "load_mlx")
    model.save_pretrained(folder)
    with pytest.raises(ValueError, match="from_pretrained cannot rebuild") as e:
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["quantization_config"][NOT_RELOADABLE] in str(e.value)
    return str(e.value)


def test_a_quantized_embedding_that_is_not_the_input_embedding_is_not_recorded_as_reloadable(tmp_path):
    """GPT-2 with its position embedding (wpe) quantized, as MLX quantizes every embedding: a reload
    quantizes only the model's input embedding (wte), so the config records why the folder cannot
    be rebuilt, naming wpe, and from_pretrained of the save says so instead of refusing the
    config's embeddings entry or loading wpe's codes into a float table."""
    from torch_qmm.interop.modules import QuantEmbedding

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=96,
                                                                 n_positions=64))
    model.transformer.wpe = QuantEmbedding.from_embedding(model.transformer.wpe, bits=4, group_size=64)
    why = _saved_and_reloaded(model, tmp_path / "gpt2")
    assert "transformer.wpe (a QuantEmbedding that is not the model's input embedding)" in why


def test_a_head_tied_to_the_quantized_embedding_where_the_config_does_not_tie_is_not_recorded_as_reloadable(
        tmp_path):
    """A llama whose config does not tie the head (tie_word_embeddings=False), given a quantized
    embedding and a head reading it (TiedQuantLinear): a reload would build the head as a layer of
    its own, whose weights the checkpoint does not hold, so the config records why it cannot be
    rebuilt, naming the head."""
    from torch_qmm.interop.modules import QuantEmbedding, tie_output

    model = transformers.AutoModelForCausalLM.from_pretrained(_tiny_folder(tmp_path / "float", "llama", tied=False))
    assert model.config.tie_word_embeddings is False
    emb = QuantEmbedding.from_embedding(model.model.embed_tokens, bits=4, group_size=64)
    model.model.embed_tokens = emb
    tie_output(model, "lm_head", emb)
    why = _saved_and_reloaded(model, tmp_path / "q")
    assert "lm_head (a TiedQuantLinear, which the config does not tie)" in why


def test_heads_listed_as_tied_in_a_nested_transformers_model_are_found_under_its_prefix():
    """listed_as_tied reads the tie lists of every transformers model inside `model`, each relative
    to that model: a tied llama held in a container at `inner` lists lm_head as tied to
    model.embed_tokens (its all_tied_weights_keys), found as inner.lm_head for
    inner.model.embed_tokens."""
    from torch import nn

    from torch_qmm.interop.modules import listed_as_tied, tied_to_embedding

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(config)
    assert llama.all_tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    outer = nn.Module()
    outer.inner = llama
    assert listed_as_tied(outer, "inner.model.embed_tokens") == {"inner.lm_head"}
    assert listed_as_tied(llama, "model.embed_tokens") == {"lm_head"}
    assert "inner.lm_head" in tied_to_embedding(outer, "inner.model.embed_tokens")
