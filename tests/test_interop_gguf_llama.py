"""A llama GGUF file (written here as llama.cpp's converter writes it: names, Q/K permutation,
metadata) loads into a transformers LlamaForCausalLM and gives the outputs of the same model with
the file's weights as decoded by gguf.quants.dequantize; so do qwen2 and qwen3 files (unpermuted,
qwen2's q/k/v biases, qwen3's per-head q/k norms), also checked against transformers' own GGUF
loader."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from gguf_helpers import LATTICE_TYPES, random_iq4_blocks, random_k_blocks, write_gguf
from torch_qmm.interop import GGUFLinear, QuantEmbedding, TiedQuantLinear
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
from torch_qmm.nn import QuantLinear

transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS, HIDDEN, FFN, VOCAB, LAYERS = 4, 2, 256, 512, 96, 2


def hf_model(tied: bool, attention_bias: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, attention_bias=attention_bias,
    )
    return random_model(config)


def random_model(config, experts_std: float | None = None):
    """The transformers model of `config`, seeded, with non-trivial norms so that a wrong mapping
    shows, biases as large as the products so that their rows matter, and (experts_std) the fused
    experts drawn from N(0, std), which transformers leaves uninitialized."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("_proj.bias"):
                p.uniform_(-1.0, 1.0)
            elif experts_std is not None and "experts" in name:
                p.normal_(0.0, experts_std)
    return model


def qwen_model(arch: str, tied: bool, head_dim: int | None = None):
    """A random Qwen2 / Qwen3 model of the test's sizes (qwen3: head_dim may differ from
    hidden / heads, as Qwen3-0.6B's 128 against 1024 / 16)."""
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    config = cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tied,
                 head_dim=head_dim or HIDDEN // HEADS)
    return random_model(config)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py (LlamaModel.permute): rotate-half rows -> interleaved pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{leaf}"


def write_llama_gguf(model, path, types: dict[str, T], rng, extra=None, drop=(), metadata=None) -> dict[str, torch.Tensor]:
    """Writes model as llama.cpp would; returns hf name -> the weights the file actually holds
    (decoded by the gguf package, permutation undone by the test's own inverse). extra: more
    float tensors (GGUF name -> array); drop: GGUF names left out; metadata: more or other
    entries (key after "<arch>." -> value). The architecture is the
    model's: llama (Q / K rows permuted) or qwen2 / qwen3 (not permuted; the head dim as
    attention.key_length / value_length, as llama.cpp writes a config's head_dim)."""
    config = model.config
    arch = config.model_type
    permuted = arch == "llama"
    tensors, held = {}, {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = p.detach().numpy().astype(np.float32)
        n_head = (HEADS if "q_proj" in name else KV_HEADS if "k_proj" in name else None) if permuted else None
        if n_head:
            w = llama_cpp_permute(w, n_head)
        qtype = next((t for pattern, t in types.items() if pattern in name), T.F32) if w.ndim == 2 else T.F32
        if qtype == T.F32:
            data, stored = w, w
        elif qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) + LATTICE_TYPES:  # gguf-py cannot quantize these: valid random blocks
            data = random_k_blocks(qtype, w.shape[0], w.shape[1], rng)
            stored = quants.dequantize(data, qtype)
        elif qtype in (T.IQ4_NL, T.IQ4_XS):  # gguf-py cannot quantize them either
            data = random_iq4_blocks(qtype, w.shape[0], w.shape[1], rng)
            stored = quants.dequantize(data, qtype)
        elif qtype in (T.TQ1_0, T.TQ2_0):  # types torch_qmm does not read: blocks of zeros
            per_block, block_bytes = GGML_QUANT_SIZES[qtype]
            data = np.zeros((w.shape[0], w.shape[1] // per_block * block_bytes), np.uint8)
            stored = quants.dequantize(data, qtype)
        else:
            data = quants.quantize(w, qtype)
            stored = quants.dequantize(data, qtype)
        tensors[gguf_name(name)] = (data, None if qtype == T.F32 else qtype)
        if n_head:  # inverse of the permutation above, by index bookkeeping
            index = llama_cpp_permute(np.arange(w.shape[0]), n_head)
            stored = stored[np.argsort(index)]
        held[name] = torch.from_numpy(np.ascontiguousarray(stored))
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update({k: (np.asarray(v, np.float32), None) for k, v in (extra or {}).items()})
    extra_metadata, metadata = metadata, {
        "block_count": LAYERS, "context_length": 64, "embedding_length": HIDDEN, "feed_forward_length": FFN,
        "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
    }
    if permuted:
        metadata["rope.dimension_count"] = HIDDEN // HEADS
    else:  # and the vocabulary size for transformers' GGUF loader (which otherwise counts the tokenizer's tokens)
        metadata["attention.key_length"] = metadata["attention.value_length"] = config.head_dim
        metadata["vocab_size"] = VOCAB
    metadata.update(extra_metadata or {})
    write_gguf(path, tensors, arch=arch, metadata={f"{arch}.{k}": v for k, v in metadata.items()})
    return held


MIXES = {
    "f32": {},
    "q8_0": {"proj": T.Q8_0, "embed": T.Q8_0, "lm_head": T.Q8_0},
    "mixed": {"q_proj": T.Q4_K, "k_proj": T.Q8_0, "v_proj": T.Q6_K, "o_proj": T.Q4_0, "gate_proj": T.Q5_1,
              "up_proj": T.Q4_K, "down_proj": T.Q6_K, "embed": T.Q4_0, "lm_head": T.Q6_K},
    # llama.cpp's Q5_K_M recipe (Q5_K, with V, the FFN down projection and the head in Q6_K) but for
    # Q and K, quantized by the gguf package from the model's weights: random K-quant blocks there
    # would saturate the attention's softmax, which hides the rotary embedding from the checks of
    # test_load_meta.py
    "q5_k": {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q6_K, "o_proj": T.Q5_K, "gate_proj": T.Q5_K,
             "up_proj": T.Q5_K, "down_proj": T.Q6_K, "embed": T.Q5_K, "lm_head": T.Q6_K},
    # llama.cpp's Q3_K_M and Q2_K recipes in one file (Q3_K and Q2_K, V in Q5_K, the output
    # projection Q4_K, the head Q6_K), Q and K from the gguf package as above.
    "q3_k_m": {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q5_K, "o_proj": T.Q4_K, "gate_proj": T.Q3_K,
               "up_proj": T.Q3_K, "down_proj": T.Q2_K, "embed": T.Q3_K, "lm_head": T.Q6_K},
    # llama.cpp's IQ4_XS recipe (IQ4_NL where a row is no multiple of 256; here for V and the FFN
    # down projection), Q and K from the gguf package as above.
    "iq4": {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.IQ4_NL, "o_proj": T.IQ4_XS, "gate_proj": T.IQ4_XS,
            "up_proj": T.IQ4_XS, "down_proj": T.IQ4_NL, "embed": T.IQ4_XS, "lm_head": T.Q6_K},
    # Every lattice i-quant (llama.cpp's IQ1 .. IQ3 files mix them with K-quants), Q and K as above.
    "iq_lattice": {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.IQ3_S, "o_proj": T.IQ2_XXS, "gate_proj": T.IQ1_S,
                   "up_proj": T.IQ2_S, "down_proj": T.IQ3_XXS, "embed": T.IQ2_XS, "lm_head": T.IQ1_M},
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mix", list(MIXES))
def test_llama_gguf_loads_into_transformers(tmp_path, mix, tied):
    source = hf_model(tied)
    held = write_llama_gguf(source, tmp_path / "m.gguf", MIXES[mix], np.random.default_rng(1))
    f = GGUFFile(tmp_path / "m.gguf")

    config = llama_config_from_gguf(f)
    assert (config.num_key_value_heads, config.hidden_size, config.tie_word_embeddings) == (KV_HEADS, HIDDEN, tied)
    model = transformers.LlamaForCausalLM(config).eval()
    before = config.to_dict()
    report = load_gguf_llama(model, f)
    # the model records its quantization in its own config; the caller's config is left as it was
    assert config.to_dict() == before and "quantization_config" not in before
    assert model.config is not config and model.model.config is model.config

    expected_model = hf_model(tied)  # same architecture, the file's weights
    expected_model.load_state_dict(held, strict=False)
    if tied:
        expected_model.lm_head.weight = expected_model.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2]])
    with torch.no_grad():
        got = model(ids).logits
        want = expected_model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    layer = model.model.layers[0]
    if mix == "mixed":
        assert isinstance(layer.self_attn.q_proj, GGUFLinear) and isinstance(layer.self_attn.k_proj, QuantLinear)
        assert isinstance(model.model.embed_tokens, QuantEmbedding)
        assert isinstance(model.lm_head, TiedQuantLinear if tied else GGUFLinear)
        assert report.quantized["model.layers.0.self_attn.v_proj"] == "Q6_K"
    elif mix == "q5_k":  # Q5_K: the file's blocks; the embedding its exact affine 5-bit form (group 32)
        assert isinstance(layer.self_attn.o_proj, GGUFLinear) and layer.self_attn.o_proj.ggml_type == int(T.Q5_K)
        assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.model.embed_tokens.bits == 5
        assert report.quantized["model.layers.0.mlp.up_proj"] == "Q5_K"
    elif mix == "q3_k_m":  # Q2_K / Q3_K: the file's blocks; the Q3_K embedding decoded to float
        assert isinstance(layer.mlp.gate_proj, GGUFLinear) and layer.mlp.gate_proj.ggml_type == int(T.Q3_K)
        assert isinstance(layer.mlp.down_proj, GGUFLinear) and layer.mlp.down_proj.ggml_type == int(T.Q2_K)
        assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
        assert report.quantized["model.layers.0.mlp.down_proj"] == "Q2_K"
    elif mix == "iq4":  # IQ4_XS: the file's blocks; IQ4_NL and the embedding exact affine 8-bit group 32
        assert isinstance(layer.mlp.gate_proj, GGUFLinear) and layer.mlp.gate_proj.ggml_type == int(T.IQ4_XS)
        for m in (layer.self_attn.v_proj, model.model.embed_tokens):
            assert isinstance(m, (QuantLinear, QuantEmbedding)) and (m.bits, m.group_size) == (8, 32)
        assert report.quantized["model.layers.0.mlp.down_proj"] == "IQ4_NL"
        assert report.quantized["model.layers.0.mlp.up_proj"] == "IQ4_XS"
    elif mix == "iq_lattice":  # the file's blocks; the embedding decoded to float (no exact affine form)
        for m, t in ((layer.self_attn.v_proj, T.IQ3_S), (layer.self_attn.o_proj, T.IQ2_XXS), (layer.mlp.gate_proj, T.IQ1_S),
                     (layer.mlp.up_proj, T.IQ2_S), (layer.mlp.down_proj, T.IQ3_XXS)):
            assert isinstance(m, GGUFLinear) and m.ggml_type == int(t)
        assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
        assert tied or (isinstance(model.lm_head, GGUFLinear) and model.lm_head.ggml_type == int(T.IQ1_M))
        assert report.quantized["model.layers.0.mlp.down_proj"] == "IQ3_XXS"
    elif mix == "f32":
        assert isinstance(layer.self_attn.q_proj, torch.nn.Linear) and not report.quantized


# A Q5_K_M-like mix for the qwen models (their biases and norms stay float32, as llama.cpp keeps
# them), with Q and K quantized from the model's weights, as in MIXES["q5_k"].
QWEN_MIX = {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q6_K, "down_proj": T.Q6_K, "proj": T.Q5_K,
            "embed": T.Q8_0, "lm_head": T.Q6_K}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch, head_dim", [("qwen2", None), ("qwen3", None), ("qwen3", 128)])
def test_qwen_gguf_loads_into_its_transformers_model(tmp_path, arch, head_dim, tied):
    source = qwen_model(arch, tied, head_dim)
    held = write_llama_gguf(source, tmp_path / "m.gguf", QWEN_MIX, np.random.default_rng(2))
    f = GGUFFile(tmp_path / "m.gguf")
    config = llama_config_from_gguf(f)
    assert type(config) is type(source.config) and config.head_dim == source.config.head_dim
    assert config.tie_word_embeddings == tied
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = load_gguf_llama(model, f)
    assert report.quantized["model.layers.1.self_attn.o_proj"] == "Q5_K"
    assert isinstance(model.model.layers[1].self_attn.v_proj, GGUFLinear)

    expected = qwen_model(arch, tied, head_dim)  # the same architecture holding the file's weights
    expected.load_state_dict(held, strict=False)
    if tied:
        expected.lm_head.weight = expected.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2]])
    with torch.no_grad():
        got, want = model(ids).logits, expected(ids).logits
    # float32 sums in other orders over at most 512 terms per layer (see the llama test above)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # transformers' own GGUF loader reads no head dim from a qwen file: qwen2 takes hidden / heads,
    # qwen3 its config class's default, 128. It reads the files whose head dim is that one.
    if source.config.head_dim == {"qwen2": HIDDEN // HEADS, "qwen3": 128}[arch]:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
        assert type(theirs.config) is type(config)
        with torch.no_grad():
            torch.testing.assert_close(got, theirs(ids).logits, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_a_file_of_another_architecture_than_the_model_is_an_error(tmp_path):
    write_llama_gguf(qwen_model("qwen2", tied=False), tmp_path / "q.gguf", {}, np.random.default_rng(0))
    f = GGUFFile(tmp_path / "q.gguf")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: getattr(llama_config_from_gguf(f), k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                           "num_hidden_layers", "num_attention_heads",
                                                           "num_key_value_heads")}))
    with pytest.raises(ValueError, match=r"q\.gguf: the file's architecture is 'qwen2' \(transformers model type "
                                         r"'qwen2'\), the model's config is 'llama'; build the model from the file"):
        load_gguf_llama(llama, f)


@pytest.mark.parametrize("key", ["attention.key_length", "attention.value_length"])
def test_a_key_or_value_length_other_than_the_rotary_dimension_is_an_error(tmp_path, key):
    from torch_qmm.interop.gguf_llama import check_llama_metadata

    write_llama_gguf(hf_model(False), tmp_path / "same.gguf", {}, np.random.default_rng(0),
                     metadata={key: HIDDEN // HEADS})
    assert check_llama_metadata(GGUFFile(tmp_path / "same.gguf"))["head_dim"] == HIDDEN // HEADS
    write_llama_gguf(hf_model(False), tmp_path / "m.gguf", {}, np.random.default_rng(0), metadata={key: 32})
    with pytest.raises(ValueError, match=rf"m\.gguf: metadata 'llama\.{key}' = 32 differs from the head dim 64 of "
                                         r"'llama\.rope\.dimension_count'"):
        check_llama_metadata(GGUFFile(tmp_path / "m.gguf"))


def test_a_file_with_types_torch_qmm_does_not_read_is_refused_before_a_model_is_built(tmp_path):
    # llama.cpp's ternary files (TQ1_0 / TQ2_0) mix their types with the K-quants torch_qmm reads: the
    # config is refused whole, naming the types and how many tensors hold them.
    path = tmp_path / "m.gguf"
    write_llama_gguf(hf_model(False), path, {"q_proj": T.TQ1_0, "k_proj": T.TQ1_0, "v_proj": T.TQ2_0,
                                             "proj": T.Q4_K}, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"m\.gguf: holds tensors of GGUF types torch_qmm does not read: TQ1_0 "
                                         r"\(4 tensors\), TQ2_0 \(2 tensors\); it reads F32, F16"):
        llama_config_from_gguf(GGUFFile(path))


def test_head_count_disagreeing_with_the_file_is_an_error(tmp_path):
    held_model = hf_model(False)
    write_llama_gguf(held_model, tmp_path / "m.gguf", {}, np.random.default_rng(0))
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    config.intermediate_size = 256
    with pytest.raises(ValueError, match=r"'blk.0.ffn_gate.weight' has shape \[512, 256\], model layer .* expects \[256, 256\]"):
        load_gguf_llama(transformers.LlamaForCausalLM(config), tmp_path / "m.gguf")


def test_a_kv_head_count_the_q_k_rows_do_not_fit_names_the_file_tensor_and_config_field(tmp_path):
    write_llama_gguf(hf_model(False), tmp_path / "m.gguf", {}, np.random.default_rng(0))
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    config.num_key_value_heads = 3  # the file's K rows: 2 heads of 64
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "m.gguf")) + r": tensor 'blk\.0\.attn_k\.weight' does "
                                         r"not fit the model's config\.num_key_value_heads = 3 \(cannot undo"):
        load_gguf_llama(transformers.LlamaForCausalLM(config), tmp_path / "m.gguf")


def test_non_llama_architecture_is_an_error(tmp_path):
    write_gguf(tmp_path / "g.gguf", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)}, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not in the llama family"):
        llama_config_from_gguf(GGUFFile(tmp_path / "g.gguf"))


@pytest.mark.parametrize("key", ["block_count", "attention.head_count", "embedding_length"])
def test_a_bool_where_an_integer_belongs_is_an_error(tmp_path, key):
    # GGUF has a BOOL type; True is an int in Python but no layer or head count.
    write_gguf(tmp_path / "b.gguf", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)},
               metadata={f"llama.{key}": True})
    with pytest.raises(ValueError, match=rf"metadata 'llama\.{key.replace('.', '[.]')}' must be a positive integer, "
                                         r"got True"):
        llama_config_from_gguf(GGUFFile(tmp_path / "b.gguf"))


def _llama_tensors(hidden, heads, kv_heads, head_dim, ffn, vocab=40):
    z = lambda *shape: (np.zeros(shape, np.float32), None)  # noqa: E731
    tensors = {"token_embd.weight": z(vocab, hidden), "output_norm.weight": z(hidden)}
    for name, shape in [("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                        ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                        ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn)),
                        ("attn_norm", (hidden,)), ("ffn_norm", (hidden,))]:
        tensors[f"blk.0.{name}.weight"] = z(*shape)
    return tensors


def test_every_metadata_field_reaches_its_config_field(tmp_path):
    # Values unlike LlamaConfig's defaults (and exact in float32), so a key read into the wrong field,
    # or not read, changes the config. head_dim 16 != hidden / heads = 8: the tensor shapes agree
    # with the metadata only when rope.dimension_count is read.
    metadata = {"llama.block_count": 1, "llama.context_length": 77, "llama.embedding_length": 32,
                "llama.feed_forward_length": 48, "llama.attention.head_count": 4,
                "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 2.0**-7,
                "llama.rope.freq_base": 123456.0, "llama.rope.dimension_count": 16}
    write_gguf(tmp_path / "m.gguf", _llama_tensors(32, 4, 2, 16, 48), metadata=metadata)
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    got = {"num_hidden_layers": config.num_hidden_layers, "max_position_embeddings": config.max_position_embeddings,
           "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
           "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_parameters["rope_theta"],
           "head_dim": config.head_dim, "vocab_size": config.vocab_size,
           "tie_word_embeddings": config.tie_word_embeddings}
    assert got == {"num_hidden_layers": 1, "max_position_embeddings": 77, "hidden_size": 32, "intermediate_size": 48,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 2.0**-7,
                   "rope_theta": 123456.0, "head_dim": 16, "vocab_size": 40, "tie_word_embeddings": True}


def test_absent_optional_metadata_takes_the_file_shapes(tmp_path):
    # No head_count_kv (all heads have their own K/V), no dimension_count (hidden / heads) and no
    # feed_forward_length (the rows of blk.0.ffn_up.weight).
    metadata = {"llama.block_count": 1, "llama.embedding_length": 32, "llama.attention.head_count": 4}
    write_gguf(tmp_path / "m.gguf", _llama_tensors(32, 4, 4, 8, 40), metadata=metadata)
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (4, 8, 40)


@pytest.mark.parametrize("mix", ["f32", "mixed"])
def test_attention_biases_follow_their_rows(tmp_path, mix):
    # Q/K/V/O biases (llama.cpp's optional attention biases): llama.cpp permutes attn_q.bias /
    # attn_k.bias with their weight rows; the loader undoes both and keeps v / o biases as they
    # are. No metadata key says the model has biases: the config takes attention_bias from the
    # tensors.
    source = hf_model(False, attention_bias=True)
    held = write_llama_gguf(source, tmp_path / "m.gguf", MIXES[mix], np.random.default_rng(2))
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(GGUFFile(tmp_path / "m.gguf").tensors)
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert (config.attention_bias, config.mlp_bias) == (True, False)
    model = transformers.LlamaForCausalLM(config).eval()
    load_gguf_llama(model, tmp_path / "m.gguf")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        got = getattr(model.model.layers[1].self_attn, proj).bias
        assert torch.equal(got.detach(), held[f"model.layers.1.self_attn.{proj}.bias"]), proj
    expected_model = hf_model(False, attention_bias=True)
    expected_model.load_state_dict(held)
    ids = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2]])
    with torch.no_grad():
        got, want = model(ids).logits, expected_model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def _small_llama_file(folder, **kwargs):
    folder.mkdir(exist_ok=True)
    write_llama_gguf(hf_model(False), folder / "m.gguf", {}, np.random.default_rng(0), **kwargs)
    return folder / "m.gguf"


def _llama_for(path):
    return transformers.LlamaForCausalLM(llama_config_from_gguf(GGUFFile(path))).eval()


def test_tensors_the_model_lacks_are_errors_unless_strict_is_false(tmp_path):
    path = _small_llama_file(tmp_path, extra={"blk.0.attn_gate.weight": np.ones((4, HIDDEN)),
                                              "output_norm.scale": np.ones(HIDDEN)})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_gate.weight' -> 'model.layers.0.attn_gate.weight': no "
                                         r"such module in the model"):
        load_gguf_llama(_llama_for(path), path)
    path2 = _small_llama_file(tmp_path / "b", extra={"output_norm.scale": np.ones(HIDDEN)})
    with pytest.raises(ValueError, match=r"tensor 'output_norm.scale' -> 'model.norm.scale' is not a parameter of "
                                         r"the model"):
        load_gguf_llama(_llama_for(path2), path2)
    # strict=False: the extra tensors are skipped and the model is the strict load of the file without them
    model = _llama_for(path)
    load_gguf_llama(model, path, strict=False)
    plain = _small_llama_file(tmp_path / "c")
    want = _llama_for(plain)
    load_gguf_llama(want, plain)
    ids = torch.tensor([[1, 5, 9, 95]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)


def test_missing_tensors_and_shapes_the_config_disagrees_with_are_errors(tmp_path):
    path = _small_llama_file(tmp_path, drop=("blk.1.ffn_norm.weight",))
    model = transformers.LlamaForCausalLM(hf_model(False).config).eval()
    with pytest.raises(ValueError, match=r"the file has no tensors for \['model.layers.1.post_attention_layernorm.weight'\]"):
        load_gguf_llama(model, path)
    load_gguf_llama(transformers.LlamaForCausalLM(hf_model(False).config), path, strict=False)  # what is there loads
    path = _small_llama_file(tmp_path / "b")
    config = llama_config_from_gguf(GGUFFile(path))
    config.vocab_size = VOCAB + 1
    with pytest.raises(ValueError, match=rf"tensor 'token_embd.weight' has shape \[{VOCAB}, {HIDDEN}\], model embedding "
                                         rf"'model.embed_tokens' expects \[{VOCAB + 1}, {HIDDEN}\]"):
        load_gguf_llama(transformers.LlamaForCausalLM(config), path)
    model = _llama_for(path)
    model.model.norm.weight = torch.nn.Parameter(torch.ones(HIDDEN + 2))
    with pytest.raises(ValueError, match=rf"tensor 'output_norm.weight' has shape \[{HIDDEN}\], the model's "
                                         rf"'model.norm.weight' is \[{HIDDEN + 2}\]"):
        load_gguf_llama(model, path)


def test_a_model_on_the_meta_device_loads_and_one_the_file_cannot_fill_is_a_clear_error(tmp_path):
    # Built on meta, the model gets every tensor from the file (the rotary frequencies computed from
    # the config): the float-built load's outputs (tests/test_load_meta.py checks more).
    path = _small_llama_file(tmp_path)
    want = _llama_for(path)
    load_gguf_llama(want, path)
    with torch.device("meta"):
        model = _llama_for(path)
    load_gguf_llama(model, path)
    ids = torch.tensor([[1, 5, 9, 95]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)
    # A tensor the file does not hold would stay on meta: refused, named (strict names it first).
    path = _small_llama_file(tmp_path / "b", drop=("output_norm.weight",))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_model(False).config)
    with pytest.raises(ValueError, match=r"load_gguf_llama: .*m.gguf: the model was built on the meta device and 1 of "
                                         r"its tensors have no values after the load \(the file does not hold "
                                         r"them\): \['model.norm.weight'\]"):
        load_gguf_llama(model, path, strict=False)


def test_a_file_with_some_attention_biases_missing_is_refused(tmp_path):
    write_llama_gguf(hf_model(False, attention_bias=True), tmp_path / "m.gguf", {}, np.random.default_rng(0),
                     drop=("blk.1.attn_output.bias",))
    with pytest.raises(ValueError, match=r"no tensor 'blk.1.attn_output.bias', which the metadata"):
        llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
