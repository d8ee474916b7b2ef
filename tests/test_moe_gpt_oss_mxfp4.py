"""gpt-oss mxfp4 checkpoints (experts as `*_blocks` / `*_scales`, transformers' layout) load as
our mxfp4 QuantFusedExperts without dequantizing: the weights they hold are exactly those of
transformers' own dequantization of the same tensors (transformers.integrations.mxfp4), and of
MLX's, and the model computes what transformers' model of those weights and mlx_lm's reading of
the same folder compute."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moe_helpers import EXPERTS, HIDDEN, INTER, LAYERS, VOCAB, logits, tiny_moe
from torch_qmm.interop.meta import meta_tensors
from torch_qmm.interop.mxfp4_blocks import blocks_to_words, load_mxfp4_checkpoint, words_to_blocks
from torch_qmm.nn_moe import QuantFusedExperts
from torch_qmm.ops import dequantize

transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

# float32 on both sides, the same weights, other summation orders through two layers: relative to
# the largest logit 1e-4 (~800 float32 ulps; measured about 1e-6).
RTOL_LOGITS = 1e-4
IDS = [int(i) for i in np.random.default_rng(1).integers(0, VOCAB, 16)]


def random_mxfp4(g: torch.Generator, e: int, rows: int, cols: int):
    """(blocks uint8 [e, rows, cols/32, 16], scales uint8 [e, rows, cols/32]): every byte value;
    E8M0 scales 2**-8 .. 2**-4 (weights of about the float model's scale)."""
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(119, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder of a tiny gpt-oss mxfp4 checkpoint, its tensors, the float model transformers makes
    of it: experts from transformers' dequantization)."""
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = tiny_moe("gpt_oss")
    g = torch.Generator().manual_seed(0)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    with torch.no_grad():
        for i in range(LAYERS):
            experts = model.model.layers[i].mlp.experts
            for proj, (rows, cols) in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
                blocks, scales = random_mxfp4(g, EXPERTS, rows, cols)
                prefix = f"model.layers.{i}.mlp.experts.{proj}"
                tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    # mlx_lm's gpt_oss arguments read these spellings (default rope_theta 150000)
    config["rope_theta"], config["rope_scaling"] = model.config.rope_parameters["rope_theta"], None
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors, model


def load_ours(folder):
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(folder)).eval()
    report = load_mxfp4_checkpoint(model, folder)
    return model, report


def test_blocks_are_mlx_words_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4(g, 3, 8, 64)
    words = blocks_to_words(blocks)
    assert words.shape == (3, 8, 8) and torch.equal(words_to_blocks(words), blocks)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, out, in]
    mlx = mx.dequantize(mx.array(words.numpy()), mx.array(scales.numpy()), group_size=32, bits=4, mode="mxfp4",
                        dtype=mx.float32)
    assert torch.equal(torch.from_numpy(np.array(mlx)), theirs)
    for e in range(3):
        ours = dequantize(words[e], scales[e], group_size=32, bits=4, mode="mxfp4", dtype=torch.float32)
        assert torch.equal(ours, theirs[e])


def test_loaded_experts_hold_transformers_weights(checkpoint):
    folder, tensors, reference = checkpoint
    model, report = load_ours(folder)
    assert sorted(report.quantized) == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    for i in range(LAYERS):
        ours = model.model.layers[i].mlp.experts
        assert isinstance(ours, QuantFusedExperts) and ours.gate_up_proj.mode == "mxfp4"
        prefix = f"model.layers.{i}.mlp.experts"
        # the stored bytes, not a re-encoding
        assert torch.equal(words_to_blocks(ours.gate_up_proj.qweight), tensors[f"{prefix}.gate_up_proj_blocks"])
        assert torch.equal(ours.down_proj.scales, tensors[f"{prefix}.down_proj_scales"])
        ref = reference.model.layers[i].mlp.experts
        for layer, param in ((ours.gate_up_proj, ref.gate_up_proj), (ours.down_proj, ref.down_proj)):
            for e in range(EXPERTS):
                w = dequantize(layer.qweight[e], layer.scales[e], group_size=32, bits=4, mode="mxfp4",
                               dtype=torch.float32)
                assert torch.equal(w, param[e].T)
    assert model.model.layers[0].mlp.router.weight.dtype == torch.float32


def test_mxfp4_checkpoint_logits_match_transformers_and_mlx_lm(checkpoint):
    import mlx_lm.utils as mlx_lm_utils
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    folder, _, reference = checkpoint
    model, _ = load_ours(folder)
    got = logits(model, torch.tensor([IDS]))[0]
    want = logits(reference, torch.tensor([IDS]))[0]
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < RTOL_LOGITS, f"ours vs transformers' dequantized model: {err:.3g}"
    theirs, _ = mlx_lm_utils.load_model(folder)
    assert {m.mode for _, m in theirs.named_modules() if isinstance(m, QuantizedSwitchLinear)} == {"mxfp4"}
    mlx = torch.from_numpy(np.array(theirs(mx.array(IDS)[None]).astype(mx.float32)))[0]
    err = ((got - mlx).abs().max() / mlx.abs().max()).item()
    assert err < RTOL_LOGITS, f"ours vs mlx_lm on the same folder: {err:.3g}"


def test_wrong_block_shape_is_refused(checkpoint, tmp_path):
    folder, tensors, _ = checkpoint
    bad = dict(tensors)
    key = "model.layers.0.mlp.experts.down_proj_blocks"
    bad[key] = bad[key][:, :, :1].contiguous()
    save_file(bad, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"down_proj_blocks \[4, 64, 1, 16\].*must be \[4, 64, 4, 16\]"):
        load_ours(tmp_path)


def test_wrong_bias_shape_is_refused(checkpoint, tmp_path):
    folder, tensors, _ = checkpoint
    bad = dict(tensors)
    key = "model.layers.0.mlp.experts.down_proj_bias"
    bad[key] = bad[key][0].contiguous()  # one expert's bias would broadcast over all of them
    save_file(bad, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"down_proj_bias \[\d+\] must be \[\d+, \d+\]"):
        load_ours(tmp_path)


# ---- hostile files: refused with the file and the tensor named, the model left as it was ---------

def _write(tensors, folder, tmp_path):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    return tmp_path / "model.safetensors"


def _snapshot(model):
    """Everything a load may change: the modules' classes by name and the state, copied."""
    return ({n: type(m) for n, m in model.named_modules()},
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def _assert_unchanged(model, before):
    modules, state = before
    assert {n: type(m) for n, m in model.named_modules()} == modules
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), k


def _edit_last_layer(key_suffix, change):
    """An edit of the last layer's tensor `key_suffix`: the earlier layers' experts are valid, so a
    loader that replaces modules as it goes has changed them by the time it finds this one."""
    def edit(tensors):
        key = f"model.layers.{LAYERS - 1}.{key_suffix}"
        tensors[key] = change(tensors[key])
        return key
    return edit


HOSTILE = [
    ("blocks-shape", _edit_last_layer("mlp.experts.down_proj_blocks", lambda t: t[:, :, :1].contiguous()),
     r"must be \[4, 64, 4, 16\]"),
    ("blocks-dtype", _edit_last_layer("mlp.experts.gate_up_proj_blocks", lambda t: t.to(torch.int8)),
     "must be U8, got I8"),
    ("scales-dtype", _edit_last_layer("mlp.experts.down_proj_scales", lambda t: t.to(torch.float32)),
     "must be U8, got F32"),
    ("bias-dtype", _edit_last_layer("mlp.experts.down_proj_bias", lambda t: t.to(torch.int32)),
     "must be a float"),
    ("float-shape", _edit_last_layer("mlp.router.weight", lambda t: t[:-1].contiguous()), "the model expects"),
    ("float-dtype", _edit_last_layer("mlp.router.weight", lambda t: t.to(torch.int32)), "stored as I32"),
]


@pytest.mark.parametrize("edit,message", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_file_leaves_the_model_unchanged(checkpoint, tmp_path, edit, message):
    folder, tensors, _ = checkpoint
    bad = dict(tensors)
    key = edit(bad)
    file = _write(bad, folder, tmp_path)
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message) as e:
        load_mxfp4_checkpoint(model, tmp_path)
    assert str(file) in str(e.value) and key in str(e.value), str(e.value)
    _assert_unchanged(model, before)


def test_truncated_file_leaves_the_model_unchanged(checkpoint, tmp_path):
    folder, tensors, _ = checkpoint
    file = _write(dict(tensors), folder, tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"tensor '[\w.]+' ends at byte \d+ .*truncated file") as e:
        load_mxfp4_checkpoint(model, tmp_path)
    assert str(file) in str(e.value)
    _assert_unchanged(model, before)


def _drop(suffix):
    """An edit removing the last layer's tensor `suffix`."""
    def edit(tensors):
        key = f"model.layers.{LAYERS - 1}.{suffix}"
        del tensors[key]
        return key
    return edit


def _add_unexpected(tensors):
    key = "model.layers.0.mlp.experts.extra_scales"
    tensors[key] = torch.zeros(3, dtype=torch.uint8)
    return key


INCOMPLETE = [
    ("scales-missing", _drop("mlp.experts.down_proj_scales"), r"store down_proj as mxfp4 but [\w.]+_scales is missing"),
    ("blocks-missing", _drop("mlp.experts.gate_up_proj_blocks"), r"gate_up_proj as mxfp4 but [\w.]+_blocks is missing"),
    ("bias-missing", _drop("mlp.experts.gate_up_proj_bias"), r"have a gate_up_proj bias; [\w.]+ is missing"),
    ("float-missing", _drop("mlp.router.weight"), r"missing \[.*mlp\.router\.weight"),
    ("unexpected", _add_unexpected, r"unexpected \[.*extra_scales"),
]


@pytest.mark.parametrize("edit,message", [h[1:] for h in INCOMPLETE], ids=[h[0] for h in INCOMPLETE])
def test_incomplete_file_is_refused_and_leaves_the_model_unchanged(checkpoint, tmp_path, edit, message):
    folder, tensors, _ = checkpoint
    bad = dict(tensors)
    key = edit(bad)
    _write(bad, folder, tmp_path)
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message) as e:
        load_mxfp4_checkpoint(model, tmp_path)
    assert key in str(e.value), str(e.value)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("edit,message", [h[1:] for h in HOSTILE + INCOMPLETE],
                         ids=[h[0] for h in HOSTILE + INCOMPLETE])
def test_bad_file_leaves_a_meta_built_model_as_it_was_and_loadable(checkpoint, tmp_path, edit, message):
    # The checks run before the model changes for a model built on the meta device too: after the
    # refusal it has its modules and meta tensors as built, and takes the good checkpoint.
    folder, tensors, _ = checkpoint
    bad = dict(tensors)
    key = edit(bad)
    (tmp_path / "bad").mkdir()
    _write(bad, folder, tmp_path / "bad")
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config).eval()
    modules = {n: type(m) for n, m in model.named_modules()}
    state = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    on_meta = sorted(meta_tensors(model))
    assert set(state) < set(on_meta)
    with pytest.raises(ValueError, match=message) as e:
        load_mxfp4_checkpoint(model, tmp_path / "bad")
    assert key in str(e.value), str(e.value)
    assert {n: type(m) for n, m in model.named_modules()} == modules
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == state
    assert sorted(meta_tensors(model)) == on_meta
    load_mxfp4_checkpoint(model, folder)
    assert meta_tensors(model) == []
    want, _ = load_ours(folder)
    assert torch.equal(logits(model, torch.tensor([IDS])), logits(want, torch.tensor([IDS])))


def test_not_strict_skips_unexpected_tensors(checkpoint, tmp_path):
    folder, tensors, _ = checkpoint
    bad = dict(tensors)
    _add_unexpected(bad)
    _write(bad, folder, tmp_path)
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    report = load_mxfp4_checkpoint(model, tmp_path, strict=False)
    assert len(report.quantized) == LAYERS
    prefix = "model.layers.0.mlp.experts"
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj.scales, tensors[f"{prefix}.down_proj_scales"])


def test_other_quant_method_is_refused(checkpoint, tmp_path):
    folder, tensors, _ = checkpoint
    _write(dict(tensors), folder, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(folder)).eval()
    with pytest.raises(ValueError, match=r"quant_method is 'awq', expected 'mxfp4'"):
        load_mxfp4_checkpoint(model, tmp_path)


def test_stored_float_dtype_is_the_default_and_dtype_casts(checkpoint, tmp_path):
    # The float tensors stored in bfloat16: the model takes bfloat16 unless dtype says otherwise;
    # the expert bytes are the same either way, the expert biases are in the compute dtype.
    folder, tensors, _ = checkpoint
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    _write(half, folder, tmp_path)
    prefix = "model.layers.1.mlp.experts"
    for dtype, want in ((None, torch.bfloat16), (torch.float32, torch.float32)):
        model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
        load_mxfp4_checkpoint(model, tmp_path, dtype=dtype)
        experts = model.model.layers[1].mlp.experts
        assert model.model.layers[1].mlp.router.weight.dtype == want
        assert torch.equal(model.model.layers[1].mlp.router.weight, half["model.layers.1.mlp.router.weight"].to(want))
        assert experts.down_proj.bias.dtype == want
        assert torch.equal(experts.down_proj.bias, half[f"{prefix}.down_proj_bias"].to(want))
        assert torch.equal(words_to_blocks(experts.down_proj.qweight), tensors[f"{prefix}.down_proj_blocks"])
