"""MoE experts whose down_proj is quantized in another format than gate_proj / up_proj (as
mlx_lm's quant_predicate writes them) keep each projection's format through load_mlx and
save_mlx: mlx_lm reads our folder back with every switch layer in its own format and gives our
logits."""

from __future__ import annotations

import json

import pytest
import transformers

mx = pytest.importorskip("mlx.core")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # noqa: E402
from moe_helpers import FAMILIES, tiny_moe  # noqa: E402
from test_moe_mlx_lm import assert_close, mlx_logits, torch_logits  # noqa: E402
from torch_qmm.interop import load_mlx, save_mlx  # noqa: E402
from torch_qmm.nn_moe import QuantFusedExperts  # noqa: E402

FAMILY = "qwen3_moe"
GATE_UP = {"group_size": 32, "bits": 4, "mode": "affine"}
DOWN = {"group_size": 64, "bits": 8, "mode": "affine"}


def _mlx_lm_folder(tmp_path):
    """mlx_lm's own quantization of the tiny model: switch down_proj 8-bit gs64, the rest 4-bit gs32."""
    hf = tmp_path / "hf"
    source = tiny_moe(FAMILY)
    source.save_pretrained(hf)
    cfg = source.config
    spellings = {"rope_theta": cfg.rope_parameters["rope_theta"],
                 **{alias: getattr(cfg, alias) for alias in cfg.attribute_map}}
    model, config = mlx_lm_utils.load_model(hf, model_config=spellings)

    def predicate(path, module):
        return dict(DOWN) if path.endswith("switch_mlp.down_proj") else dict(GATE_UP)

    model, config = mlx_lm_utils.quantize_model(model, config, GATE_UP["group_size"], GATE_UP["bits"],
                                                quant_predicate=predicate)
    out = tmp_path / "mlx"
    mlx_lm_utils.save_model(out, model)
    mlx_lm_utils.save_config(config, out / "config.json")
    return out


def _switch_formats(model) -> dict[str, tuple[int, int]]:
    return {name.rsplit(".", 1)[-1]: (m.bits, m.group_size) for name, m in model.named_modules()
            if isinstance(m, QuantizedSwitchLinear)}


def test_down_proj_in_its_own_format_round_trips_through_mlx_lm(tmp_path):
    folder = _mlx_lm_folder(tmp_path)
    theirs, _ = mlx_lm_utils.load_model(folder)
    want = {"gate_proj": (4, 32), "up_proj": (4, 32), "down_proj": (8, 64)}
    assert _switch_formats(theirs) == want  # the folder holds what the test means

    ours = FAMILIES[FAMILY][1](transformers.AutoConfig.from_pretrained(folder)).eval()
    load_mlx(ours, folder)
    experts = [m for m in ours.modules() if isinstance(m, QuantFusedExperts)]
    assert experts and all((e.gate_up_proj.bits, e.gate_up_proj.group_size) == (4, 32) for e in experts)
    assert all((e.down_proj.bits, e.down_proj.group_size) == (8, 64) for e in experts)
    assert_close(torch_logits(ours), mlx_logits(theirs))

    saved = tmp_path / "ours"
    save_mlx(ours, saved)
    q = json.loads((saved / "config.json").read_text())["quantization"]
    downs = [k for k in q if k.endswith("switch_mlp.down_proj")]
    assert downs, sorted(q)
    for k in downs:
        assert {f: q[k][f] for f in ("bits", "group_size")} == {"bits": 8, "group_size": 64}, (k, q[k])
    again, _ = mlx_lm_utils.load_model(saved)  # mlx_lm reads every switch layer in its own format
    assert _switch_formats(again) == want
    assert_close(mlx_logits(again), torch_logits(ours))
