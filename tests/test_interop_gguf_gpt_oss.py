"""gpt-oss GGUF files, written here as llama.cpp's converter (convert_hf_to_gguf.py's GptOssModel)
writes them: the post-attention norm, attention sinks and biased router under their GGUF names,
transformers' gate_up_proj [E, H, 2I] (gate and up columns alternating) split into gate (its even
columns) and up (its odd ones) as [E, I, H], every projection's bias, sliding window and yarn
metadata, the experts as MXFP4 blocks (ggml type 39, made by the gguf package's quantizer). Each
loads into transformers' GptOssForCausalLM and gives the outputs of the same model holding the
file's weights as the gguf package decodes them; the MXFP4 experts become mxfp4 QuantSwitchLinear
layers holding the file's bits."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from gguf_helpers import write_gguf
from test_interop_gguf_llama import random_model
from test_interop_gguf_moe import _encode
from torch_qmm.interop.gguf import GGUFFile, GGUFFormatError, GGUFTensor, linear_from_gguf, to_fp
from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
from torch_qmm.interop.modules import GGUFSwitchLinear
from torch_qmm.nn import QuantLinear
from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

transformers = pytest.importorskip("transformers")

# head_dim 32 with 4 heads: the attention's width (128) is not the hidden size (256), as
# gpt-oss-20b's 64 x 64 against 2880. A window of 4 tokens over 12 makes the sliding layers differ.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, LAYERS, EXPERTS, TOP_K, WINDOW = 4, 2, 32, 256, 256, 96, 2, 4, 2, 4
IDS = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2, 17, 64, 80, 3]])


def gpt_oss_model():
    """A random GptOssForCausalLM with gpt-oss's own rope (yarn, factor 32, truncate False)."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=WINDOW, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False)
    model = random_model(config, experts_std=0.05)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.bias", "_proj_bias")):
                p.uniform_(-1.0, 1.0)
    return model


_NAMES = [
    (r"^model\.embed_tokens\.", "token_embd."), (r"^model\.norm\.", "output_norm."), (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.", r"blk.\1."), (r"self_attn\.q_proj", "attn_q"), (r"self_attn\.k_proj", "attn_k"),
    (r"self_attn\.v_proj", "attn_v"), (r"self_attn\.o_proj", "attn_output"), (r"self_attn\.sinks$", "attn_sinks.weight"),
    (r"input_layernorm", "attn_norm"), (r"post_attention_layernorm", "post_attention_norm"),
    (r"mlp\.router\.", "ffn_gate_inp."),
]


def _gguf_name(hf: str) -> str:
    for pattern, repl in _NAMES:
        hf = re.sub(pattern, repl, hf)
    return hf


def write_gpt_oss_gguf(model, path, types: dict[str, T], rng, metadata=None, drop=(), fields=()) -> dict[str, torch.Tensor]:
    """Writes model as convert_hf_to_gguf.py's GptOssModel does (types: "experts" / a substring of
    a 2-D parameter name -> GGML type, F32 otherwise; fields: more metadata, gguf_helpers.write_gguf);
    returns hf name -> the values the file holds."""
    config = model.config
    tensors, held = {}, {}
    experts_type = types.get("experts", T.F32)
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        block = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, H, 2I]: gate the even columns, up the odd ones
            rows = np.ascontiguousarray(w.transpose(0, 2, 1))  # [E, 2I, H]
            stored = np.empty_like(rows)
            for part, start in (("gate", 0), ("up", 1)):
                data, s = _encode(np.ascontiguousarray(rows[:, start::2]), experts_type, rng)
                tensors[f"blk.{block}.ffn_{part}_exps.weight"] = (data, None if experts_type == T.F32 else experts_type)
                stored[:, start::2] = s
            held[name] = torch.from_numpy(np.ascontiguousarray(stored.transpose(0, 2, 1)))
            continue
        if name.endswith("mlp.experts.gate_up_proj_bias"):
            tensors[f"blk.{block}.ffn_gate_exps.bias"] = (np.ascontiguousarray(w[:, 0::2]), None)
            tensors[f"blk.{block}.ffn_up_exps.bias"] = (np.ascontiguousarray(w[:, 1::2]), None)
            held[name] = p.detach().clone()
            continue
        if name.endswith("mlp.experts.down_proj"):  # [E, I, H] -> [E, H, I]
            data, s = _encode(np.ascontiguousarray(w.transpose(0, 2, 1)), experts_type, rng)
            tensors[f"blk.{block}.ffn_down_exps.weight"] = (data, None if experts_type == T.F32 else experts_type)
            held[name] = torch.from_numpy(np.ascontiguousarray(s.transpose(0, 2, 1)))
            continue
        if name.endswith("mlp.experts.down_proj_bias"):
            tensors[f"blk.{block}.ffn_down_exps.bias"] = (w, None)
            held[name] = p.detach().clone()
            continue
        qtype = next((t for pattern, t in types.items() if pattern in name), T.F32) if w.ndim == 2 else T.F32
        data, s = _encode(w, qtype, rng)
        tensors[_gguf_name(name)] = (data, None if qtype == T.F32 else qtype)
        held[name] = torch.from_numpy(np.ascontiguousarray(s)).reshape(p.shape)
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    rope = config.rope_parameters
    meta = {
        "block_count": LAYERS, "context_length": config.max_position_embeddings, "embedding_length": HIDDEN,
        "feed_forward_length": INTER, "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps), "rope.freq_base": float(rope["rope_theta"]),
        "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM, "expert_count": EXPERTS,
        "expert_used_count": TOP_K, "attention.sliding_window": WINDOW, "expert_feed_forward_length": INTER,
        "rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]), "rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
    }
    meta.update(metadata or {})
    write_gguf(path, tensors, arch="gpt-oss", metadata={f"gpt-oss.{k}": v for k, v in meta.items() if v is not None},
               fields=fields)
    return held


def _expected(held: dict) -> torch.nn.Module:
    model = gpt_oss_model()
    model.load_state_dict(held)
    return model


# Sums of float32 products in other orders (at most 256 terms per output, 2 layers), and routing
# weights that a top-k choice between near-equal router logits can make differ: rtol 1e-4 of the
# largest logit, as the other GGUF model tests.
def _assert_logits(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


MXFP4_MIX = {"experts": T.MXFP4, "proj": T.Q8_0, "embed": T.Q8_0, "lm_head": T.Q8_0}


@pytest.mark.parametrize("mix", ["mxfp4", "q8_0", "q4_k", "f32"])
def test_gpt_oss_gguf_loads_into_its_transformers_model(tmp_path, mix):
    types = {"mxfp4": MXFP4_MIX, "q8_0": {"experts": T.Q8_0}, "q4_k": {"experts": T.Q4_K, "proj": T.MXFP4},
             "f32": {}}[mix]
    source = gpt_oss_model()
    held = write_gpt_oss_gguf(source, tmp_path / "m.gguf", types, np.random.default_rng(1))
    f = GGUFFile(tmp_path / "m.gguf")
    config = llama_config_from_gguf(f)
    assert type(config) is transformers.GptOssConfig
    # the config is the source model's: every field the forward reads, the yarn parameters too
    for field in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim", "sliding_window",
                  "layer_types", "attention_bias", "rope_parameters", "swiglu_limit", "swiglu_alpha"):
        assert getattr(config, field) == getattr(source.config, field), field
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = load_gguf_llama(model, f)

    experts = model.model.layers[1].mlp.experts
    if mix == "f32":
        assert not isinstance(experts, QuantFusedExperts) and not report.quantized
    else:
        assert isinstance(experts, QuantFusedExperts) and experts.interleaved
        kind = GGUFSwitchLinear if mix == "q4_k" else QuantSwitchLinear
        assert type(experts.gate_up_proj) is kind and type(experts.down_proj) is kind
        assert experts.gate_up_proj.bias is not None and experts.down_proj.bias is not None
        name = {"mxfp4": "MXFP4", "q8_0": "Q8_0", "q4_k": "Q4_K"}[mix]
        assert report.quantized["model.layers.1.mlp.experts"] == f"experts gate {name}, up {name}, down {name}"
    if mix == "mxfp4":
        assert experts.gate_up_proj.mode == "mxfp4" and experts.down_proj.mode == "mxfp4"
    if mix == "q4_k":  # the MXFP4 attention projections: mxfp4 QuantLinear with their biases
        q_proj = model.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, QuantLinear) and q_proj.mode == "mxfp4" and q_proj.bias is not None
    with torch.no_grad():
        got = model(IDS).logits
        want = _expected(held)(IDS).logits
    _assert_logits(got, want)


def test_mxfp4_experts_hold_the_files_bits(tmp_path):
    source = gpt_oss_model()
    write_gpt_oss_gguf(source, tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(2))
    f = GGUFFile(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    experts = model.model.layers[0].mlp.experts
    # every weight of every expert, decoded by the layer itself (one-hot x), against gguf's decode
    # of the file's gate / up / down tensors, the gate_up rows alternating gate, up
    gate, up, down = (torch.from_numpy(quants.dequantize(f.tensors[f"blk.0.ffn_{p}_exps.weight"].raw, T.MXFP4))
                      .reshape(EXPERTS, -1, HIDDEN if p != "down" else INTER) for p in ("gate", "up", "down"))
    for e in range(EXPERTS):
        idx = torch.tensor([e])
        for layer, want in ((experts.gate_up_proj, torch.stack([gate[e], up[e]], 1).reshape(2 * INTER, HIDDEN)),
                            (experts.down_proj, down[e])):
            got = layer(torch.eye(layer.in_features)[None], idx)[0]  # [in, out]: row j is column j of W, + bias
            torch.testing.assert_close(got, want.T + layer.bias[e], rtol=0, atol=0)


def test_gpt_oss_gguf_loads_into_a_model_on_the_meta_device(tmp_path):
    held = write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(3))
    f = GGUFFile(tmp_path / "m.gguf")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():
        _assert_logits(model(IDS).logits, _expected(held)(IDS).logits)


def test_a_file_without_yarn_gets_the_plain_rotary_embedding(tmp_path):
    # GptOssConfig's own default is gpt-oss's yarn; a file that does not scale its rope must not get it
    write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(4),
                       metadata={"rope.scaling.type": None, "rope.scaling.factor": None,
                                 "rope.scaling.original_context_length": None, "rope.scaling.yarn_beta_fast": None,
                                 "rope.scaling.yarn_beta_slow": None})
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert config.rope_parameters["rope_type"] == "default" and config.rope_parameters["rope_theta"] == 150000.0


def test_yarn_keys_the_config_cannot_take_warn_and_a_file_without_a_base_gets_llama_cpp_s(tmp_path):
    write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(10),
                       metadata={"rope.scaling.yarn_attn_factor": 1.5, "rope.freq_base": None})
    with pytest.warns(UserWarning, match=r"gpt-oss.rope.scaling.yarn_attn_factor, which the transformers config"):
        config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert config.rope_parameters["rope_theta"] == 10000.0 and config.rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize("drop, metadata, message", [
    (("blk.1.attn_sinks.weight",), {}, r"no tensor 'blk.1.attn_sinks.weight'"),
    (("blk.0.ffn_up_exps.bias",), {}, r"no tensor 'blk.0.ffn_up_exps.bias'"),
    (("blk.0.ffn_gate_inp.bias",), {}, r"no tensor 'blk.0.ffn_gate_inp.bias'"),
    ((), {"rope.scaling.factor": None}, r"'gpt-oss.rope.scaling.type' is 'yarn' but 'gpt-oss.rope.scaling.factor' is "
                                        "missing"),
    ((), {"rope.scaling.factor": -2.0}, r"'gpt-oss.rope.scaling.factor' must be a positive finite number"),
    ((), {"attention.sliding_window": 0}, r"'gpt-oss.attention.sliding_window' must be a positive integer"),
])
def test_gpt_oss_metadata_disagreeing_with_the_file_is_refused(tmp_path, drop, metadata, message):
    write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(5), drop=drop,
                       metadata=metadata)
    with pytest.raises(ValueError, match=message):
        llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))


def _mxfp4_tensor(blocks: np.ndarray) -> GGUFTensor:
    return GGUFTensor("w", int(T.MXFP4), (blocks.shape[0], 32 * (blocks.shape[1] // 17)), blocks, "m.gguf")


def test_mxfp4_layers_are_the_gguf_decode_bit_for_bit():
    rng = np.random.default_rng(6)
    # every code in every position, scale bytes from 0 (2^-127) to 254 (2^127, codes up to 1.5)
    blocks = np.zeros((16, 8, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(0, 255, (16, 8))
    blocks[..., 1:] = rng.integers(0, 256, (16, 8, 16))
    blocks[0, :, 0] = [0, 1, 2, 100, 127, 128, 200, 254]
    blocks[0, 7, 1:] = 0x32  # codes 2 and 3 (1.0, 1.5): finite at byte 254
    big = blocks[..., 0] > 200
    blocks[..., 1:][big] &= 0x33  # magnitudes <= 1.5 where 2^(e-127) is large
    blocks = blocks.reshape(16, -1)
    t = _mxfp4_tensor(blocks)
    want = torch.from_numpy(quants.dequantize(blocks, T.MXFP4))
    assert torch.isfinite(want).all()
    layer = linear_from_gguf(t)
    got = layer(torch.eye(256)).T
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("byte, code", [(255, 0), (254, 4)])
def test_mxfp4_blocks_beyond_float32_are_refused_naming_the_tensor(byte, code):
    blocks = np.zeros((2, 17), dtype=np.uint8)
    blocks[:, 0] = 127
    blocks[1, 0], blocks[1, 5] = byte, code  # scale 2^128 (NaN in the MX format), or 2.0 * 2^127
    with pytest.raises(GGUFFormatError, match=r"m.gguf: tensor 'w' \(MXFP4\) holds a block with scale byte 255"):
        to_fp(_mxfp4_tensor(blocks))


@pytest.mark.parametrize("mix", ["mxfp4", "q4_k"])
def test_convert_to_mlx_keeps_the_experts_and_mlx_lm_computes_the_same(tmp_path, mix):
    # MXFP4 experts stay mxfp4; Q4_K ones become exact affine 4-bit group-32 experts, their biases
    # (gpt-oss's experts have them) carried along
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model  # the test extra installs mlx-lm: no skip

    from torch_qmm.__main__ import main

    types = MXFP4_MIX if mix == "mxfp4" else {"experts": T.Q4_K, "proj": T.Q8_0, "embed": T.Q8_0, "lm_head": T.Q8_0}
    write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", types, np.random.default_rng(7))
    with pytest.warns(UserWarning, match="no tokenizer.ggml.model metadata"):
        assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "mlx"), "--format", "mlx"]) == 0
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    quantization = config["quantization"]
    want = {"group_size": 32, "bits": 4, "mode": "mxfp4" if mix == "mxfp4" else "affine"}
    assert quantization["model.layers.1.mlp.experts.down_proj"] == want
    assert (quantization["bits"], quantization["mode"]) == (8, "affine")  # the Q8_0 layers
    f = GGUFFile(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    with torch.no_grad():
        ours = model(IDS).logits
    theirs, _ = load_model(tmp_path / "mlx")
    got = torch.from_numpy(np.array(theirs(mx.array(IDS.numpy())).astype(mx.float32)))
    # mlx_lm rounds yarn's correction range to whole dimensions (as llama.cpp does; gpt-oss's config
    # says truncate False, which the torch model follows): the two rotary embeddings differ in a few
    # dimensions by an amount that grows with the position, about 1e-5 of the logits over these 12
    _assert_logits(got, ours)


def test_convert_to_transformers_refuses_mixed_formats_naming_the_way_out(tmp_path, capsys):
    from torch_qmm.__main__ import main

    write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(8))
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "hf")]) == 1
    assert "more than one group size / mode ([(32, 'affine'), (32, 'mxfp4')]); convert with --format mlx" in \
        capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_the_tokenizer_of_a_gpt_oss_file_is_built_and_written(tmp_path):
    # transformers' own GGUF reader fails on gpt-oss's rope.scaling metadata ("only 0-dimensional
    # arrays can be converted to Python scalars"): the tokenizer is built from the file's
    # tokenizer metadata alone, here the real SmolLM2 GGUF's, and tokenizes as transformers'
    # tokenizer of that real file
    from test_interop_mlx_lm import smollm2_gguf

    from torch_qmm.interop.gguf_tokenizer import save_gguf_tokenizer, tokenizer_fields

    real = smollm2_gguf()
    write_gpt_oss_gguf(gpt_oss_model(), tmp_path / "m.gguf", MXFP4_MIX, np.random.default_rng(9),
                       fields=tokenizer_fields(GGUFFile(real)))
    with pytest.raises(TypeError, match="0-dimensional"):  # if transformers fixes its reader, this says so
        transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    (tmp_path / "out").mkdir()
    assert "tokenizer.json" in save_gguf_tokenizer(tmp_path / "m.gguf", tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name)
    text = "The quick brown fox, 12345 times: don't stop!"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids == theirs(text).input_ids
