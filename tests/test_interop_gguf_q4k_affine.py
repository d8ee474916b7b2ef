"""Q4_K blocks in the affine format (bits 4, group size 32) without re-quantization: exact with
float32 scales/biases, checked against gguf.quants.dequantize and the native gguf_qmm op, and
through `python -m torch_qmm convert model.gguf out --format mlx`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from gguf_helpers import assert_matches_reference, k_quant_magnitude, random_k_blocks
from torch_qmm import quantized_matmul, reference
from torch_qmm.interop.gguf import GGUFFile, q4_k_to_affine, to_blocks
from torch_qmm.ops import gguf_matmul


@pytest.mark.parametrize("shape", [(1, 256), (7, 768), (33, 1024)])
def test_q4_k_to_affine_decodes_exactly_like_gguf(shape):
    n, k = shape
    blocks = random_k_blocks(T.Q4_K, n, k, np.random.default_rng(n))
    wq, scales, biases = q4_k_to_affine(torch.from_numpy(blocks), n, k)
    assert wq.shape == (n, k // 8) and scales.shape == biases.shape == (n, k // 32)
    assert scales.dtype == biases.dtype == torch.float32
    want = torch.from_numpy(quants.dequantize(blocks, T.Q4_K))  # float32: d*sc*q - dmin*m, one rounding
    got = reference.dequantize(wq, scales, biases, 4, 32)  # float64, exact scale*q + bias
    assert torch.equal(got.float(), want)  # bit for bit after the same single float32 rounding
    # numpy input gives the same
    wq2, s2, b2 = q4_k_to_affine(blocks, n, k)
    assert torch.equal(wq2, wq) and torch.equal(s2, scales) and torch.equal(b2, biases)


def test_q4_k_to_affine_scales_are_exact_products():
    # One hand-built super-block: every sub-block's scale / min taken from both halves of the
    # 12-byte packing (sub-blocks 0-3 low 6 bits; 4-7 nibbles + top bits).
    block = np.zeros(144, dtype=np.uint8)
    d, dmin = np.float16(0.0123), np.float16(0.00071)
    block[0:2] = np.array([d], dtype="<f2").view(np.uint8)
    block[2:4] = np.array([dmin], dtype="<f2").view(np.uint8)
    sc = np.array([1, 17, 40, 63, 5, 33, 62, 48])
    mn = np.array([0, 63, 21, 8, 59, 2, 44, 16])
    for j in range(4):
        block[4 + j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        block[8 + j] = mn[j] | ((mn[j + 4] >> 4) << 6)
        block[12 + j] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4)
    block[16:] = (np.arange(128) * 37 % 256).astype(np.uint8)
    wq, scales, biases = q4_k_to_affine(block.reshape(1, 144), 1, 256)
    assert torch.equal(scales[0].double(), torch.from_numpy(float(d) * sc.astype(np.float64)))
    assert torch.equal(biases[0].double(), torch.from_numpy(-float(dmin) * mn.astype(np.float64)))
    want = torch.from_numpy(quants.dequantize(block.reshape(1, 144), T.Q4_K))
    assert torch.equal(reference.dequantize(wq, scales, biases, 4, 32).float(), want)


@pytest.mark.parametrize("m", [1, 5])
def test_affine_qmm_on_q4_k_matches_gguf_qmm(m):
    n, k = 24, 512
    blocks = torch.from_numpy(random_k_blocks(T.Q4_K, n, k, np.random.default_rng(7)))
    wq, scales, biases = q4_k_to_affine(blocks, n, k)
    x = torch.randn(m, k)
    y_affine = quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
    y_gguf = gguf_matmul(x, blocks, int(T.Q4_K), n, k)
    w = torch.from_numpy(quants.dequantize(blocks.numpy(), T.Q4_K)).double()
    xd = x.double()
    # |x| @ (|d*sc*q| + |dmin*m|): the affine kernels hoist the bias (-dmin*m) as gguf_qmm the min
    ref, mag = xd @ w.T, k_quant_magnitude(x, blocks, T.Q4_K)
    assert_matches_reference(y_affine, ref, mag, torch.float32, "affine qmm of Q4_K")
    assert_matches_reference(y_gguf, ref, mag, torch.float32, "gguf_qmm")
    # the two kernels agree with each other within the sum of their tolerances
    err = (y_affine.double() - y_gguf.double()).abs()
    assert (err <= 2 * (2**-22 * ref.abs() + 2e-5 * mag) + 2**-148).all()


def test_float16_and_bfloat16_scales_are_rounded_not_exact():
    n, k = 8, 256
    blocks = random_k_blocks(T.Q4_K, n, k, np.random.default_rng(3))
    _, s32, b32 = q4_k_to_affine(blocks, n, k)
    for dtype in (torch.float16, torch.bfloat16):
        _, s, b = q4_k_to_affine(blocks, n, k, dtype)
        assert s.dtype == b.dtype == dtype
        assert torch.equal(s, s32.to(dtype)) and torch.equal(b, b32.to(dtype))
    # the float16 overflow is a clear error: d = 60000 times a 6-bit scale
    big = blocks.copy()
    big[0, 0:2] = np.array([60000.0], dtype="<f2").view(np.uint8)
    big[0, 4] = 63
    q4_k_to_affine(big, n, k)
    with pytest.raises(ValueError, match="overflow torch.float16; use dtype=torch.float32"):
        q4_k_to_affine(big, n, k, torch.float16)


def test_q4_k_to_affine_bad_input():
    blocks = random_k_blocks(T.Q4_K, 4, 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[N, K/256 \* 144\] = \[4, 288\] for N=4, K=512, "
                                         r"got shape \[4, 287\]"):
        q4_k_to_affine(blocks[:, :287], 4, 512)
    with pytest.raises(ValueError, match=r"= \[5, 288\] .* got shape \[4, 288\]"):
        q4_k_to_affine(blocks, 5, 512)
    with pytest.raises(ValueError, match=r"got shape \[1152\]"):
        q4_k_to_affine(blocks.reshape(-1), 4, 512)
    with pytest.raises(ValueError, match="K a positive multiple of 256"):
        q4_k_to_affine(blocks, 4, 500)
    with pytest.raises(ValueError, match="blocks must be uint8, got torch.int32"):
        q4_k_to_affine(torch.from_numpy(blocks).int(), 4, 512)
    with pytest.raises(ValueError, match="blocks must be uint8, got float32"):
        q4_k_to_affine(blocks.astype(np.float32), 4, 512)
    nan = blocks.copy()
    nan[1, 0:2] = np.array([np.nan], dtype="<f2").view(np.uint8)
    with pytest.raises(ValueError, match="non-finite"):
        q4_k_to_affine(nan, 4, 512)


# ---- convert --format mlx ---------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from test_interop_gguf_llama import hf_model, write_llama_gguf  # noqa: E402

from torch_qmm.__main__ import main  # noqa: E402
from torch_qmm.interop import QuantEmbedding, TiedQuantLinear, load_mlx, parse_quantization  # noqa: E402


def _read_mlx_weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory):
    """A tied llama GGUF: Q4_K projections and embedding, Q6_K down_proj; returns (path, held)."""
    path = tmp_path_factory.mktemp("q4k") / "m.gguf"
    held = write_llama_gguf(hf_model(tied=True), path, {"down_proj": T.Q6_K, "proj": T.Q4_K, "embed": T.Q4_K},
                            np.random.default_rng(5))
    return path, held


def test_convert_q4_k_gguf_to_mlx_is_exact_in_float32(q4_k_gguf, tmp_path, capsys):
    path, held = q4_k_gguf
    out = tmp_path / "mlx"
    assert main(["convert", str(path), str(out), "--format", "mlx", "--requantize", "rest", "--bits", "8",
                 "--group-size", "64"]) == 0
    text = capsys.readouterr().out
    report = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.startswith("  ")}
    assert report["model.layers.0.self_attn.q_proj"] == "lossless Q4_K -> affine b4 gs32"
    assert report["model.embed_tokens"] == "lossless Q4_K -> affine b4 gs32"
    assert report["model.layers.0.mlp.down_proj"] == "re-quantized Q6_K -> affine b8 gs64"
    assert sum(v.startswith("lossless Q4_K") for v in report.values()) == 13 and "rounded" not in text

    default, overrides = parse_quantization(json.loads((out / "config.json").read_text()))
    assert (default.bits, default.group_size) == (4, 32)  # the Q4_K layers
    assert (overrides["model.layers.0.mlp.down_proj"].bits, overrides["model.layers.0.mlp.down_proj"].group_size) \
        == (8, 64)  # Q6_K: re-quantized to --bits / --group-size
    weights = _read_mlx_weights(out)
    assert "lm_head.weight" not in weights  # tied to the quantized embedding
    q4_k_layers = [n for n in held if n.endswith("_proj.weight") and "down_proj" not in n]
    q4_k_layers.append("model.embed_tokens.weight")
    for name in q4_k_layers:
        prefix = name.removesuffix(".weight")
        scales, biases = weights[f"{prefix}.scales"], weights[f"{prefix}.biases"]
        assert scales.dtype == torch.float32
        w = reference.dequantize(weights[f"{prefix}.weight"], scales, biases, 4, 32)
        assert torch.equal(w.float(), held[name]), name  # gguf's own decode, bit for bit

    # and the folder loads back into a model whose layers hold those weights
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(out))
    load_mlx(model, out)
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, TiedQuantLinear)
    q = model.model.layers[1].self_attn.k_proj
    assert (q.bits, q.group_size) == (4, 32)
    assert torch.equal(reference.dequantize(q.qweight, q.scales, q.biases, 4, 32).float(),
                       held["model.layers.1.self_attn.k_proj.weight"])


def test_convert_q4_k_gguf_to_mlx_float16_says_not_exact(q4_k_gguf, tmp_path, capsys):
    path, held = q4_k_gguf
    out = tmp_path / "mlx16"
    assert main(["convert", str(path), str(out), "--format", "mlx", "--dtype", "float16"]) == 0
    text = capsys.readouterr().out
    report = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.startswith("  ")}
    assert report["model.layers.0.mlp.up_proj"] == "Q4_K scales rounded to float16 -> affine b4 gs32"
    assert "use --dtype float32 for exact Q4_K layers" in text
    assert report["model.layers.0.mlp.down_proj"].startswith("decoded Q6_K -> float float16 (rounded")  # no --requantize
    weights = _read_mlx_weights(out)
    s = weights["model.layers.0.mlp.up_proj.scales"]
    assert s.dtype == torch.float16
    wq, s32, _ = q4_k_to_affine(to_blocks(GGUFFile(path).tensors["blk.0.ffn_up.weight"]), 512, 256)
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], wq) and torch.equal(s, s32.half())
