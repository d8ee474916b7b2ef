"""Op and module behaviour a real model and hostile inputs exposed: thread-local modes in the CPU
workers, non-finite values (IEEE as F.linear on the dequantized weights), weights whose range
overflows float32, QuantEmbedding's index checks, the format in state_dict, and what
quantize_model does with tied heads and modules that read a child's .weight.

Oracles: the float64 reference on the dequantized weights (torch_qmm.reference), gguf's own
dequantize, mlx.core, nn.Embedding's own errors, transformers' LlamaForCausalLM.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
from gguf import quants
from torch import nn

import torch_qmm
from torch_qmm import reference
from torch_qmm.interop import QuantEmbedding
from torch_qmm.nn import QuantLinear

from gguf_helpers import Q4_K, Q6_K, random_k_blocks
from test_cpu_chunked import HAS_AVX2, HAS_AVX512, HAS_BF16
from tolerance import assert_matches_reference

MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
    # The ops compute in float32 whatever autocast asks of the matmuls they call inside.
    "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- thread-local state (autograd modes, autocast) and the CPU workers: every route ----

# (M, N, K, transpose): one call per CPU route of affine_qmm (the chunk kernels need AVX-512 or AVX2).
AFFINE_CASES = [(1, 256, 512, True), (3, 256, 96, True), (3, 96, 256, False), (64, 256, 512, True),
                (64, 128, 256, False)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_every_affine_cpu_route_runs_under_every_thread_local_mode(mode, threads):
    gen = torch.Generator().manual_seed(1)
    routes = set()
    for m, n, k, transpose in AFFINE_CASES:
        w = torch.randn(n, k, generator=gen) if transpose else torch.randn(k, n, generator=gen)
        wq, scales, biases = torch_qmm.quantize(w, 32, 4)
        x = torch.randn(m, k, generator=gen)
        routes.add(torch.ops.torch_qmm._cpu_route(x, wq, scales, biases, 4, 32, transpose).split("/")[0])
        with num_threads(threads), MODES[mode]():
            y = torch.ops.torch_qmm.affine_qmm(x, wq, scales, biases, 4, 32, transpose)
        ref = reference.qmm(x, wq, scales, biases, 4, 32, transpose)
        mag = reference.qmm_magnitude(x, wq, scales, biases, 4, 32, transpose)
        assert_matches_reference(y, ref, mag, torch.float32, f"M={m} transpose={transpose} {mode} {threads}t")
    assert routes == ({"chunked", "fused", "gemm"} if HAS_AVX512 or HAS_AVX2 else {"fused", "gemm"})


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_every_gguf_cpu_route_runs_under_every_thread_local_mode(mode, threads):
    n, k = 64, 512
    routes = set()
    # chunked (AVX512_BF16 or AVX2) / fused, chunked (AVX2) / fused, gemm (past the panel kernels' 128 rows)
    for ggml_type, m in [(Q4_K, 1), (Q6_K, 4), (Q4_K, 140)]:
        blocks = random_k_blocks(ggml_type, n, k, np.random.default_rng(m))
        w = torch.from_numpy(quants.dequantize(blocks, ggml_type)).double()
        blocks = torch.from_numpy(blocks)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        routes.add(torch.ops.torch_qmm._gguf_cpu_route(x, blocks, int(ggml_type), n, k).split("/")[0])
        with num_threads(threads), MODES[mode]():
            y = torch.ops.torch_qmm.gguf_qmm(x, blocks, int(ggml_type), n, k)
        xd = x.double()
        assert_matches_reference(y, xd @ w.T, xd.abs() @ w.abs().T, torch.float32, f"{ggml_type.name} M={m}")
    assert routes == ({"chunked", "gemm"} if HAS_AVX2 else {"chunked", "fused", "gemm"} if HAS_BF16
                      else {"fused", "gemm"})


def test_quant_linear_forward_under_inference_mode_with_two_threads():
    torch.manual_seed(2)
    layer = QuantLinear.from_linear(nn.Linear(576, 576), bits=4, group_size=32)
    x = torch.randn(2, 64, 576)
    with num_threads(2), torch.inference_mode():
        y = layer(x)
    assert y.is_inference()
    with torch.no_grad():
        assert torch.equal(y, layer(x))


# ---- non-finite values: the float64 reference on the dequantized weights is the oracle ----


def _special_pattern(y: torch.Tensor) -> torch.Tensor:
    y = y.double()
    return torch.stack([y.isnan(), y.isposinf(), y.isneginf()])


def assert_ieee_matches(y, ref, mag, dtype, what):
    """Same NaN / +Inf / -Inf positions as the reference; the finite rest within the tolerance."""
    got, want = _special_pattern(y), _special_pattern(ref)
    assert torch.equal(got, want), (
        f"{what}: {int((got != want).any(0).sum())} of {y.numel()} outputs differ in NaN/Inf from F.linear on "
        f"the dequantized weights (got NaN {int(got[0].sum())}, Inf {int(got[1:].sum())}; reference NaN "
        f"{int(want[0].sum())}, Inf {int(want[1:].sum())})"
    )
    finite = torch.isfinite(ref)
    assert_matches_reference(y[finite], ref[finite], mag[finite], dtype, what)


POISONS = ["x+inf", "x-inf", "x+-inf", "x_nan", "bias_inf", "scale_inf", "scale_nan"]


def _poisoned(poison: str, x, scales, biases):
    x, scales, biases = x.clone(), scales.clone(), biases.clone()
    if poison == "x+inf":
        x[0, 7] = float("inf")
    elif poison == "x-inf":
        x[-1, 100] = float("-inf")
    elif poison == "x+-inf":
        x[0, 3], x[-1, 200] = float("inf"), float("-inf")
    elif poison == "x_nan":
        x[0, 9] = float("nan")
    elif poison == "bias_inf":
        biases[3, 1] = float("inf")
    elif poison == "scale_inf":
        scales[5, 0] = float("inf")
    else:
        scales[6, 2] = float("nan")
    return x, scales, biases


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transpose", [True, False])
def test_non_finite_values_follow_ieee_on_every_cpu_route(poison, dtype, transpose):
    """M=1, 5 (4 + a single row: the hoisted-bias tile), 20 and 40 (chunk, fused, GEMM routes)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 256, 512
    w = torch.randn(n, k, generator=gen) if transpose else torch.randn(k, n, generator=gen)
    wq, scales, biases = torch_qmm.quantize(w.to(dtype), 64, 4)
    for m in [1, 5, 20, 40]:
        x, s, b = _poisoned(poison, torch.randn(m, k, generator=gen).to(dtype), scales, biases)
        y = torch.ops.torch_qmm.affine_qmm(x, wq, s, b, 4, 64, transpose)
        ref = reference.qmm(x, wq, s, b, 4, 64, transpose)
        mag = reference.qmm_magnitude(x, wq, s, b, 4, 64, transpose)
        assert_ieee_matches(y, ref, mag, dtype, f"{poison} M={m} transpose={transpose} {dtype}")


def test_one_inf_in_x_at_m1_gives_inf_columns_like_f_linear():
    """The case a real forward hit: +Inf in one x element, M=1, gives +-Inf in most columns (NaN only
    where the dequantized weight is exactly 0), not NaN everywhere."""
    gen = torch.Generator().manual_seed(4)
    wq, scales, biases = torch_qmm.quantize(torch.randn(576, 576, generator=gen), group_size=32, bits=4)
    x = torch.randn(1, 576, generator=gen)
    x[0, 10] = float("inf")
    y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)
    # The exact weights s*q + b (float64): the kernel's products are NaN where they are exactly 0.
    w = reference.dequantize(wq, scales, biases, 4, 32)
    expected = torch.nn.functional.linear(x.double(), w)
    assert torch.isinf(expected).float().mean() > 0.5
    assert torch.equal(_special_pattern(y), _special_pattern(expected))


@pytest.mark.parametrize("ggml_type, poison", [(Q4_K, "x+inf"), (Q4_K, "d_inf"), (Q4_K, "dmin_inf"),
                                               (Q6_K, "x+inf"), (Q6_K, "d_inf")],
                         ids=lambda v: getattr(v, "name", v))
def test_gguf_non_finite_values_follow_ieee(poison, ggml_type):
    """The GGUF chunk kernels hoist the mins: +Inf in x, an Inf super-block scale d or (Q4_K) min
    scale dmin against gguf's own dequantize (M=1: the chunk route on AVX512_BF16, else fused)."""
    n, k = 64, 512
    raw = random_k_blocks(ggml_type, n, k, np.random.default_rng(5))
    if poison != "x+inf":  # the f16 d (Q4_K bytes 0-1, Q6_K 208-209) or dmin (Q4_K 2-3) of row 2's first block
        at = {(Q4_K, "d_inf"): 0, (Q4_K, "dmin_inf"): 2, (Q6_K, "d_inf"): 208}[ggml_type, poison]
        raw[2, at:at + 2] = np.array([np.inf], dtype="<f2").view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        w = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    # dmin_inf: x of both signs in every sub-block (F.linear: -Inf weights times them, NaN) but
    # positive sub-block sums (a hoisted min term alone: -Inf).
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)) + (1.5 if poison == "dmin_inf" else 0.0)
    if poison == "x+inf":
        x[0, 17] = float("inf")
    y = torch.ops.torch_qmm.gguf_qmm(x, torch.from_numpy(raw), int(ggml_type), n, k)
    xd = x.double()
    ref = xd @ w.T
    mag = xd.abs() @ w.abs().T
    assert_ieee_matches(y, ref, mag, torch.float32, f"{ggml_type.name} {poison}")


# ---- weights whose range overflows float32 ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_refuses_a_group_range_beyond_float32_max(device, dtype):
    """max - min = 6e38 overflows float32: MLX makes that group's scale -Inf (checked here) and
    dequantizes it to NaN; we refuse it as we refuse non-finite weights."""
    import mlx.core as mx

    w = torch.randn(4, 64)
    w[1, 0], w[1, 1] = 3e38, -3e38
    _, s, _ = mx.quantize(mx.array(w.numpy()), group_size=64, bits=4)
    assert not np.isfinite(np.array(s)[1, 0])
    with pytest.raises(ValueError, match=r"argument 'w' has a group whose range max - min exceeds the float32 "
                                         r"maximum 3.4028235e\+38"):
        torch_qmm.quantize(w.to(dtype).to(device), group_size=64, bits=4)


def test_quantize_keeps_large_finite_ranges_bit_exact_with_mlx():
    """Ranges just below the limit (1.7e38 - (-1.6e38)) quantize as MLX does, to finite values."""
    import mlx.core as mx

    w = torch.randn(4, 64) * 1e37
    w[0, 0], w[0, 1] = 1.7e38, -1.6e38
    wq, s, b = torch_qmm.quantize(w, group_size=64, bits=4)
    mwq, ms, mb = mx.quantize(mx.array(w.numpy()), group_size=64, bits=4)
    assert np.array_equal(wq.view(torch.int32).numpy(), np.array(mwq).view(np.int32))
    assert np.array_equal(s.numpy(), np.array(ms)) and np.array_equal(b.numpy(), np.array(mb))
    assert torch.isfinite(torch_qmm.dequantize(wq, s, b, group_size=64, bits=4)).all()


# ---- QuantEmbedding indexes like nn.Embedding ----


def _embeddings():
    torch.manual_seed(6)
    emb = nn.Embedding(10, 64)
    return emb, QuantEmbedding.from_embedding(emb, bits=4, group_size=64)


def test_quant_embedding_refuses_an_embedding_that_renormalizes_its_rows():
    # nn.Embedding(max_norm=...) rescales each row it reads (and the table in place): a stored
    # quantized table would give other rows, silently.
    with pytest.raises(ValueError, match=r"argument 'embedding' must have max_norm=None .*got max_norm=1.0"):
        QuantEmbedding.from_embedding(nn.Embedding(10, 64, max_norm=1.0), bits=4, group_size=64)


@pytest.mark.parametrize("ids", [[-1], [3, -10], [10], [0, 11]], ids=str)
def test_quant_embedding_refuses_ids_out_of_range_as_nn_embedding_does(ids):
    emb, qemb = _embeddings()
    ids = torch.tensor(ids)
    with pytest.raises(IndexError):
        emb(ids)
    with pytest.raises(IndexError, match=r"argument 'ids' must be in \[0, 10\)"):
        qemb(ids)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.float32], ids=str)
def test_quant_embedding_refuses_id_dtypes_nn_embedding_refuses(dtype):
    emb, qemb = _embeddings()
    ids = torch.tensor([1, 0, 1]).to(dtype)
    with pytest.raises(RuntimeError):
        emb(ids)
    with pytest.raises(RuntimeError, match=f"argument 'ids' must be an int64 or int32 tensor, got {dtype}"):
        qemb(ids)


def test_quant_embedding_checks_ids_inside_a_compiled_graph():
    _, qemb = _embeddings()
    compiled = torch.compile(qemb, backend="eager", fullgraph=True)
    ids = torch.tensor([[1, 2], [3, 9]])
    assert torch.equal(compiled(ids), qemb(ids))
    with pytest.raises(RuntimeError, match=r"argument 'ids' must be in \[0, 10\)"):
        compiled(torch.tensor([1, -1]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_quant_embedding_takes_the_ids_nn_embedding_takes(dtype):
    emb, qemb = _embeddings()
    ids = torch.tensor([[0, 9], [3, 3]], dtype=dtype)
    # MLX's dequantize rounding: the product s*q, then the sum with b, each in float32.
    q = reference.unpack(qemb.qweight, 4).float()
    s, b = (t.float().repeat_interleave(64, dim=-1) for t in (qemb.scales, qemb.biases))
    w = s * q + b
    assert torch.equal(qemb(ids), nn.functional.embedding(ids, w))
    assert qemb(torch.zeros(0, dtype=dtype)).shape == emb(torch.zeros(0, dtype=dtype)).shape


# ---- the format travels with the state ----


def test_state_of_another_format_is_refused_even_when_the_shapes_agree():
    """8-bit group 32 with K=64 has the buffer shapes of 4-bit group 64 with K=128."""
    torch.manual_seed(7)
    src = QuantLinear.from_linear(nn.Linear(64, 16), bits=8, group_size=32)
    dst = QuantLinear(128, 16, bits=4, group_size=64)
    assert all(src.state_dict()[k].shape == v.shape for k, v in dst.state_dict().items())
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError, match="holds bits=8, group_size=32, mode=affine, this layer has bits=4, group_size=64, mode=affine"):
        dst.load_state_dict(src.state_dict())
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())  # left unchanged
    emb = QuantEmbedding(16, 128, bits=4, group_size=64)
    with pytest.raises(ValueError, match="holds bits=8, group_size=32"):
        emb.load_state_dict({k: v for k, v in src.state_dict().items() if k != "bias"})


def test_state_round_trips_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    torch_qmm.quantize_model(model, bits=3, group_size=32)
    save_file(model.state_dict(), tmp_path / "m.safetensors")
    state = load_file(tmp_path / "m.safetensors")
    assert state["0._extra_state"].tolist() == [3, 32]
    same = nn.Sequential(QuantLinear(64, 32, bits=3, group_size=32),
                         QuantLinear(32, 8, bits=3, group_size=32))
    same.load_state_dict(state)
    x = torch.randn(2, 64)
    assert torch.equal(same(x), model(x))
    other = nn.Sequential(QuantLinear(64, 32, bits=4, group_size=32),
                          QuantLinear(32, 8, bits=4, group_size=32))
    with pytest.raises(ValueError, match="holds bits=3"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="format state must be an integer tensor"):
        same.load_state_dict({**state, "0._extra_state": torch.tensor([3.0, 32.0])})


def test_mlx_files_hold_no_format_tensors(tmp_path):
    """MLX keeps the format in config.json: save_mlx writes MLX's tensor names only, and mlx loads them."""
    import mlx.core as mx

    from torch_qmm.interop import load_mlx, save_mlx

    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    torch_qmm.quantize_model(model, bits=4, group_size=32)
    save_mlx(model, tmp_path / "out")
    arrays = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(arrays) == sorted(f"{i}.{p}" for i in (0, 1) for p in ("weight", "scales", "biases", "bias"))
    back = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    load_mlx(back, tmp_path / "out")
    x = torch.randn(2, 64)
    assert torch.equal(back(x), model(x))


# ---- quantize_model: tied heads, modules that read a child's .weight ----


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(10)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def test_quantize_model_keeps_a_tied_head_tied_and_reports_what_the_model_holds():
    model = _tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        before_logits = model(ids).logits
    before = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))  # torch dedups ties
    with pytest.warns(UserWarning, match=r"lm_head \(weight is shared with model.embed_tokens"):
        summary = torch_qmm.quantize_model(model, bits=4, group_size=64)
    assert model.lm_head.weight is model.model.embed_tokens.weight and type(model.lm_head) is nn.Linear
    assert "lm_head" in summary.skipped and len(summary.converted) == 14  # 7 linears per layer
    after = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    assert (summary.model_bytes_before, summary.model_bytes_after) == (before, after)
    assert f"model {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB" in str(summary)
    with torch.no_grad():
        logits = model(ids).logits
    # 4-bit random weights: the logits move, but stay near the float model's.
    assert (logits - before_logits).abs().max() < 0.1 * before_logits.abs().max()


def test_quantize_model_on_an_untied_llama_converts_the_head():
    model = _tiny_llama(tie=False)
    summary = torch_qmm.quantize_model(model, bits=4, group_size=64)
    assert isinstance(model.lm_head, QuantLinear) and not summary.skipped


@pytest.mark.parametrize("grad", [False, True])
def test_quantize_model_leaves_layers_whose_parent_reads_their_weight(grad):
    """nn.TransformerEncoderLayer's eval fast path (with a padding mask, also TransformerEncoder's)
    passes linear1/linear2.weight to one kernel; MultiheadAttention reads out_proj.weight."""
    torch.manual_seed(11)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                          nn.Linear(64, 32)).eval()
    x = torch.randn(2, 5, 64)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def run():
        with torch.set_grad_enabled(grad):
            h = model[0](x, src_key_padding_mask=mask)
            return model[1](h.nan_to_num()), h

    float_y, float_h = run()
    with pytest.warns(UserWarning, match="its parent TransformerEncoderLayer reads linear1.weight directly"):
        summary = torch_qmm.quantize_model(model, bits=4, group_size=32)
    assert summary.converted == ["1"]
    assert sorted(summary.skipped) == [f"0.layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)]
    y, h = run()
    assert torch.equal(h.nan_to_num(), float_h.nan_to_num())  # the encoder is untouched
    w = torch_qmm.dequantize(model[1].qweight, model[1].scales, model[1].biases, group_size=32, bits=4)
    y_ref = nn.functional.linear(float_h.nan_to_num().double(), w.double(), model[1].bias.double())
    assert (y.double() - y_ref).abs().max() < 1e-4


def test_quantize_model_leaves_multihead_attention_working():
    torch.manual_seed(12)
    mha = nn.MultiheadAttention(64, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        float_y = mha(x, x, x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_qmm.quantize_model(mha, bits=4, group_size=32)
    with torch.no_grad():
        assert torch.equal(mha(x, x, x)[0], float_y)


def test_quantize_model_again_with_another_format_is_refused_and_with_the_same_is_a_no_op():
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    torch_qmm.quantize_model(model, bits=8, group_size=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"quantize_model\(bits=4, group_size=64, mode='affine'\).*another format: "
                                         r"0 \(bits=8, group_size=32, mode=affine\), 2 \(bits=8, group_size=32, mode=affine\)"):
        torch_qmm.quantize_model(model, bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"2 \(bits=8, group_size=32, mode=affine\)"):  # the same bits, another group size
        torch_qmm.quantize_model(model, bits=8, group_size=64)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left unchanged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = torch_qmm.quantize_model(model, bits=8, group_size=32)
    assert again.converted == [] and again.already_quantized == ["0", "2"]
    assert "2 already quantized with these settings" in str(again)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_quantize_model_quantizes_the_rest_when_filter_fn_leaves_out_the_quantized_layers():
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    torch_qmm.quantize_model(model, bits=8, group_size=32, filter_fn=lambda name, _: name == "0")
    summary = torch_qmm.quantize_model(model, bits=4, group_size=32, filter_fn=lambda _, m: type(m) is nn.Linear)
    assert summary.converted == ["2"]
    assert (model[0].bits, model[2].bits) == (8, 4)


def test_quantize_model_refuses_a_gguf_layer_it_would_leave_in_another_format():
    from torch_qmm.interop import GGUFLinear

    model = nn.Sequential(GGUFLinear(256, 4, int(Q4_K)), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"another format: 0 \(ggml_type=12 \(Q4_K\)\)"):
        torch_qmm.quantize_model(model, bits=4, group_size=32)


METAL_POISONS = ["x+inf", "x-inf", "x+-inf", "bias_inf", "scale_inf"]


@pytest.mark.parametrize("transpose", [True, False])
def test_non_finite_values_follow_ieee_on_every_metal_route(device, transpose):
    """M = 1 (qmv / qvm), 3 (decode once for a few rows), 12 and 40 (simdgroup-matrix tiles); on
    "cpu" the same cases again."""
    gen = torch.Generator().manual_seed(13)
    n, k = 128, 256
    w = torch.randn(n, k, generator=gen) if transpose else torch.randn(k, n, generator=gen)
    wq, scales, biases = torch_qmm.quantize(w, 64, 4)
    for m in [1, 3, 12, 40]:
        for poison in METAL_POISONS:
            x, s, b = _poisoned(poison, torch.randn(m, k, generator=gen), scales, biases)
            y = torch.ops.torch_qmm.affine_qmm(x.to(device), wq.to(device), s.to(device), b.to(device), 4, 64,
                                               transpose).cpu()
            ref = reference.qmm(x, wq, s, b, 4, 64, transpose)
            mag = reference.qmm_magnitude(x, wq, s, b, 4, 64, transpose)
            assert_ieee_matches(y, ref, mag, torch.float32, f"{device} {poison} M={m} transpose={transpose}")


@pytest.mark.parametrize("ggml_type, poison", [(Q4_K, "x+inf"), (Q4_K, "dmin_inf"), (Q6_K, "x+inf"),
                                               (Q6_K, "d_inf")], ids=lambda v: getattr(v, "name", v))
def test_gguf_non_finite_values_follow_ieee_on_metal(device, ggml_type, poison):
    n, k = 16, 512
    raw = random_k_blocks(ggml_type, n, k, np.random.default_rng(14))
    if poison != "x+inf":
        at = {(Q4_K, "dmin_inf"): 2, (Q6_K, "d_inf"): 208}[ggml_type, poison]
        raw[2, at:at + 2] = np.array([np.inf], dtype="<f2").view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        w = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    for m in [1, 3, 40]:  # qmv, small M, simdgroup-matrix tiles
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) + (1.5 if poison == "dmin_inf" else 0.0)
        if poison == "x+inf":
            x[0, 17] = float("inf")
        y = torch.ops.torch_qmm.gguf_qmm(x.to(device), torch.from_numpy(raw).to(device), int(ggml_type), n, k).cpu()
        xd = x.double()
        assert_ieee_matches(y, xd @ w.T, xd.abs() @ w.abs().T, torch.float32, f"{device} {ggml_type.name} {poison} M={m}")


def test_transformers_reload_checks_the_saved_format(tmp_path):
    """save_pretrained writes each QuantLinear's format; from_pretrained loads it without missing
    or unexpected keys and refuses a layer whose saved format disagrees with the config."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from torch_qmm.interop.transformers import TorchQmmConfig

    _tiny_llama(tie=False).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=TorchQmmConfig(8, 32))
    model.save_pretrained(tmp_path / "q")
    state = load_file(tmp_path / "q" / "model.safetensors")
    assert state["model.layers.0.mlp.up_proj._extra_state"].tolist() == [8, 32]
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "q", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    state["model.layers.0.mlp.up_proj._extra_state"] = torch.tensor([4, 32], dtype=torch.int32)
    save_file(state, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds bits=4, group_size=32, mode=affine, this layer has bits=8, group_size=32, mode=affine"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_quant_embedding_gives_shapes_of_meta_and_fake_ids_as_nn_embedding_does(mode):
    """Shape propagation (meta device, FakeTensorMode) reads no id values: nn.Embedding's shape and
    the compute dtype, no error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    emb = nn.Embedding(10, 64)
    qemb = QuantEmbedding.from_embedding(emb, mode=mode).to(torch.float16)
    ids = torch.tensor([[1, 2, 9], [0, 3, 3]])
    want = emb.to("meta")(ids.to("meta")).shape
    got = qemb.to("meta")(ids.to("meta"))
    assert got.device.type == "meta" and got.shape == want and got.dtype == torch.float16
    qemb = QuantEmbedding.from_embedding(nn.Embedding(10, 64), mode=mode).to(torch.float16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        got = qemb(torch.tensor([[1, 2, 9], [0, 3, 3]]))
    assert got.shape == want and got.dtype == torch.float16


@pytest.mark.parametrize("mode", ["affine", "mxfp8"])
def test_quant_embedding_built_on_meta_loads_with_assign_and_moves(mode):
    """The meta-device pattern: build on meta, load_state_dict(assign=True), then .to() and use,
    as nn.Embedding allows. Lookups equal the saved module's (affine: in the state's float dtype)."""
    torch.manual_seed(8)
    saved = QuantEmbedding.from_embedding(nn.Embedding(10, 64), mode=mode).to(torch.float16)
    ids = torch.tensor([[0, 9], [4, 4]])
    built = QuantEmbedding(10, 64, mode=mode, device="meta")
    built.load_state_dict(saved.state_dict(), assign=True)
    built.to("cpu")  # refused a dtype carrier left on meta: "Cannot copy out of meta tensor"
    got = built(ids)
    assert got.device.type == "cpu"
    assert got.dtype == (torch.float16 if mode == "affine" else torch.float32)
    assert torch.equal(got.to(torch.float16), saved(ids))
