"""`python -m torch_qmm convert SRC DST`: quantize a transformers model folder or a GGUF file.

    python -m torch_qmm convert ./Llama-3.2-1B ./out --bits 4 --group-size 64            # transformers folder
    python -m torch_qmm convert ./Llama-3.2-1B ./out-mlx --format mlx                    # MLX folder (mlx_lm)
    python -m torch_qmm convert ./model.Q8_0.gguf ./out-mlx --format mlx                 # llama-family GGUF

--format transformers (default): a folder that `from_pretrained` reloads (import
torch_qmm.interop.transformers first). Linear layers are quantized except the output head.
--format mlx: an MLX folder; linear layers *and* the embedding are quantized (as mlx.nn.quantize
does), a tied output head reuses the quantized embedding. From GGUF, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1
layers keep their exact weights (affine, group size 32); Q4_K/Q6_K/float layers are re-quantized to
--bits/--group-size (K-quants have no exact affine form).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from torch import nn

from .. import reference
from ..convert import quantize_model
from ..nn import QuantLinear
from .gguf import GGUFFile, dequantize
from .modules import GGUFLinear, QuantEmbedding, TiedQuantLinear

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Files of a transformers folder that are not weights or config: copied to DST (tokenizer, ...).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, help="a transformers model folder or a .gguf file")
    parser.add_argument("dst", type=Path, help="output folder")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--format", choices=["transformers", "mlx"], default="transformers")
    parser.add_argument("--dtype", choices=list(_DTYPES), default=None,
                        help="compute dtype (default: the source's, float32 for GGUF)")


def _float_linear(layer: nn.Module, dtype: torch.dtype) -> nn.Linear:
    """nn.Linear with the exact weights of a QuantLinear / GGUFLinear (for re-quantization)."""
    if isinstance(layer, GGUFLinear):
        from .gguf import GGUFTensor

        t = GGUFTensor("", layer.ggml_type, (layer.out_features, layer.in_features), layer.blocks.numpy())
        w = dequantize(t)
    else:
        w = reference.dequantize(layer.qweight, layer.scales, layer.biases, layer.bits, layer.group_size)
    out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if layer.bias is not None:
            out.bias.copy_(layer.bias)
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _load_gguf(src: Path, dtype: torch.dtype, keep_affine: bool):
    from transformers import LlamaForCausalLM

    from .gguf_llama import llama_config_from_gguf, load_gguf_llama

    f = GGUFFile(src)
    config = llama_config_from_gguf(f)
    model = LlamaForCausalLM(config).eval()
    print(load_gguf_llama(model, f, dtype=dtype, progress=True))
    for name, m in list(model.named_modules()):
        if isinstance(m, GGUFLinear) or (isinstance(m, QuantLinear) and not keep_affine):
            _replace(model, name, _float_linear(m, dtype))
        elif isinstance(m, QuantEmbedding) and not keep_affine:
            emb = nn.Embedding(m.num_embeddings, m.embedding_dim, dtype=dtype)
            with torch.no_grad():
                emb.weight.copy_(reference.dequantize(m.qweight, m.scales, m.biases, m.bits, m.group_size))
            _replace(model, name, emb)
        elif isinstance(m, TiedQuantLinear) and not keep_affine:
            _replace(model, name, nn.Linear(m.in_features, m.out_features, bias=False, dtype=dtype))
    if not keep_affine and config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _quantize_for_mlx(model: nn.Module, bits: int, group_size: int) -> None:
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embeddings = {n: m for n, m in model.named_modules() if type(m) is nn.Embedding}
    tied_outputs = {
        n: e for n, m in model.named_modules() if type(m) is nn.Linear
        for e, emb in embeddings.items() if m.weight is emb.weight
    }
    for name, emb in embeddings.items():
        if emb.embedding_dim % group_size == 0:
            _replace(model, name, QuantEmbedding.from_embedding(emb, bits=bits, group_size=group_size))
    for out_name, emb_name in tied_outputs.items():
        emb = model.get_submodule(emb_name)
        if tied and isinstance(emb, QuantEmbedding):
            _replace(model, out_name, TiedQuantLinear(emb))
    summary = quantize_model(model, bits=bits, group_size=group_size, progress=True)
    if summary.converted:
        print(summary)


def run(args: argparse.Namespace) -> int:
    from .transformers import TorchQmmConfig  # registers the quantizer; checks bits / group size

    TorchQmmConfig(bits=args.bits, group_size=args.group_size)
    src: Path = args.src
    if not src.exists():
        raise SystemExit(f"convert: {src} does not exist")
    is_gguf = src.is_file() and src.suffix == ".gguf"
    if not is_gguf and not (src / "config.json").is_file():
        raise SystemExit(f"convert: {src} is neither a .gguf file nor a transformers folder with config.json")
    from transformers import AutoModelForCausalLM

    if args.format == "mlx":
        from .mlx import save_mlx

        if is_gguf:
            model = _load_gguf(src, _DTYPES[args.dtype or "float32"], keep_affine=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(src, dtype=_DTYPES[args.dtype] if args.dtype else "auto")
        _quantize_for_mlx(model, args.bits, args.group_size)
        config = model.config.to_dict()
        save_mlx(model, args.dst, config=config)
    else:
        if is_gguf:
            model = _load_gguf(src, _DTYPES[args.dtype or "float32"], keep_affine=False)
            model.config.tie_word_embeddings = bool(model.config.tie_word_embeddings)
            tmp = args.dst / ".float"
            model.save_pretrained(tmp)
            load_from = tmp
        else:
            load_from = src
        model = AutoModelForCausalLM.from_pretrained(
            load_from, quantization_config=TorchQmmConfig(bits=args.bits, group_size=args.group_size),
            dtype=_DTYPES[args.dtype] if args.dtype else "auto",
        )
        model.save_pretrained(args.dst)
        if is_gguf:
            shutil.rmtree(args.dst / ".float")
    if not is_gguf:
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_SUFFIXES):
                if not (args.dst / f.name).exists():
                    shutil.copy2(f, args.dst / f.name)
    print(f"wrote {args.dst} ({args.format}, bits={args.bits}, group_size={args.group_size})")
    return 0
