"""MLX checkpoints: a model quantized and saved by MLX (mlx.nn) loads here and gives MLX's outputs;
one saved here loads in MLX (with mlx_lm's loading rule) and gives ours. Bad files fail clearly."""

from __future__ import annotations

import copy
import json
import re
import struct

import numpy as np
import pytest
import torch
from torch import nn

from torch_qmm import reference, reference_fp
from torch_qmm.tolerance import OUT_ATOL, OUT_RTOL
from torch_qmm.convert import quantize_model
from torch_qmm.formats import FORMATS
from torch_qmm.interop import QuantEmbedding, TiedQuantLinear, load_mlx, save_mlx
from torch_qmm.nn import QuantLinear

mx = pytest.importorskip("mlx.core")
mnn = pytest.importorskip("mlx.nn")
from mlx.utils import tree_flatten  # noqa: E402

VOCAB, DIM, HIDDEN, LAYERS = 96, 128, 256, 2


# The same toy language model in both frameworks, with the same parameter names.
class TorchToy(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(DIM, HIDDEN), "down": nn.Linear(HIDDEN, DIM, bias=False)})
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["down"](torch.relu(layer["up"](h)))
        return self.head(h)


class MlxLayer(mnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = mnn.Linear(DIM, HIDDEN)
        self.down = mnn.Linear(HIDDEN, DIM, bias=False)


class MlxToy(mnn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.embed = mnn.Embedding(VOCAB, DIM)
        self.layers = [MlxLayer() for _ in range(LAYERS)]
        if not tied:
            self.head = mnn.Linear(DIM, VOCAB, bias=False)

    def __call__(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer.down(mnn.relu(layer.up(h)))
        return self.embed.as_linear(h) if self.tied else self.head(h)


MLX_DTYPES = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def exact_weight(m) -> torch.Tensor:
    """float64 W of a QuantLinear / QuantEmbedding, decoded by the float64 references."""
    if m.mode == "affine":
        return reference.dequantize(m.qweight, m.scales, m.biases, m.bits, m.group_size)
    return reference_fp.dequantize_fp(m.qweight, m.scales, m.mode, m.group_size, m.bits, dtype=torch.float64)


def float64_reference(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model run in float64 with its quantized layers replaced by their dequantized weights."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            w = exact_weight(m)
            if isinstance(m, QuantEmbedding):
                new = nn.Embedding(*w.shape)
            else:
                new = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
                if m.bias is not None:
                    new.bias = nn.Parameter(m.bias.double())
            new.weight = nn.Parameter(w)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, new)
    if isinstance(model.head, TiedQuantLinear):
        ref.head = nn.Linear(DIM, VOCAB, bias=False)
        ref.head.weight = ref.embed.weight
    return ref.double()(ids)


def assert_close_to_mlx(ours: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    """The tolerance rule: our error vs the float64 reference is at most ~2x MLX's own in the dtype
    (float32: both at summation-order level)."""
    ours_err = (ours.double() - ref).abs().max().item()
    mlx_err = (theirs.double() - ref).abs().max().item()
    floor = 1e-5 * ref.abs().max().item()
    assert ours_err <= 2 * max(mlx_err, floor), f"{dtype}: our error {ours_err:.3e}, MLX's {mlx_err:.3e}"


def mx_bits(a) -> torch.Tensor:
    """An mx.array as a torch tensor holding the same bits (numpy has no bfloat16)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_tensors(model, mlx_weights: dict) -> None:
    """The MLX side's tensors are the model's, tensor by tensor and bit for bit, none missing or
    extra (MLX names a packed weight `weight`, QuantLinear `qweight`; the layers' format state,
    `_extra_state`, travels in config.json's "quantization" instead)."""
    ours = {k.replace(".qweight", ".weight"): v for k, v in model.state_dict().items()
            if v.ndim >= 1 and not k.endswith("._extra_state")}
    assert set(mlx_weights) == set(ours), f"only MLX: {set(mlx_weights) - set(ours)}; only ours: {set(ours) - set(mlx_weights)}"
    for name, a in mlx_weights.items():
        theirs, mine = mx_bits(a), ours[name]
        assert (theirs.dtype, theirs.shape) == (mine.dtype, mine.shape), f"{name}: {theirs.dtype} {tuple(theirs.shape)} != {mine.dtype} {tuple(mine.shape)}"
        assert torch.equal(_raw(theirs), _raw(mine)), f"{name}: the bits differ"


def _to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def _save_mlx_checkpoint(model, folder, quantization: dict, shards: int = 1) -> None:
    """Writes the folder the way mlx_lm does: config.json + (sharded) safetensors + index."""
    weights = dict(tree_flatten(model.parameters()))
    names = sorted(weights)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[i * per:(i + 1) * per]}
        mx.save_safetensors(str(folder / file), part, metadata={"format": "mlx"})
        weight_map.update({k: file for k in part})
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(
        json.dumps({"model_type": "toy", "quantization": quantization, "quantization_config": quantization})
    )


def _mlx_quantized_toy(tied: bool, dtype, quantization: dict):
    mx.random.seed(0)
    model = MlxToy(tied)
    model.set_dtype(MLX_DTYPES[dtype])

    def predicate(path, module):  # mlx_lm's rule: a per-layer entry wins, else the default
        if path in quantization:
            return quantization[path]
        return hasattr(module, "to_quantized")

    mnn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                 mode=quantization.get("mode", "affine"), class_predicate=predicate)
    mx.eval(model.parameters())
    return model


IDS = [[3, 17, 95, 0, 42, 42, 7], [1, 2, 3, 4, 5, 6, 90]]

QUANT = {
    "group_size": 64,
    "bits": 4,
    "mode": "affine",
    "layers.0.down": {"group_size": 32, "bits": 8},
    "layers.1.up": False,
    "layers.1.down": {"group_size": 128, "bits": 3},
}
# Checkpoints in the fp modes, as mlx_lm writes them (every per-layer entry names its mode): the
# other fp mode and affine layers (an entry without "mode" is affine) in the same model.
FP_MODES = [m for m, f in FORMATS.items() if not f.has_biases]


def _defaults(mode: str) -> dict:
    return {"group_size": FORMATS[mode].default_group_size, "bits": FORMATS[mode].default_bits, "mode": mode}


def _other_fp_mode(mode: str) -> str:
    return FP_MODES[(FP_MODES.index(mode) + 1) % len(FP_MODES)]


FP_QUANT = {
    mode: {
        **_defaults(mode),
        "layers.0.down": {"group_size": 32, "bits": 8},
        "layers.1.up": False,
        "layers.1.down": _defaults(_other_fp_mode(mode)),
    }
    for mode in FP_MODES
}
CHECKPOINTS = {"affine": QUANT, **FP_QUANT}


def _format(m) -> tuple:
    return (m.mode, m.bits, m.group_size)


@pytest.mark.parametrize("mode", list(CHECKPOINTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tied,shards", [(True, 1), (False, 3)])
def test_mlx_checkpoint_loads_and_matches_mlx(tmp_path, dtype, tied, shards, mode):
    quant = CHECKPOINTS[mode]
    mlx_model = _mlx_quantized_toy(tied, dtype, quant)
    _save_mlx_checkpoint(mlx_model, tmp_path, quant, shards)
    expected = _to_torch(mlx_model(mx.array(IDS)))

    model = TorchToy(tied)
    report = load_mlx(model, tmp_path)
    assert isinstance(model.embed, QuantEmbedding) and _format(model.embed) == (mode, quant["bits"], quant["group_size"])
    assert isinstance(model.layers[0]["down"], QuantLinear) and _format(model.layers[0]["down"]) == ("affine", 8, 32)
    assert isinstance(model.layers[1]["up"], nn.Linear)  # `false` in the config: stays float
    down = quant["layers.1.down"]
    assert _format(model.layers[1]["down"]) == (down.get("mode", "affine"), down["bits"], down["group_size"])
    assert isinstance(model.head, TiedQuantLinear if tied else QuantLinear)
    assert report.quantized["layers.0.up"] == f"{mode} b{quant['bits']} gs{quant['group_size']}"
    if mode != "affine":
        assert model.layers[0]["up"].biases is None and model.layers[0]["up"].scales.dtype == torch.uint8
    # Every tensor is MLX's, bit for bit.
    assert_same_tensors(model, dict(tree_flatten(mlx_model.parameters())))

    got = model(torch.tensor(IDS))
    assert got.dtype == dtype and got.shape == expected.shape
    assert_close_to_mlx(got, expected, float64_reference(model, torch.tensor(IDS)), dtype)


@pytest.mark.parametrize("mode", ["affine", *FP_MODES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_saved_model_loads_in_mlx_and_matches(tmp_path, dtype, tied, mode):
    torch.manual_seed(0)
    model = TorchToy(tied).to(dtype)
    # the embedding in another format than the default: affine 6-bit, or the other fp mode
    emb_format = ({"group_size": 64, "bits": 6, "mode": "affine"} if mode == "affine" else
                  _defaults(_other_fp_mode(mode)))
    model.embed = QuantEmbedding.from_embedding(model.embed, **emb_format)
    if tied:
        model.head = TiedQuantLinear(model.embed)
    quantize_model(model, mode=mode, filter_fn=lambda name, _: name != "layers.1.up")
    model.layers[0]["down"] = QuantLinear.from_linear(nn.Linear(HIDDEN, DIM, bias=False).to(dtype), bits=2, group_size=32)
    ours = model(torch.tensor(IDS))
    save_mlx(model, tmp_path, config={"model_type": "toy"}, max_shard_bytes=40_000)

    config = json.loads((tmp_path / "config.json").read_text())
    q = config["quantization"]
    assert {k: q[k] for k in ("group_size", "bits", "mode")} == _defaults(mode) and q["layers.1.up"] is False
    assert q["embed"] == emb_format and q["layers.0.down"] == {"group_size": 32, "bits": 2, "mode": "affine"}
    assert config["quantization_config"] == q
    assert (tmp_path / "model.safetensors.index.json").is_file()

    # MLX side, as mlx_lm loads a folder: quantize where scales are stored, config gives the format.
    weights = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    mlx_model = MlxToy(tied)
    mlx_model.set_dtype(MLX_DTYPES[dtype])

    def predicate(path, module):
        if path in q:
            return q[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    # What MLX reads back is what we wrote, tensor by tensor, bit for bit ...
    assert_same_tensors(model, weights)
    # ... and MLX decodes each quantized layer, with the format the config gives it, to our weights:
    # the float64 reference of our tensors, within MLX's own rounding of s * q + b (half an ulp
    # of each product and of the sum; swapped scales and biases, or a wrong bits / group size,
    # are off by whole weights).
    # An fp mode's weights are exact in float32 (a 4-bit significand times a power of two or a
    # 4-bit one), so MLX's float32 decoding must equal the float64 reference.
    for name, module in model.named_modules():
        if hasattr(module, "qweight") and not isinstance(module, TiedQuantLinear):
            fmt = q.get(name, q)
            assert (fmt["mode"], fmt["bits"], fmt["group_size"]) == _format(module), name
            if fmt["mode"] != "affine":
                assert f"{name}.biases" not in weights
                got = mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"], group_size=fmt["group_size"],
                                    bits=fmt["bits"], mode=fmt["mode"], dtype=mx.float32)
                assert torch.equal(mx_bits(got).double(), exact_weight(module)), f"{name}: MLX decodes other weights"
                continue
            got = mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"], weights[f"{name}.biases"],
                                group_size=fmt["group_size"], bits=fmt["bits"])
            want = reference.dequantize(module.qweight, module.scales, module.biases, fmt["bits"], fmt["group_size"])
            terms = reference.dequantize(module.qweight, module.scales.abs(), module.biases.abs(), fmt["bits"], fmt["group_size"])
            err = (mx_bits(got).double() - want).abs()
            assert bool((err <= 2 * OUT_RTOL[dtype] * terms + OUT_ATOL[dtype]).all()), f"{name}: MLX decodes other weights"
    mnn.quantize(mlx_model, group_size=q["group_size"], bits=q["bits"], mode=q["mode"], class_predicate=predicate)
    mlx_model.load_weights(list(weights.items()), strict=True)
    theirs = _to_torch(mlx_model(mx.array(IDS)))
    assert_close_to_mlx(ours, theirs, float64_reference(model, torch.tensor(IDS)), dtype)


@pytest.mark.parametrize("first, second", [(40_000, 5 * 2**30), (5 * 2**30, 40_000), (40_000, 60_000)])
def test_saving_again_into_a_folder_leaves_no_stale_weight_files(tmp_path, first, second):
    """A second save into the folder is refused unless overwrite=True; then, with another shard
    count, it replaces the first one's weight files (a stale index or shard would be read instead
    of, or together with, the new weights); other files stay."""
    torch.manual_seed(0)
    old, new = TorchToy(False), TorchToy(False)
    quantize_model(old, bits=4, group_size=64, progress=False)
    quantize_model(new, bits=8, group_size=32, progress=False)
    (tmp_path / "notes.txt").write_text("mine")
    save_mlx(old, tmp_path, config={"model_type": "toy"}, max_shard_bytes=first)
    with pytest.raises(FileExistsError, match=r"already holds a model \(config\.json, model.*pass overwrite=True"):
        save_mlx(new, tmp_path, config={"model_type": "toy"}, max_shard_bytes=second)
    save_mlx(new, tmp_path, config={"model_type": "toy"}, max_shard_bytes=second, overwrite=True)
    index = tmp_path / "model.safetensors.index.json"
    weights = (sorted(set(json.loads(index.read_text())["weight_map"].values())) + [index.name]
               if second < 2**20 else ["model.safetensors"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(weights + ["config.json", "notes.txt"])
    loaded = TorchToy(False)
    load_mlx(loaded, tmp_path, progress=False)
    assert loaded.layers[0]["up"].bits == 8
    ids = torch.tensor(IDS)
    assert torch.equal(loaded(ids), new(ids))


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_save_mlx_files_get_the_umask_modes_of_new_files(tmp_path, umask):
    import os
    import stat

    model = TorchToy(False)
    quantize_model(model, progress=False)
    old = os.umask(umask)
    try:
        save_mlx(model, tmp_path / "one", config={"model_type": "toy"})
        save_mlx(model, tmp_path / "sharded", config={"model_type": "toy"}, max_shard_bytes=40_000)
    finally:
        os.umask(old)
    files = sorted((tmp_path / "one").iterdir()) + sorted((tmp_path / "sharded").iterdir())
    assert len(files) > 4
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


# ---- bad input -------------------------------------------------------------------------------

@pytest.fixture
def mlx_folder(tmp_path):
    quant = {"group_size": 64, "bits": 4}
    _save_mlx_checkpoint(_mlx_quantized_toy(False, torch.float32, quant), tmp_path, quant)
    return tmp_path


def _rewrite_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))


def test_truncated_safetensors_is_a_clear_error(mlx_folder):
    f = mlx_folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"\(truncated file\)"):
        load_mlx(TorchToy(False), mlx_folder)
    f.write_bytes(data[:5])
    with pytest.raises(ValueError, match="shorter than the 8-byte header"):
        load_mlx(TorchToy(False), mlx_folder)


def test_malformed_safetensors_header_is_a_clear_error(mlx_folder):
    f = mlx_folder / "model.safetensors"
    body = b"{not json"
    f.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(ValueError, match="not valid JSON"):
        load_mlx(TorchToy(False), mlx_folder)
    header = json.dumps({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(ValueError, match=r"'a': shape \[4, 4\] of F32 needs 64 bytes"):
        load_mlx(TorchToy(False), mlx_folder)


def test_config_bits_disagreeing_with_tensors_is_a_clear_error(mlx_folder):
    _rewrite_config(mlx_folder, quantization={"group_size": 64, "bits": 8})
    with pytest.raises(ValueError, match=r"config says bits=8.*fits bits=4"):
        load_mlx(TorchToy(False), mlx_folder)


def test_config_false_for_a_quantized_layer_is_a_clear_error(mlx_folder):
    _rewrite_config(mlx_folder, quantization={"group_size": 64, "bits": 4, "layers.0.up": False})
    with pytest.raises(ValueError, match=r"'quantization.layers.0.up' is false but the checkpoint stores"):
        load_mlx(TorchToy(False), mlx_folder)


def test_missing_quantization_config_is_a_clear_error(mlx_folder):
    _rewrite_config(mlx_folder, quantization=None)
    with pytest.raises(ValueError, match="has no 'quantization'"):
        load_mlx(TorchToy(False), mlx_folder)


def test_a_quantized_folder_without_config_json_names_the_missing_file(mlx_folder):
    (mlx_folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"stores quantized layer .* but .*config\.json does not exist \(it gives the "
                                         r"layers' bits and group_size\)"):
        load_mlx(TorchToy(False), mlx_folder)


def test_unknown_mode_is_a_clear_error(mlx_folder):
    _rewrite_config(mlx_folder, quantization={"group_size": 32, "bits": 4, "mode": "mxfp6"})
    with pytest.raises(ValueError, match=r"'quantization': quantization mode 'mxfp6' is not supported \(torch_qmm "
                                         r"reads the modes 'affine', 'mxfp4', 'nvfp4'"):
        load_mlx(TorchToy(False), mlx_folder)
    _rewrite_config(mlx_folder, quantization={"group_size": 32, "bits": 8, "mode": "mxfp4"})
    with pytest.raises(ValueError, match=r"'quantization': argument 'bits' must be 4, got 8 \(mode 'mxfp4'\)"):
        load_mlx(TorchToy(False), mlx_folder)


def test_config_mode_disagreeing_with_tensors_is_a_clear_error(mlx_folder, tmp_path_factory):
    # affine tensors (float scales, biases) with a config saying mxfp4
    _rewrite_config(mlx_folder, quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"})
    with pytest.raises(ValueError, match=r"quantized layer '(\w+)' stores \1.biases, but its mode 'mxfp4' has none"):
        load_mlx(TorchToy(False), mlx_folder)
    # mxfp4 tensors (uint8 scales, no biases) with a config that gives no mode (affine)
    quant = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    fp = tmp_path_factory.mktemp("mxfp4")
    _save_mlx_checkpoint(_mlx_quantized_toy(False, torch.float32, quant), fp, quant)
    _rewrite_config(fp, quantization={"group_size": 32, "bits": 4})
    with pytest.raises(ValueError, match=r"quantized layer '(\w+)' has scales but no \1.biases"):
        load_mlx(TorchToy(False), fp)
    _rewrite_config(fp, quantization={"group_size": 16, "bits": 4, "mode": "nvfp4"})
    with pytest.raises(ValueError, match=r"config says bits=4, group_size=16, mode='nvfp4' for a \[(\d+), 128\] weight, "
                                         r"so weight must be \[\1, 16\] and scales \[\1, 8\]; the checkpoint has "
                                         r"weight \[\1, 16\], scales \[\1, 4\]"):
        load_mlx(TorchToy(False), fp)


def test_fp_scales_of_the_wrong_dtype_are_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    quant = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    _save_mlx_checkpoint(_mlx_quantized_toy(False, torch.float32, quant), tmp_path, quant)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["layers.0.up.scales"] = tensors["layers.0.up.scales"].float()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'layers.0.up': scales of mode 'mxfp4' must be U8 \(scale codes\), got F32"):
        load_mlx(TorchToy(False), tmp_path)


def test_architecture_mismatch_is_a_clear_error(mlx_folder):
    class Other(TorchToy):
        def __init__(self):
            super().__init__(False)
            self.extra = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"missing \['extra.bias', 'extra.weight'\]"):
        load_mlx(Other(), mlx_folder)


def test_a_model_on_the_meta_device_loads_and_one_the_file_cannot_fill_is_a_clear_error(mlx_folder):
    # Built on meta, the model gets every tensor from the file: the float-built load's outputs.
    want = TorchToy(False)
    load_mlx(want, mlx_folder)
    with torch.device("meta"):
        model = TorchToy(False)
    load_mlx(model, mlx_folder)
    ids = torch.tensor([[1, 5, 9, 95]])
    with torch.no_grad():
        assert torch.equal(model(ids), want(ids))
    # A tensor the file does not hold would stay on meta: refused, named (strict names it first).
    class Other(TorchToy):
        def __init__(self):
            super().__init__(False)
            self.extra = nn.Linear(4, 4)

    with torch.device("meta"):
        model = Other()
    with pytest.raises(ValueError, match=r"load_mlx: .*: the model was built on the meta device and 2 of its tensors "
                                         r"have no values after the load \(the file does not hold them\): "
                                         r"\['extra.weight', 'extra.bias'\]"):
        load_mlx(model, mlx_folder, strict=False)


def test_index_naming_a_missing_shard_is_a_clear_error(tmp_path):
    quant = {"group_size": 64, "bits": 4}
    _save_mlx_checkpoint(_mlx_quantized_toy(False, torch.float32, quant), tmp_path, quant, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"names shards that do not exist: .*model-00002-of-00002"):
        load_mlx(TorchToy(False), tmp_path)


def test_packed_weight_with_the_wrong_dtype_is_a_clear_error(mlx_folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(mlx_folder / "model.safetensors")
    tensors["layers.0.up.weight"] = tensors["layers.0.up.weight"].view(torch.float32)
    save_file(tensors, mlx_folder / "model.safetensors")
    with pytest.raises(ValueError, match="'layers.0.up': quantized weight must be U32, got F32"):
        load_mlx(TorchToy(False), mlx_folder)


# ---- the config's quantization entries (mlx_lm's config.json "quantization") ------------------

def test_quantization_entries_parse_as_mlx_lm_reads_them():
    # A layer's entry: false (float), true (the default format), or its own format; keys that are
    # not entries (transformers' bookkeeping) are ignored; "quantization_config" is read too.
    from torch_qmm.interop import parse_quantization
    from torch_qmm.interop.mlx import QuantSpec

    q = {"group_size": 64, "bits": 4, "a.up": True, "a.down": False, "b.up": {"group_size": 32, "bits": 8},
         "c.up": {"group_size": 32, "bits": 4, "mode": "mxfp4"}, "note": "written by a tool",
         # null: the mode's default (mlx.nn's), not the top-level entry's
         "d.up": {"group_size": None, "bits": 3}, "e.up": {"group_size": None, "bits": None, "mode": "nvfp4"}}
    for key in ("quantization", "quantization_config"):
        default, overrides = parse_quantization({key: q})
        assert default == QuantSpec(4, 64, "affine")
        assert overrides == {"a.up": QuantSpec(4, 64, "affine"), "a.down": False, "b.up": QuantSpec(8, 32, "affine"),
                             "c.up": QuantSpec(4, 32, "mxfp4"), "d.up": QuantSpec(3, 64, "affine"),
                             "e.up": QuantSpec(4, 16, "nvfp4")}
    assert parse_quantization({}) == (None, {})
    assert parse_quantization({"quantization": None}) == (None, {})


BAD_QUANTIZATION = [
    ({"a.up": True}, r"'quantization.a.up' is true but no default bits/group_size is given"),
    ({"group_size": 64}, r"'quantization': quantization entry must give 'bits' and 'group_size'"),
    ({"group_size": 64, "bits": 4, "a.up": {"bits": 8}}, r"'quantization.a.up': quantization entry must give"),
    ({"group_size": 64, "bits": 4.0}, r"field 'bits' must be a JSON integer or null, got 4.0"),
    ({"group_size": "64", "bits": 4}, r"field 'group_size' must be a JSON integer or null, got '64'"),
    ({"group_size": 64, "bits": True}, r"field 'bits' must be a JSON integer or null, got True"),
    ({"group_size": 64, "bits": 4, "quant_method": "gptq"}, r"quantization method 'gptq' is not one of MLX's formats"),
    ({"group_size": 64, "bits": 7}, r"'quantization': argument 'bits' must be"),
    ({"group_size": 64, "bits": 4, "a.up": {"group_size": 64, "bits": 4, "mode": "mxfp4"}},
     r"'quantization.a.up': argument 'group_size' must be"),
    ({"group_size": 64, "bits": 4, "mode": "int4"}, r"quantization mode 'int4' is not supported"),
]


@pytest.mark.parametrize("q, message", BAD_QUANTIZATION, ids=[m[:40] for _, m in BAD_QUANTIZATION])
def test_bad_quantization_entries_name_the_entry(q, message):
    from torch_qmm.interop import parse_quantization

    with pytest.raises(ValueError, match=r"^cfg\.json\b.*" + message):
        parse_quantization({"quantization": q}, "cfg.json")


def test_quantized_layer_the_model_lacks_is_a_clear_error(mlx_folder):
    model = TorchToy(False)
    del model.layers[1]["up"]
    with pytest.raises(ValueError, match=r"quantized layer 'layers\.1\.up' does not exist in the model"):
        load_mlx(model, mlx_folder)


def test_quantized_embedding_over_one_with_max_norm_is_a_clear_error(mlx_folder):
    model = TorchToy(False)
    model.embed = nn.Embedding(VOCAB, DIM, max_norm=1.0)  # rows renormalized when read: no quantized table
    with pytest.raises(ValueError, match=r"quantized layer 'embed' replaces an nn\.Embedding with max_norm=1\.0"):
        load_mlx(model, mlx_folder)


def test_quantized_layer_of_another_kind_is_a_clear_error(mlx_folder):
    model = TorchToy(False)
    model.layers[0]["down"] = nn.Identity()
    with pytest.raises(ValueError, match=r"quantized layer 'layers\.0\.down' is a Identity, expected nn\.Linear"):
        load_mlx(model, mlx_folder)


def test_quantization_is_read_before_quantization_config():
    # mlx_lm reads config["quantization"] and falls back to "quantization_config" (an entry that is
    # not a dict, e.g. null, counts as absent).
    from torch_qmm.interop import parse_quantization
    from torch_qmm.interop.mlx import QuantSpec

    a, b = {"group_size": 32, "bits": 8}, {"group_size": 128, "bits": 2, "x.up": False}
    assert parse_quantization({"quantization": a, "quantization_config": b}) == (QuantSpec(8, 32), {})
    assert parse_quantization({"quantization": None, "quantization_config": b}) == (QuantSpec(2, 128), {"x.up": False})


def test_config_entry_for_a_layer_stored_float_is_a_clear_error(tmp_path):
    quant = {"group_size": 64, "bits": 4, "layers.0.up": False}
    _save_mlx_checkpoint(_mlx_quantized_toy(False, torch.float32, quant), tmp_path, quant)
    _rewrite_config(tmp_path, quantization={"group_size": 64, "bits": 4, "layers.0.up": {"group_size": 32, "bits": 8}})
    with pytest.raises(ValueError, match=r"'quantization.layers.0.up' gives affine b8 gs32 but the checkpoint stores "
                                         r"layers.0.up.weight unquantized \(no layers.0.up.scales\)"):
        load_mlx(TorchToy(False), tmp_path)
    # with the entry false (or absent, as mlx_lm) the float layer loads as nn.Linear
    _rewrite_config(tmp_path, quantization={"group_size": 64, "bits": 4})
    model = TorchToy(False)
    load_mlx(model, tmp_path)
    assert type(model.layers[0]["up"]) is nn.Linear and isinstance(model.layers[0]["down"], QuantLinear)


def _with_tensors(folder, **changes):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors.update(changes)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "mlx"})


def test_strict_false_loads_what_both_sides_have(mlx_folder):
    ids = torch.tensor(IDS)
    reference_model = TorchToy(False)
    load_mlx(reference_model, mlx_folder)
    _with_tensors(mlx_folder, **{"extra.weight": torch.ones(3, 5)})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra.weight'\]"):
        load_mlx(TorchToy(False), mlx_folder)

    class WithExtra(TorchToy):
        def __init__(self):
            super().__init__(False)
            self.other = nn.Linear(4, 4)

    model = WithExtra()
    before = copy.deepcopy(model.other.state_dict())
    report = load_mlx(model, mlx_folder, strict=False)
    # the checkpoint's tensors all arrive (the same model as the strict load), the model's own extra
    # layer is left as it was, the checkpoint's extra tensor is not read
    assert all(torch.equal(v, before[k]) for k, v in model.other.state_dict().items())
    assert set(report.quantized) == set(n for n, m in reference_model.named_modules() if isinstance(m, QuantLinear)
                                        or isinstance(m, QuantEmbedding))
    with torch.no_grad():
        assert torch.equal(model(ids), reference_model(ids))


def test_float_tensor_of_the_wrong_shape_is_a_clear_error(mlx_folder):
    _with_tensors(mlx_folder, **{"layers.0.up.bias": torch.zeros(HIDDEN - 1)})
    with pytest.raises(ValueError, match=rf"tensor 'layers.0.up.bias' has shape \[{HIDDEN - 1}\], the model expects "
                                         rf"\[{HIDDEN}\]"):
        load_mlx(TorchToy(False), mlx_folder)


def test_integer_tensor_of_another_dtype_is_a_clear_error(mlx_folder):
    # A non-float model tensor takes only its own dtype (float ones take any float dtype, cast on load).
    class WithCounter(TorchToy):
        def __init__(self):
            super().__init__(False)
            self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))

    _with_tensors(mlx_folder, counter=torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"tensor 'counter' is I32, the model's tensor is torch.int64"):
        load_mlx(WithCounter(), mlx_folder)
    _with_tensors(mlx_folder, counter=torch.arange(3, dtype=torch.int64) + 7)
    model = WithCounter()
    load_mlx(model, mlx_folder)
    assert torch.equal(model.counter, torch.tensor([7, 8, 9]))


# ---- safetensors headers and shard folders (torch_qmm/interop/safetensors_io.py) -------------

def _safetensors_bytes(header: object, data: bytes) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


@pytest.mark.parametrize("header, data, message", [
    ([1, 2], b"", r"safetensors header must be a JSON object, got list"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12),
     r"the tensors cover 8 of the 12 data bytes \(corrupt header or trailing data\)"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8),
     r"tensor 'b': data_offsets \[4, 8\] overlaps the previous tensor"),
], ids=["list", "trailing", "overlap"])
def test_safetensors_headers_that_do_not_describe_the_file_are_refused(tmp_path, header, data, message):
    from torch_qmm.interop.safetensors_io import read_header

    (tmp_path / "m.safetensors").write_bytes(_safetensors_bytes(header, data))
    with pytest.raises(ValueError, match=message):
        read_header(tmp_path / "m.safetensors")


def test_shard_folders_that_do_not_name_each_tensor_once_are_refused(tmp_path):
    from torch_qmm.interop.safetensors_io import Checkpoint

    one = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    with pytest.raises(ValueError, match=r"no \*.safetensors files \(and no model.safetensors.index.json\)"):
        Checkpoint(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(_safetensors_bytes(one, bytes(4)))
    (tmp_path / "y.safetensors").write_bytes(_safetensors_bytes(one, bytes(4)))
    with pytest.raises(ValueError, match=r"tensor 'a' appears in both .*x.safetensors and .*y.safetensors"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: missing 'weight_map'"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "y.safetensors"}}))
    ckpt = Checkpoint(tmp_path)  # the index names the shards: x.safetensors is not read
    assert ckpt.keys() == ["a"] and ckpt.where["a"] == tmp_path / "y.safetensors"


def test_json_files_that_are_not_small_utf8_objects_are_refused(tmp_path, monkeypatch):
    from torch_qmm.interop import json_files

    f = tmp_path / "config.json"
    f.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match=r"config.json: not UTF-8 text \("):
        json_files.read_json_object(f)
    f.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ValueError, match=r"config.json: not valid JSON: Expecting value at line 2 column 7"):
        json_files.read_json_object(f)
    f.write_text('{"a": 1}')
    assert json_files.read_json_object(f) == {"a": 1}
    monkeypatch.setattr(json_files, "MAX_JSON_BYTES", 7)
    with pytest.raises(ValueError, match=r"config.json: 8 bytes, larger than the 7 a JSON config can be"):
        json_files.read_json_object(f)


def test_load_mlx_casts_to_the_dtype_asked_for(tmp_path):
    from safetensors.torch import load_file

    quant = {"group_size": 64, "bits": 4, "layers.1.up": False}  # a float layer too
    _save_mlx_checkpoint(_mlx_quantized_toy(False, torch.float32, quant), tmp_path, quant)
    stored = load_file(tmp_path / "model.safetensors")
    model = TorchToy(False)
    load_mlx(model, tmp_path, dtype=torch.bfloat16)
    assert torch.equal(model.layers[1]["up"].weight, stored["layers.1.up.weight"].bfloat16())
    floats = {k: v.dtype for k, v in model.state_dict().items() if v.is_floating_point()}
    assert floats and set(floats.values()) == {torch.bfloat16}, floats
    up = model.layers[0]["up"]
    assert torch.equal(up.qweight, stored["layers.0.up.weight"])
    assert torch.equal(up.scales, stored["layers.0.up.scales"].bfloat16())
    assert torch.equal(up.bias, stored["layers.0.up.bias"].bfloat16())
    assert model(torch.tensor(IDS)).dtype == torch.bfloat16


def test_save_mlx_keeps_a_float_checkpoint_and_accepts_a_folder_with_only_other_files(tmp_path):
    """The float model's own folder is not replaced by its quantized save without overwrite=True;
    a folder holding only a tokenizer saved first is a folder to save into."""
    torch.manual_seed(0)
    model = TorchToy(False)
    folder = tmp_path / "float"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"float weights")
    quantize_model(model, bits=4, group_size=64, progress=False)
    with pytest.raises(FileExistsError, match=r"save_mlx: .*float already holds a model \(model\.safetensors\)"):
        save_mlx(model, folder, config={"model_type": "toy"})
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == b"float weights"
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    save_mlx(model, tok, config={"model_type": "toy"})
    assert sorted(p.name for p in tok.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_loading_into_a_model_loaded_before_names_the_layer_and_says_to_build_a_new_one(tmp_path):
    torch.manual_seed(0)
    model = TorchToy(False)
    quantize_model(model, bits=4, group_size=64, progress=False)
    save_mlx(model, tmp_path, config={"model_type": "toy"})
    loaded = TorchToy(False)
    load_mlx(loaded, tmp_path, progress=False)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + r": layer 'head' of the model is already a "
                                         r"QuantLinear: load_mlx replaces the float layers of a freshly built model"):
        load_mlx(loaded, tmp_path, progress=False)


def test_a_loaded_tied_head_survives_transformers_tie_weights(tmp_path):
    """load_mlx of a checkpoint whose quantized embedding is also the output projection: the head
    is a TiedQuantLinear, tied by construction, and transformers' tie_weights() (accelerate's
    dispatch calls it) leaves it so, instead of looking for the embedding's float `.weight`."""
    import transformers

    from torch_qmm import quantize_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      tie_word_embeddings=True)
    source = transformers.LlamaForCausalLM(config).eval()
    quantize_model(source, bits=4, group_size=64)
    table = QuantEmbedding.from_embedding(source.model.embed_tokens, bits=4, group_size=64)
    source.model.embed_tokens, source.lm_head = table, TiedQuantLinear(table)
    save_mlx(source, tmp_path, config=config.to_dict())
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    load_mlx(model, tmp_path, progress=False)
    assert isinstance(model.lm_head, TiedQuantLinear) and model.lm_head.embedding is model.model.embed_tokens
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = model(ids).logits
        model.tie_weights()
        model.tie_weights(recompute_mapping=False)  # the mapping post_init cached
        model.init_weights()
        assert isinstance(model.lm_head, TiedQuantLinear)
        assert torch.equal(model(ids).logits, before)
        assert torch.equal(before, source(ids).logits)
    assert "lm_head.weight" not in model.get_expanded_tied_weights_keys(all_submodels=True)
    assert "lm_head.weight" not in model.all_tied_weights_keys


def test_a_quantized_embedding_of_a_forward_of_its_own_loads_float(tmp_path):
    # An nn.Embedding subclass whose forward QuantEmbedding does not do keeps its class and gets
    # the weights MLX multiplies by, in float (the report names it dequantized).
    class Shifted(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1.0

    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    wq, scales, biases = reference.quantize(weight, group_size=32, bits=4)
    from safetensors.torch import save_file
    save_file({"emb.weight": wq, "emb.scales": scales, "emb.biases": biases}, tmp_path / "model.safetensors",
              metadata={"format": "mlx"})
    (tmp_path / "config.json").write_text('{"quantization": {"group_size": 32, "bits": 4}}')
    model = nn.Sequential()
    model.emb = Shifted(64, 64)
    report = load_mlx(model, tmp_path)
    assert type(model.emb) is Shifted and report.dequantized == ["emb"]
    expected = reference.dequantize_rounded(wq, scales, biases, group_size=32, bits=4).float()
    assert torch.equal(model.emb.weight.detach(), expected)
    ids = torch.tensor([3, 0, 63])
    assert torch.equal(model.emb(ids), expected[ids] + 1.0)
    # a head tied to such an embedding is satisfied by it (strict) and stays tied
    model = nn.Sequential()
    model.emb = Shifted(64, 64)
    model.head = nn.Linear(64, 64, bias=False)
    model.head.weight = model.emb.weight
    assert load_mlx(model, tmp_path).dequantized == ["emb"]
    assert model.head.weight is model.emb.weight and torch.equal(model.head.weight.detach(), expected)
    with pytest.raises(ValueError, match=r"argument 'embedding' must be an nn.Embedding or one of transformers' "
                                         r"scaled embeddings.*"
                                         r"got a Shifted"):
        QuantEmbedding.from_embedding(Shifted(64, 64), bits=4, group_size=32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "2.0", torch.tensor(2.0)])
def test_quant_embedding_refuses_an_embed_scale_that_is_not_a_finite_float(bad):
    with pytest.raises(ValueError, match=r"argument 'embed_scale' must be a finite float or None, got "):
        QuantEmbedding(16, 64, bits=4, group_size=32, embed_scale=bad)
    emb = QuantEmbedding(16, 64, bits=4, group_size=32, embed_scale=3)
    with pytest.raises(AttributeError):  # read-only: its rounded forms are made from it once
        emb.embed_scale = 2.0
