"""Mixture-of-experts GGUF files (qwen2moe, qwen3moe, and Mixtral as architecture llama with
experts, its Q / K rows permuted), written here as llama.cpp's converter writes
them (3-D expert tensors ffn_{gate,up,down}_exps, the router ffn_gate_inp, qwen2moe's shared
expert *_shexp and its 1-D gate), load into the transformers model of their architecture and give
the outputs of the same model holding the file's weights as the gguf package decodes them, and
those of transformers' own GGUF loader of the file. The experts stay quantized in the file's
formats: K-quant blocks as GGUFSwitchLinear, the 32-weight types as affine
QuantSwitchLinear, in one QuantFusedExperts."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from gguf_helpers import LATTICE_TYPES, random_iq4_blocks, random_k_blocks, write_gguf
from test_interop_gguf_llama import llama_cpp_permute, random_model
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf, load_gguf_llama
from torch_qmm.interop.modules import GGUFSwitchLinear
from torch_qmm.nn_moe import QuantFusedExperts, QuantSwitchLinear

transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS, HIDDEN, VOCAB, LAYERS, EXPERTS, TOP_K = 4, 2, 256, 96, 2, 4, 2
IDS = torch.tensor([[1, 5, 9, 95, 0, 33, 33, 2, 17, 64, 80, 3]])


MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "mixtral": "mixtral"}


def moe_model(arch: str, moe_inter: int, shared_inter: int = 512):
    """A random Qwen2-MoE / Qwen3-MoE / Mixtral model; norm_topk_prob as llama.cpp computes each."""
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, num_experts_per_tok=TOP_K,
              head_dim=HIDDEN // HEADS)
    if arch == "mixtral":  # its experts' width is intermediate_size
        kw.update(num_local_experts=EXPERTS, intermediate_size=moe_inter)
    else:
        kw.update(num_experts=EXPERTS, intermediate_size=512, moe_intermediate_size=moe_inter,
                  norm_topk_prob=arch == "qwen3moe")
    if arch == "qwen2moe":
        kw["shared_expert_intermediate_size"] = shared_inter
    return random_model(transformers.AutoConfig.for_model(MODEL_TYPES[arch], **kw), experts_std=0.05)


_NAMES = [
    (r"^model\.embed_tokens\.", "token_embd."), (r"^model\.norm\.", "output_norm."), (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.", r"blk.\1."), (r"self_attn\.q_proj", "attn_q"), (r"self_attn\.k_proj", "attn_k"),
    (r"self_attn\.v_proj", "attn_v"), (r"self_attn\.o_proj", "attn_output"), (r"self_attn\.q_norm", "attn_q_norm"),
    (r"self_attn\.k_norm", "attn_k_norm"), (r"input_layernorm", "attn_norm"), (r"post_attention_layernorm", "ffn_norm"),
    (r"mlp\.shared_expert_gate", "ffn_gate_inp_shexp"), (r"mlp\.shared_expert\.(gate|up|down)_proj", r"ffn_\1_shexp"),
    (r"mlp\.gate\.", "ffn_gate_inp."),
]


def _gguf_name(hf: str) -> str:
    for pattern, repl in _NAMES:
        hf = re.sub(pattern, repl, hf)
    return hf


def _encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(file data, the weights it holds as gguf decodes them) of a float array [..., K]."""
    if qtype == T.F32:
        return w, w
    rows = w.reshape(-1, w.shape[-1])
    if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS) + LATTICE_TYPES:  # gguf-py cannot quantize these: valid random blocks
        data = random_k_blocks(qtype, rows.shape[0], rows.shape[1], rng)
    elif qtype == T.IQ4_NL:
        data = random_iq4_blocks(qtype, rows.shape[0], rows.shape[1], rng)
    else:
        data = quants.quantize(rows, qtype)
    stored = quants.dequantize(data, qtype).reshape(w.shape)
    return data.reshape(*w.shape[:-1], -1), stored


def write_moe_gguf(model, path, types: dict[str, T], rng, drop=(), metadata=None,
                   shared_gate_1d: bool = False, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """Writes model as llama.cpp's converter would (types: "gate_exps" / "up_exps" / "down_exps" /
    a substring of a 2-D parameter name -> GGML type, F32 otherwise); returns hf name -> the values
    the file holds. The shared-expert gate is [1, H] as the converter writes it, or [H]
    (shared_gate_1d), the shape llama.cpp's loader declares (it reads both). per_expert: one 2-D
    tensor per expert, blk.N.ffn_{gate,up,down}.E.weight (older Mixtral files)."""
    config = model.config
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}[config.model_type]
    tensors, held = {}, {}
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        n_head = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(name.split(".")[-2]) if arch == "llama" else None
        if n_head:  # llama.cpp's permutation of llama's Q / K rows; `held` keeps the model's order
            index = llama_cpp_permute(np.arange(w.shape[0]), n_head)
            w = w[index]
        if name.endswith("mlp.experts.gate_up_proj"):
            block = name.split(".")[2]
            inter = w.shape[1] // 2
            stored = []
            for part, half in (("gate", w[:, :inter]), ("up", w[:, inter:])):
                data, s = _encode(np.ascontiguousarray(half), types.get(f"{part}_exps", T.F32), rng)
                tensors[f"blk.{block}.ffn_{part}_exps.weight"] = (data, types.get(f"{part}_exps"))
                stored.append(s)
            held[name] = torch.from_numpy(np.concatenate(stored, axis=1))
            continue
        if name.endswith("mlp.experts.down_proj"):
            block = name.split(".")[2]
            data, s = _encode(w, types.get("down_exps", T.F32), rng)
            tensors[f"blk.{block}.ffn_down_exps.weight"] = (data, types.get("down_exps"))
            held[name] = torch.from_numpy(s)
            continue
        qtype = next((t for pattern, t in types.items() if pattern in name), T.F32) if w.ndim == 2 else T.F32
        if name.endswith("shared_expert_gate.weight"):
            w, qtype = (w.reshape(-1) if shared_gate_1d else w), T.F32
        data, s = _encode(w, qtype, rng)
        tensors[_gguf_name(name)] = (data, None if qtype == T.F32 else qtype)
        if n_head:
            s = s[np.argsort(index)]
        held[name] = torch.from_numpy(np.ascontiguousarray(s)).reshape(p.shape)
    if per_expert:
        for name in [n for n in tensors if "_exps." in n]:
            data, qtype = tensors.pop(name)
            for j in range(data.shape[0]):
                tensors[name.replace("_exps.", f".{j}.")] = (np.ascontiguousarray(data[j]), qtype)
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    meta = {
        "block_count": LAYERS, "context_length": 64, "embedding_length": HIDDEN,
        "feed_forward_length": config.intermediate_size, "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.freq_base": float(config.rope_parameters["rope_theta"]), "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim, "vocab_size": VOCAB, "expert_count": EXPERTS,
        "expert_used_count": TOP_K,
    }
    if arch != "llama":
        meta["expert_feed_forward_length"] = config.moe_intermediate_size
    if arch == "qwen2moe":
        meta["expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    meta.update(metadata or {})
    write_gguf(path, tensors, arch=arch, metadata={f"{arch}.{k}": v for k, v in meta.items() if v is not None})
    return held


K_MIX = {"gate_exps": T.Q4_K, "up_exps": T.Q4_K, "down_exps": T.Q6_K, "q_proj": T.Q8_0, "k_proj": T.Q8_0,
         "v_proj": T.Q6_K, "o_proj": T.Q4_K, "shared_expert.": T.Q4_K, "embed": T.Q8_0, "lm_head": T.Q6_K}
AFFINE_MIX = {"gate_exps": T.Q5_1, "up_exps": T.Q5_1, "down_exps": T.Q8_0, "proj": T.Q8_0, "embed": T.Q4_0}
MIXED_MIX = {"gate_exps": T.Q5_1, "up_exps": T.Q5_1, "down_exps": T.Q6_K, "proj": T.Q4_0}
# llama.cpp's Q5_K_M experts: Q5_K gate / up, Q6_K down, both kept as blocks.
Q5_MIX = {"gate_exps": T.Q5_K, "up_exps": T.Q5_K, "down_exps": T.Q6_K, "proj": T.Q8_0, "embed": T.Q5_K}
# llama.cpp's Q2_K / Q3_K_M experts: the 2- and 3-bit K-quants kept as blocks.
LOW_MIX = {"gate_exps": T.Q3_K, "up_exps": T.Q3_K, "down_exps": T.Q2_K, "q_proj": T.Q8_0, "k_proj": T.Q8_0,
           "v_proj": T.Q5_K, "o_proj": T.Q3_K, "embed": T.Q8_0, "lm_head": T.Q6_K}
# llama.cpp's IQ4_XS experts (IQ4_NL where rows are no multiple of 256: here the down projection).
IQ4_MIX = {"gate_exps": T.IQ4_XS, "up_exps": T.IQ4_XS, "down_exps": T.IQ4_NL, "q_proj": T.Q8_0, "k_proj": T.Q8_0,
           "v_proj": T.IQ4_XS, "o_proj": T.IQ4_XS, "embed": T.IQ4_XS, "lm_head": T.Q6_K}

# llama.cpp's IQ1 .. IQ3 files: lattice i-quant experts kept as blocks, the other layers too.
IQ_LATTICE_MIX = {"gate_exps": T.IQ3_XXS, "up_exps": T.IQ3_XXS, "down_exps": T.IQ2_S, "q_proj": T.Q8_0, "k_proj": T.Q8_0,
                  "v_proj": T.IQ1_M, "o_proj": T.IQ3_S, "embed": T.IQ2_XXS, "lm_head": T.IQ1_S}


def _expected(arch: str, moe_inter: int, held: dict) -> torch.nn.Module:
    """The model `arch` holding the weights the file holds."""
    model = moe_model(arch, moe_inter)
    model.load_state_dict(held)
    return model


# Sums of float32 products in other orders (the experts' at most 256 + 512 terms, over 2 layers),
# and a routing weight that a top-k choice between near-equal router logits can make differ: rtol
# 1e-4 of the largest logit, as the dense GGUF tests.
def _assert_logits(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "mixtral"])
@pytest.mark.parametrize("mix", ["k", "low", "q5", "iq4", "iq_lattice", "affine", "mixed", "f32"])
def test_moe_gguf_loads_into_its_transformers_model(tmp_path, arch, mix):
    types = {"k": K_MIX, "low": LOW_MIX, "q5": Q5_MIX, "iq4": IQ4_MIX, "iq_lattice": IQ_LATTICE_MIX, "affine": AFFINE_MIX,
             "mixed": MIXED_MIX, "f32": {}}[mix]
    source = moe_model(arch, 256)
    held = write_moe_gguf(source, tmp_path / "m.gguf", types, np.random.default_rng(3))
    f = GGUFFile(tmp_path / "m.gguf")
    config = llama_config_from_gguf(f)
    assert type(config) is type(source.config)
    if arch == "mixtral":
        assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (EXPERTS, TOP_K, 256)
    else:
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (EXPERTS, TOP_K, 256)
        assert config.norm_topk_prob == (arch == "qwen3moe")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = load_gguf_llama(model, f)

    experts = model.model.layers[1].mlp.experts
    if mix == "f32":
        assert not isinstance(experts, QuantFusedExperts) and not report.quantized
    else:
        assert isinstance(experts, QuantFusedExperts)
        gate_up, down = experts.gate_up_proj, experts.down_proj
        kinds = {"k": (GGUFSwitchLinear, GGUFSwitchLinear), "low": (GGUFSwitchLinear, GGUFSwitchLinear),
                 "q5": (GGUFSwitchLinear, GGUFSwitchLinear), "iq4": (GGUFSwitchLinear, QuantSwitchLinear),
                 "iq_lattice": (GGUFSwitchLinear, GGUFSwitchLinear),
                 "affine": (QuantSwitchLinear, QuantSwitchLinear),
                 "mixed": (QuantSwitchLinear, GGUFSwitchLinear)}[mix]
        assert (type(gate_up), type(down)) == kinds
        assert report.quantized["model.layers.1.mlp.experts"] == {
            "k": "experts gate Q4_K, up Q4_K, down Q6_K", "low": "experts gate Q3_K, up Q3_K, down Q2_K",
            "q5": "experts gate Q5_K, up Q5_K, down Q6_K", "iq4": "experts gate IQ4_XS, up IQ4_XS, down IQ4_NL",
            "iq_lattice": "experts gate IQ3_XXS, up IQ3_XXS, down IQ2_S",
            "affine": "experts gate Q5_1, up Q5_1, down Q8_0",
            "mixed": "experts gate Q5_1, up Q5_1, down Q6_K"}[mix]
        if mix == "affine":
            assert (gate_up.bits, gate_up.group_size, down.bits) == (5, 32, 8)
    with torch.no_grad():
        got = model(IDS).logits
        want = _expected(arch, 256, held)(IDS).logits
    _assert_logits(got, want)


@pytest.mark.parametrize("arch, types", [
    ("qwen3moe", K_MIX),  # transformers' own loader: Qwen3MoeConfig's default moe_intermediate_size, 768
    ("qwen2moe", {"gate_exps": T.Q8_0, "up_exps": T.Q8_0, "down_exps": T.Q4_0, "proj": T.Q8_0}),  # 1408, 5632
])
def test_moe_gguf_agrees_with_transformers_gguf_loader(tmp_path, arch, types):
    # transformers' GGUF loader takes the expert sizes from the config class's defaults (it reads no
    # expert_feed_forward_length): the files have those sizes (Qwen2-MoE's 1408 is no multiple of
    # 256, so its experts are of the 32-weight types). It reads the shared-expert gate as [H] only
    # (it adds a dimension to the converter's [1, H]).
    defaults = {"qwen3moe": (768, 512), "qwen2moe": (1408, 5632)}[arch]
    source = moe_model(arch, *defaults)
    write_moe_gguf(source, tmp_path / "m.gguf", types, np.random.default_rng(4), shared_gate_1d=True)
    f = GGUFFile(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    assert isinstance(model.model.layers[0].mlp.experts, QuantFusedExperts)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    assert type(theirs.config) is type(model.config)
    assert theirs.config.norm_topk_prob == model.config.norm_topk_prob
    with torch.no_grad():
        _assert_logits(model(IDS).logits, theirs(IDS).logits)


def test_moe_gguf_loads_into_a_model_on_the_meta_device(tmp_path):
    source = moe_model("qwen2moe", 256)
    held = write_moe_gguf(source, tmp_path / "m.gguf", MIXED_MIX, np.random.default_rng(5))
    f = GGUFFile(tmp_path / "m.gguf")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():
        _assert_logits(model(IDS).logits, _expected("qwen2moe", 256, held)(IDS).logits)


def test_experts_of_types_that_cannot_share_a_module_load_float_with_a_warning(tmp_path):
    source = moe_model("qwen3moe", 256)
    types = {"gate_exps": T.Q4_K, "up_exps": T.Q8_0, "down_exps": T.Q6_K}
    held = write_moe_gguf(source, tmp_path / "m.gguf", types, np.random.default_rng(6))
    f = GGUFFile(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    with pytest.warns(UserWarning, match=r"block 0: the experts are stored as gate Q4_K, up Q8_0, down Q6_K"):
        load_gguf_llama(model, f)
    assert not isinstance(model.model.layers[0].mlp.experts, QuantFusedExperts)
    torch.testing.assert_close(model.model.layers[0].mlp.experts.gate_up_proj.data,
                               held["model.layers.0.mlp.experts.gate_up_proj"], rtol=0, atol=0)
    with torch.no_grad():
        _assert_logits(model(IDS).logits, _expected("qwen3moe", 256, held)(IDS).logits)


@pytest.mark.parametrize("drop, metadata, message", [
    ((), {"expert_count": None}, r"metadata 'qwen3moe.expert_count' \(gives num_experts\) is missing"),
    ((), {"expert_used_count": 9}, r"'qwen3moe.expert_used_count' = 9 is more than 'qwen3moe.expert_count' = 4"),
    ((), {"expert_feed_forward_length": 512}, r"'blk.0.ffn_gate_exps.weight' has shape \[4, 256, 256\].*\[4, 512, 256\]"),
    (("blk.1.ffn_down_exps.weight",), {}, r"no tensor 'blk.1.ffn_down_exps.weight'"),
])
def test_moe_metadata_disagreeing_with_the_file_is_refused_before_a_model_is_built(tmp_path, drop, metadata, message):
    write_moe_gguf(moe_model("qwen3moe", 256), tmp_path / "m.gguf", K_MIX, np.random.default_rng(7), drop=drop,
                   metadata=metadata)
    with pytest.raises(ValueError, match=message):
        llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))


def test_moe_experts_infer_their_size_without_the_metadata(tmp_path):
    write_moe_gguf(moe_model("qwen2moe", 256, 768), tmp_path / "m.gguf", K_MIX, np.random.default_rng(8),
                   metadata={"expert_feed_forward_length": None, "expert_shared_feed_forward_length": None})
    config = llama_config_from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (256, 768)


def test_gguf_experts_are_refused_by_the_writers_that_cannot_hold_them(tmp_path):
    from torch_qmm.interop import save_mlx

    write_moe_gguf(moe_model("qwen3moe", 256), tmp_path / "m.gguf", K_MIX, np.random.default_rng(10))
    f = GGUFFile(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj \(Q4_K\).*GGUFSwitchLinear"):
        save_mlx(model, tmp_path / "mlx")
    # save_pretrained writes, and the reload says why it cannot rebuild the experts' layers
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj \(GGUFSwitchLinear\)"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def test_the_shared_expert_gate_loads_as_h_or_1_by_h(tmp_path):
    source = moe_model("qwen2moe", 256)
    logits = []
    for one_d in (False, True):
        held = write_moe_gguf(source, tmp_path / f"m{one_d}.gguf", AFFINE_MIX, np.random.default_rng(11),
                              shared_gate_1d=one_d)
        f = GGUFFile(tmp_path / f"m{one_d}.gguf")
        assert len(f.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == (1 if one_d else 2)
        model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
        load_gguf_llama(model, f)
        with torch.no_grad():
            logits.append(model(IDS).logits)
            _assert_logits(logits[-1], _expected("qwen2moe", 256, held)(IDS).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("types", [K_MIX, AFFINE_MIX], ids=["k", "affine"])
def test_mixtral_files_with_one_tensor_per_expert_load_as_the_stacked_ones(tmp_path, types):
    source = moe_model("mixtral", 256)
    held = write_moe_gguf(source, tmp_path / "per.gguf", types, np.random.default_rng(12), per_expert=True)
    write_moe_gguf(source, tmp_path / "stacked.gguf", types, np.random.default_rng(12))
    per, stacked = GGUFFile(tmp_path / "per.gguf"), GGUFFile(tmp_path / "stacked.gguf")
    assert "blk.0.ffn_down.3.weight" in per.tensors and "blk.0.ffn_down_exps.weight" not in per.tensors
    models = []
    for f in (per, stacked):
        model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
        load_gguf_llama(model, f)
        models.append(model)
    assert isinstance(models[0].model.layers[1].mlp.experts, QuantFusedExperts)
    for a, b in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    with torch.no_grad():
        _assert_logits(models[0](IDS).logits, _expected("mixtral", 256, held)(IDS).logits)


def test_per_expert_tensors_of_different_types_are_refused_naming_them(tmp_path):
    write_moe_gguf(moe_model("mixtral", 256), tmp_path / "m.gguf", AFFINE_MIX, np.random.default_rng(13),
                   per_expert=True)
    f = GGUFFile(tmp_path / "m.gguf")
    t = f.tensors["blk.1.ffn_up.2.weight"]
    f.tensors["blk.1.ffn_up.2.weight"] = type(t)(t.name, int(T.Q8_0) if t.ggml_type != T.Q8_0 else int(T.Q4_0),
                                                 t.shape, t.raw, t.source)
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    with pytest.raises(ValueError, match=r"the experts of block 1 differ: 'blk.1.ffn_up.2.weight' is Q"):
        load_gguf_llama(model, f)


def test_loading_a_file_into_a_model_that_was_loaded_before_is_refused(tmp_path):
    write_moe_gguf(moe_model("qwen3moe", 256), tmp_path / "m.gguf", K_MIX, np.random.default_rng(14))
    f = GGUFFile(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_config(llama_config_from_gguf(f)).eval()
    load_gguf_llama(model, f)
    with pytest.raises(ValueError, match=r"the model already holds torch_qmm layers \(model.embed_tokens "
                                         r"\(QuantEmbedding\), model.layers.0.self_attn.q_proj \(QuantLinear\).*"
                                         r"was it loaded or quantized before"):
        load_gguf_llama(model, f)


@pytest.mark.parametrize("arch, types", [("qwen3moe", K_MIX), ("mixtral", AFFINE_MIX)], ids=["qwen3moe-k", "mixtral-affine"])
def test_moe_gguf_whose_top_k_is_every_expert_loads(tmp_path, monkeypatch, arch, types):
    # expert_used_count == expert_count (a valid file: every token goes to every expert, each
    # weighted by its softmax probability). The reference is the transformers model of top-k 4
    # holding the weights the file holds, as gguf decodes them.
    import test_interop_gguf_moe as this

    monkeypatch.setattr(this, "TOP_K", EXPERTS)  # moe_model's num_experts_per_tok and the file's metadata
    source = moe_model(arch, 256)
    assert source.config.num_experts_per_tok == EXPERTS
    held = write_moe_gguf(source, tmp_path / "m.gguf", types, np.random.default_rng(15))
    f = GGUFFile(tmp_path / "m.gguf")
    config = llama_config_from_gguf(f)
    assert config.num_experts_per_tok == EXPERTS
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    load_gguf_llama(model, f)
    assert isinstance(model.model.layers[1].mlp.experts, QuantFusedExperts)
    with torch.no_grad():
        _assert_logits(model(IDS).logits, _expected(arch, 256, held)(IDS).logits)
