"""Tiny random transformers MoE models of five families, and the reference a quantized one must
match: the same model whose quantized weights were round-tripped by MLX (mx.quantize, then
mx.dequantize; no torch_qmm code)."""

from __future__ import annotations

import copy

import numpy as np
import torch

import transformers

# INTER differs from HIDDEN, as in real MoE models, so that a swap of the two is seen.
HIDDEN, INTER, EXPERTS, TOP_K, LAYERS, VOCAB = 64, 128, 4, 2, 2, 128
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
             rms_norm_eps=1e-5)

# family (the model_type) -> (config class, model class, config fields)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=INTER, num_local_experts=EXPERTS)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=INTER, moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
                       num_experts=EXPERTS)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=INTER, moe_intermediate_size=INTER, num_experts=EXPERTS, norm_topk_prob=True)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=INTER, num_experts=EXPERTS)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(intermediate_size=INTER, num_local_experts=EXPERTS, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"],
                     # gpt-oss' yarn scaling presumes a long context (its original 4096 > 128 here)
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def tiny_moe(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    config_cls, model_cls, fields = FAMILIES[family]
    config = config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                        num_experts_per_tok=TOP_K, tie_word_embeddings=False, **_ATTN, **fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # weights of unit-scale activations, so that routing and logits are well separated
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
            elif name.endswith("bias") or "sinks" in name:
                p.normal_(0, 0.1)
            elif p.dim() == 3:  # experts: [E, out, in] or, transposed (gpt-oss), [E, in, out]
                fan_in = p.shape[1] if "gpt_oss" == family else p.shape[2]
                p.normal_(0, 1.0 / fan_in ** 0.5)
            else:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return model.to(dtype)


_MX_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def mlx_round_trip(w: torch.Tensor, mode: str, group_size: int, bits: int) -> torch.Tensor:
    """W [..., in] quantized and dequantized by MLX, in W's dtype."""
    import mlx.core as mx

    dt = getattr(mx, _MX_DTYPES[w.dtype])
    a = mx.array(w.detach().float().numpy()).astype(dt)
    q = mx.quantize(a, group_size=group_size, bits=bits, mode=mode)
    biases = q[2] if len(q) > 2 else None
    d = mx.dequantize(q[0], q[1], biases, group_size=group_size, bits=bits, mode=mode, dtype=dt)
    return torch.from_numpy(np.array(d.astype(mx.float32))).to(w.dtype)


def rtn_reference(float_model, quantized_model, transposed_experts: bool):
    """A copy of float_model whose weights that quantized_model holds quantized (QuantLinear
    layers, QuantFusedExperts' gate_up_proj / down_proj) are MLX round trips of the float ones."""
    from torch_qmm.nn import QuantLinear
    from torch_qmm.nn_moe import QuantFusedExperts

    ref = copy.deepcopy(float_model)
    with torch.no_grad():
        for name, m in quantized_model.named_modules():
            if isinstance(m, QuantLinear):
                w = ref.get_submodule(name).weight
                w.copy_(mlx_round_trip(w, m.mode, m.group_size, m.bits))
            elif isinstance(m, QuantFusedExperts):
                experts = ref.get_submodule(name)
                for pname in ("gate_up_proj", "down_proj"):
                    layer = getattr(m, pname)
                    p = experts.get_parameter(pname)
                    w = p.transpose(-1, -2) if transposed_experts else p  # [E, out, in]
                    w.copy_(mlx_round_trip(w.contiguous(), layer.mode, layer.group_size, layer.bits))
    return ref


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()
