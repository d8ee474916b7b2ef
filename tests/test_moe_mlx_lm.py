"""MLX MoE checkpoints (mlx_lm's SwitchGLU layout: <block>.switch_mlp.{gate,up,down}_proj
.weight/.scales/.biases [E, ...]): a checkpoint mlx_lm itself quantized and saved loads into our
modules and computes mlx_lm's logits; a model we quantized and saved loads in mlx_lm and computes
ours. Nobody here wrote mlx_lm's models, its quantizer or its loader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_helpers import EXPERTS, FAMILIES, HIDDEN, INTER, LAYERS, VOCAB, logits, tiny_moe
from torch_qmm.__main__ import main
from torch_qmm.convert import quantize_model
from torch_qmm.interop import load_mlx, save_mlx
from torch_qmm.interop.mlx import mlx_state_dict
from torch_qmm.nn import QuantLinear
from torch_qmm.nn_moe import QuantFusedExperts

transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
import mlx_lm.utils as mlx_lm_utils  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # noqa: E402

from test_cli_convert import _report  # noqa: E402
from test_interop_mlx_lm import assert_same_bits  # noqa: E402

# float32 on both sides with the same quantized weights, summed in other orders through two
# layers: relative to the largest logit 1e-4 (~800 float32 ulps; measured about 1e-6).
RTOL_LOGITS = 1e-4
IDS = [int(i) for i in np.random.default_rng(0).integers(0, VOCAB, 16)]
GROUP = {"affine": 32}


def mlx_logits(model) -> torch.Tensor:
    return torch.from_numpy(np.array(model(mx.array(IDS)[None]).astype(mx.float32)))[0]


def torch_logits(model) -> torch.Tensor:
    return logits(model, torch.tensor([IDS]))[0]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> float:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < RTOL_LOGITS, f"max |mlx_lm - torch| / max |logit| = {err:.3g}"
    return err


def mlx_lm_quantized_folder(family: str, mode: str, tmp_path: Path, down: dict | None = None,
                            formats: dict | None = None) -> Path:
    """A folder written by mlx_lm: the float transformers checkpoint read by mlx_lm's loader
    (whose sanitize stacks the experts), quantized by mlx_lm's quantize_model with the family's
    own predicate (Qwen3-MoE's router 8-bit affine), saved by its save_model / save_config.
    down: the experts' down_proj quantized with these parameters of mlx_lm's instead (as its
    mixed recipes give down_proj more bits); formats: {projection: mlx_lm's parameters, or False to
    leave it float (as mlx_lm does where its input is smaller than the group size)}."""
    hf = tmp_path / "hf"
    source = tiny_moe(family)
    source.save_pretrained(hf)
    # transformers 5 writes rope_theta inside rope_parameters and num_experts under its canonical
    # name (num_local_experts); mlx_lm's model arguments read the older spellings
    cfg = source.config
    spellings = {"rope_theta": cfg.rope_parameters["rope_theta"],
                 **{alias: getattr(cfg, alias) for alias in cfg.attribute_map}}
    model, config = mlx_lm_utils.load_model(hf, model_config=spellings)
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if down is not None and path.endswith("switch_mlp.down_proj"):
            return dict(down)
        for proj, fmt in (formats or {}).items():
            if path.endswith(f"switch_mlp.{proj}"):
                return dict(fmt) if fmt else False
        return True if own is None else own(path, module)

    model, config = mlx_lm_utils.quantize_model(model, config, GROUP.get(mode), None, mode=mode,
                                                quant_predicate=predicate)
    out = tmp_path / "mlx"
    mlx_lm_utils.save_model(out, model)
    mlx_lm_utils.save_config(config, out / "config.json")
    return out


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_mlx_lm_moe_checkpoint_loads_into_our_modules(family, mode, tmp_path):
    folder = mlx_lm_quantized_folder(family, mode, tmp_path)
    theirs, _ = mlx_lm_utils.load_model(folder)
    switch = [m for _, m in theirs.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(switch) == 3 * 2 and {m.mode for m in switch} == {mode}
    ours = FAMILIES[family][1](transformers.AutoConfig.from_pretrained(folder)).eval()
    report = load_mlx(ours, folder)
    experts = [m for m in ours.modules() if isinstance(m, QuantFusedExperts)]
    assert len(experts) == 2 and {m.gate_up_proj.mode for m in experts} == {mode}
    assert len(report.dequantized) == 2  # the routers, quantized by mlx_lm, float in ours
    err = assert_close(torch_logits(ours), mlx_logits(theirs))
    print(f"{family} {mode}: mlx_lm -> ours {err:.2e}")
    # and our split of the experts is bit for bit what mlx_lm holds
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    held = mlx_state_dict(ours, model_type)
    params = dict(tree_flatten(theirs.parameters()))
    switch_keys = [k for k in params if ".switch_mlp." in k or ".experts." in k]
    assert switch_keys and all(k in held for k in switch_keys)
    for k in switch_keys:
        assert_same_bits(k, params[k], held[k])


def test_mlx_lm_moe_checkpoint_with_down_proj_in_a_format_of_its_own_loads(tmp_path):
    # gate_proj / up_proj 4-bit, group 32 (mlx_lm's defaults as passed); down_proj 6-bit, group 64
    folder = mlx_lm_quantized_folder("qwen3_moe", "affine", tmp_path,
                                     down={"group_size": 64, "bits": 6, "mode": "affine"})
    theirs, _ = mlx_lm_utils.load_model(folder)
    stored = {(n.rpartition(".")[2], m.bits, m.group_size) for n, m in theirs.named_modules()
              if isinstance(m, QuantizedSwitchLinear)}
    assert stored == {("gate_proj", 4, 32), ("up_proj", 4, 32), ("down_proj", 6, 64)}
    ours = FAMILIES["qwen3_moe"][1](transformers.AutoConfig.from_pretrained(folder)).eval()
    load_mlx(ours, folder)
    experts = [m for m in ours.modules() if isinstance(m, QuantFusedExperts)]
    assert len(experts) == 2
    for m in experts:
        assert (m.gate_up_proj.bits, m.gate_up_proj.group_size) == (4, 32)
        assert (m.down_proj.bits, m.down_proj.group_size) == (6, 64)
    assert_close(torch_logits(ours), mlx_logits(theirs))


@pytest.mark.parametrize("mode", ["affine", "mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_moe_save_loads_in_mlx_lm(family, mode, tmp_path):
    model = tiny_moe(family)
    quantize_model(model, group_size=GROUP.get(mode), mode=mode)
    save_mlx(model, tmp_path)
    theirs, _ = mlx_lm_utils.load_model(tmp_path)
    switch = [m for _, m in theirs.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(switch) == 3 * 2 and {m.mode for m in switch} == {mode}
    err = assert_close(mlx_logits(theirs), torch_logits(model))
    print(f"{family} {mode}: ours -> mlx_lm {err:.2e}")


@pytest.mark.parametrize("given", ["none", "dict"])
def test_mlx_lm_reads_the_config_whichever_way_save_mlx_is_given_it(given, tmp_path):
    # transformers' Qwen3-MoE config holds num_local_experts; mlx_lm's model arguments require its
    # alias num_experts, which a config passed as a dict (to_dict) does not hold either
    model = tiny_moe("qwen3_moe")
    quantize_model(model, group_size=32)
    config = model.config.to_dict() if given == "dict" else None
    assert config is None or "num_experts" not in config
    save_mlx(model, tmp_path, config=config)
    theirs, _ = mlx_lm_utils.load_model(tmp_path)
    assert theirs.args.num_experts == model.config.num_local_experts
    assert_close(mlx_logits(theirs), torch_logits(model))


@pytest.mark.parametrize("family, block", [("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")])
def test_convert_to_mlx_quantizes_the_experts_of_a_float_moe_folder(family, block, tmp_path, capsys):
    src, out = tmp_path / "hf", tmp_path / "mlx"
    tiny_moe(family).save_pretrained(src)
    assert main(["convert", str(src), str(out), "--format", "mlx", "--bits", "4", "--group-size", "32"]) == 0
    report = _report(capsys.readouterr().out)
    for layer in range(LAYERS):
        assert report[f"model.layers.{layer}.mlp.experts"] == "quantized float -> affine b4 gs32"
    # stored as mlx_lm's quantized SwitchGLU: packed uint32 words, a scale and bias per 32 inputs
    from safetensors import safe_open

    (weights,) = out.glob("*.safetensors")
    with safe_open(str(weights), "numpy") as f:
        for layer in range(LAYERS):
            for proj, (rows, cols) in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
                                       "down_proj": (HIDDEN, INTER)}.items():
                key = f"model.layers.{layer}.{block}.switch_mlp.{proj}"
                w, scales = f.get_slice(f"{key}.weight"), f.get_slice(f"{key}.scales")
                assert (w.get_dtype(), w.get_shape()) == ("U32", [EXPERTS, rows, cols * 4 // 32]), key
                assert scales.get_shape() == f.get_slice(f"{key}.biases").get_shape() == [EXPERTS, rows, cols // 32]
    theirs, _ = mlx_lm_utils.load_model(out)
    switch = [m for _, m in theirs.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(switch) == 3 * LAYERS and {(m.bits, m.group_size) for m in switch} == {(4, 32)}
    ours = FAMILIES[family][1](transformers.AutoConfig.from_pretrained(out)).eval()
    load_mlx(ours, out)
    assert_close(mlx_logits(theirs), torch_logits(ours))


def test_float_moe_round_trips_through_mlx_files(tmp_path):
    model = tiny_moe("qwen3_moe")
    save_mlx(model, tmp_path)  # float experts as mlx_lm's float SwitchGLU
    theirs, _ = mlx_lm_utils.load_model(tmp_path)
    assert_close(mlx_logits(theirs), torch_logits(model))
    again = FAMILIES["qwen3_moe"][1](transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    load_mlx(again, tmp_path)
    assert torch.equal(torch_logits(again), torch_logits(model))


def test_our_save_load_keeps_the_experts_bit_for_bit(tmp_path):
    model = tiny_moe("gpt_oss")
    quantize_model(model, group_size=32)
    save_mlx(model, tmp_path)
    again = FAMILIES["gpt_oss"][1](transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    load_mlx(again, tmp_path)
    a, b = model.state_dict(), again.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert any(isinstance(m, QuantLinear) for m in again.modules())


@pytest.mark.parametrize("formats, stored", [
    ({"down_proj": False}, "gate_proj affine b4 gs32, up_proj affine b4 gs32, down_proj float"),
    ({"up_proj": {"group_size": 64, "bits": 4, "mode": "affine"}},
     "gate_proj affine b4 gs32, up_proj affine b4 gs64, down_proj affine b4 gs32"),
], ids=["down-float", "gate-up-differ"])
def test_experts_mlx_lm_quantized_in_parts_load_float_with_a_warning(formats, stored, tmp_path):
    # mlx_lm leaves a SwitchLinear float where its input is smaller than the group size, and its
    # predicates may give gate_proj and up_proj other formats: a QuantFusedExperts holds neither
    # (load_mlx refused the folders mlx_lm itself loads). They load float, dequantized.
    folder = mlx_lm_quantized_folder("qwen3_moe", "affine", tmp_path, formats=formats)
    theirs, _ = mlx_lm_utils.load_model(folder)
    ours = FAMILIES["qwen3_moe"][1](transformers.AutoConfig.from_pretrained(folder)).eval()
    with pytest.warns(UserWarning, match=re.escape(f"the experts model.layers.0.mlp.switch_mlp store {stored}; ")):
        load_mlx(ours, folder)
    assert not any(isinstance(m, QuantFusedExperts) for m in ours.modules())
    assert_close(torch_logits(ours), mlx_logits(theirs))


def _edit_weights(folder: Path, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    (f,) = folder.glob("*.safetensors")
    with safe_open(str(f), "pt") as h:
        metadata = h.metadata()
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    edit(tensors)
    save_file(tensors, str(f), metadata=metadata)


PREFIX = "model.layers.1.mlp.switch_mlp"
EXPERT_FILE_EDITS = {  # family, quantized, edit, message
    "bias-the-model-lacks": ("qwen3_moe", True,
                             lambda t: t.__setitem__(f"{PREFIX}.gate_proj.bias", torch.zeros(4, 64)),
                             rf"{PREFIX}\.gate_proj\.bias is stored, but the model's experts have no bias"),
    "bias-missing": ("gpt_oss", True, lambda t: t.pop("model.layers.1.mlp.experts.up_proj.bias"),
                     r"the model's experts model\.layers\.1\.mlp\.experts have a bias; missing"),
    "float-weight-missing": ("qwen3_moe", False, lambda t: t.pop(f"{PREFIX}.down_proj.weight"),
                             rf"the experts model\.layers\.1\.mlp\.experts need \['{PREFIX}\.down_proj\.weight'\]"),
    "float-weight-shape": ("qwen3_moe", False,
                           lambda t: t.__setitem__(f"{PREFIX}.up_proj.weight", t[f"{PREFIX}.up_proj.weight"][:, :32].contiguous()),
                           r"have shapes \[\[4, 128, 64\], \[4, 32, 64\]\], the experts "
                           r"model\.layers\.1\.mlp\.experts take \[4, 256, 64\]"),
    "quantized-weight-missing": ("qwen3_moe", True, lambda t: t.pop(f"{PREFIX}.down_proj.weight"),  # was a KeyError
                                 rf"quantized layer '{PREFIX}\.down_proj' has scales but no {PREFIX}\.down_proj\.weight"),
    # a float tensor's bytes under an integer dtype: copy_ converted the integers (garbage weights)
    "float-weight-as-integers": ("qwen3_moe", False,
                                 lambda t: t.__setitem__(f"{PREFIX}.up_proj.weight", t[f"{PREFIX}.up_proj.weight"].view(torch.int32)),
                                 rf"tensor '{PREFIX}\.up_proj\.weight' is I32, but the model's tensor is torch\.float32"),
    "bias-as-integers": ("gpt_oss", True,
                         lambda t: t.__setitem__("model.layers.1.mlp.experts.gate_proj.bias",
                                                 t["model.layers.1.mlp.experts.gate_proj.bias"].view(torch.int32)),
                         r"tensor 'model\.layers\.1\.mlp\.experts\.gate_proj\.bias' is I32, but the model's tensor is "
                         r"torch\.float32"),
    "float-bias-as-integers": ("gpt_oss", False,
                               lambda t: t.__setitem__("model.layers.0.mlp.experts.down_proj.bias",
                                                       t["model.layers.0.mlp.experts.down_proj.bias"].view(torch.int32)),
                               r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj\.bias' is I32"),
    # NaN in an expert's scales or biases would make every output of its rows NaN
    "nan-expert-scales": ("qwen3_moe", True,
                          lambda t: t[f"{PREFIX}.up_proj.scales"].__setitem__((2, 5, 1), float("nan")),
                          rf"tensor '{PREFIX}\.up_proj\.scales' \(F32\) holds NaN or Inf"),
    "inf-expert-biases": ("mixtral", True,
                          lambda t: t["model.layers.1.block_sparse_moe.switch_mlp.down_proj.biases"].__setitem__(
                              (0, 0, 0), float("inf")),
                          r"tensor 'model\.layers\.1\.block_sparse_moe\.switch_mlp\.down_proj\.biases' "
                          r"\(F32\) holds NaN"),
}


@pytest.mark.parametrize("case", list(EXPERT_FILE_EDITS))
def test_expert_tensors_that_do_not_fit_the_model_are_refused(case, tmp_path):
    family, quantized, edit, message = EXPERT_FILE_EDITS[case]
    model = tiny_moe(family)
    if quantized:
        quantize_model(model, group_size=32)
    save_mlx(model, tmp_path)
    _edit_weights(tmp_path, edit)
    fresh = FAMILIES[family][1](transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    with pytest.raises(ValueError, match=message):
        load_mlx(fresh, tmp_path)
