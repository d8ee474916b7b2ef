"""`python -m torch_qmm convert SRC DST`: quantize a transformers model folder or a GGUF file.

    python -m torch_qmm convert ./Llama-3.2-1B ./out --bits 4 --group-size 64            # transformers folder
    python -m torch_qmm convert ./Llama-3.2-1B ./out-mlx --format mlx                    # MLX folder (mlx_lm)
    python -m torch_qmm convert ./model.Q8_0.gguf ./out-mlx --format mlx                 # llama-family GGUF

--format transformers (default): a folder that `from_pretrained` reloads (import
torch_qmm.interop.transformers first). Linear layers are quantized except the output head.
--format mlx: an MLX folder; linear layers *and* the embedding are quantized (as mlx.nn.quantize
does), a tied output head reuses the quantized embedding. From GGUF, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1
layers keep their exact weights (affine, group size 32); Q4_K layers (linear and embedding) are
converted without re-quantization to bits 4, group size 32 (gguf.q4_k_to_affine): exact with
float32 scales/biases (the default for GGUF), rounded with --dtype float16/bfloat16 (the output
says which layers are exact); Q6_K/float layers are re-quantized to --bits/--group-size.
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
from .gguf import GGUFFile, dequantize, q4_k_to_affine
from .gguf_types import Q4_K
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
    parser.add_argument("--method", choices=["rtn", "mse", "awq", "gptq"], default="rtn",
                        help="quantizer (default rtn: MLX's, bit for bit); all write the same format")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE.txt",
                        help="plain text for awq/gptq, tokenized with the model's tokenizer")


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


def _q4_k_affine(blocks, n: int, k: int, dtype: torch.dtype, name: str):
    """(wq, scales, biases in dtype, exact): Q4_K blocks as affine bits 4 / group 32; exact is
    whether the scales and biases survived the cast to dtype (always in float32)."""
    wq, s32, b32 = q4_k_to_affine(blocks, n, k, torch.float32)
    scales, biases = s32.to(dtype), b32.to(dtype)
    if not (torch.isfinite(scales).all() and torch.isfinite(biases).all()):
        raise ValueError(f"{name}: Q4_K scales/biases overflow {dtype}; convert with --dtype float32")
    exact = torch.equal(scales.float(), s32) and torch.equal(biases.float(), b32)
    return wq, scales, biases, exact


def _q4_k_to_affine_modules(model: nn.Module, f: GGUFFile, dtype: torch.dtype) -> dict[str, bool]:
    """Replaces Q4_K GGUFLinear layers and Q4_K embeddings (decoded to float by the loader) with
    their affine form; a float output tied to such an embedding becomes TiedQuantLinear.
    Returns {module name: exact}."""
    from .gguf_llama import hf_name

    exact: dict[str, bool] = {}
    for name, m in list(model.named_modules()):
        if isinstance(m, GGUFLinear) and m.ggml_type == Q4_K:
            wq, scales, biases, exact[name] = _q4_k_affine(m.blocks, m.out_features, m.in_features, dtype, name)
            layer = QuantLinear(m.in_features, m.out_features, bias=m.bias is not None, bits=4, group_size=32,
                                dtype=dtype)
            layer.qweight.copy_(wq)
            layer.scales.copy_(scales)
            layer.biases.copy_(biases)
            if m.bias is not None:
                with torch.no_grad():
                    layer.bias.copy_(m.bias)
            _replace(model, name, layer)
    for gname, t in f.tensors.items():
        module_name = (hf_name(gname) or "").rpartition(".")[0]
        if t.ggml_type != Q4_K or not gname.endswith(".weight") or not module_name:
            continue
        try:
            emb = model.get_submodule(module_name)
        except AttributeError:
            continue
        if type(emb) is not nn.Embedding:
            continue
        n, k = t.shape
        wq, scales, biases, exact[module_name] = _q4_k_affine(t.raw, n, k, dtype, module_name)
        new = QuantEmbedding(n, k, 4, 32, dtype=dtype)
        new.qweight.copy_(wq)
        new.scales.copy_(scales)
        new.biases.copy_(biases)
        tied = [o for o, lin in model.named_modules() if type(lin) is nn.Linear and lin.weight is emb.weight]
        _replace(model, module_name, new)
        for out_name in tied:
            _replace(model, out_name, TiedQuantLinear(new))
    return exact


def _report_q4_k(exact: dict[str, bool], dtype: torch.dtype) -> None:
    if not exact:
        return
    ok = [n for n, e in exact.items() if e]
    rounded = [n for n, e in exact.items() if not e]
    print(f"Q4_K -> affine bits=4 group_size=32 without re-quantization: {len(ok)}/{len(exact)} layers exact "
          f"({dtype} scales/biases)")
    if ok:
        print(f"  exact: {', '.join(ok)}")
    if rounded:
        print(f"  NOT exact (scales/biases rounded to {dtype}; use --dtype float32 for exact): {', '.join(rounded)}")


def _load_gguf(src: Path, dtype: torch.dtype, keep_affine: bool):
    """The GGUF model as a transformers model. keep_affine (MLX output): affine layers stay, Q4_K
    layers become exact affine ones; everything else becomes float (re-quantized later).
    Returns (model, {Q4_K module: exact})."""
    from transformers import LlamaForCausalLM

    from .gguf_llama import llama_config_from_gguf, load_gguf_llama

    f = GGUFFile(src)
    config = llama_config_from_gguf(f)
    model = LlamaForCausalLM(config).eval()
    print(load_gguf_llama(model, f, dtype=dtype, progress=True))
    q4_k_exact = _q4_k_to_affine_modules(model, f, dtype) if keep_affine else {}
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
    return model, q4_k_exact


def _calibration(args: argparse.Namespace, is_gguf: bool):
    """Token-id windows of --calibration (None without it); awq/gptq require it."""
    if args.calibration is None:
        if args.method in ("awq", "gptq"):
            raise SystemExit(f"convert: --method {args.method} needs --calibration FILE.txt (plain text)")
        return None
    if not args.calibration.is_file():
        raise SystemExit(f"convert: --calibration {args.calibration} is not a file")
    try:
        text = args.calibration.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"convert: --calibration {args.calibration} is not UTF-8 text ({e})")
    from transformers import AutoTokenizer

    from ..quantizers.calibration import from_text

    src: Path = args.src
    tok = (AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name) if is_gguf
           else AutoTokenizer.from_pretrained(src))
    try:
        return from_text(tok, text)
    except ValueError as e:
        raise SystemExit(f"convert: --calibration {args.calibration}: {e}")


def _quantize_for_mlx(model: nn.Module, bits: int, group_size: int, method: str = "rtn", calibration=None) -> None:
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
    summary = quantize_model(model, bits=bits, group_size=group_size, progress=True, method=method,
                             calibration=calibration)
    if summary.converted:
        print(summary)


def run(args: argparse.Namespace) -> int:
    from .transformers import TorchQmmConfig  # registers the quantizer; checks bits / group size

    TorchQmmConfig(bits=args.bits, group_size=args.group_size)
    src: Path = args.src
    if not src.exists():
        raise SystemExit(f"convert: {src} does not exist")
    is_gguf = src.is_file() and src.suffix == ".gguf"
    q4_k_exact: dict[str, bool] = {}
    if not is_gguf and not (src / "config.json").is_file():
        raise SystemExit(f"convert: {src} is neither a .gguf file nor a transformers folder with config.json")
    calibration = _calibration(args, is_gguf)
    from transformers import AutoModelForCausalLM

    if args.format == "mlx":
        from .mlx import save_mlx

        if is_gguf:
            model, q4_k_exact = _load_gguf(src, _DTYPES[args.dtype or "float32"], keep_affine=True)
            _report_q4_k(q4_k_exact, _DTYPES[args.dtype or "float32"])
        else:
            model = AutoModelForCausalLM.from_pretrained(src, dtype=_DTYPES[args.dtype] if args.dtype else "auto")
        _quantize_for_mlx(model, args.bits, args.group_size, args.method, calibration)
        config = model.config.to_dict()
        save_mlx(model, args.dst, config=config)
    else:
        if is_gguf:
            model, _ = _load_gguf(src, _DTYPES[args.dtype or "float32"], keep_affine=False)
            model.config.tie_word_embeddings = bool(model.config.tie_word_embeddings)
            tmp = args.dst / ".float"
            model.save_pretrained(tmp)
            load_from = tmp
        else:
            load_from = src
        model = AutoModelForCausalLM.from_pretrained(
            load_from, quantization_config=TorchQmmConfig(bits=args.bits, group_size=args.group_size,
                                                          method=args.method, calibration=calibration),
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
    summary = f"wrote {args.dst} ({args.format}, bits={args.bits}, group_size={args.group_size})"
    if is_gguf and args.format == "mlx" and q4_k_exact:
        n_exact = sum(q4_k_exact.values())
        summary += (f"; Q4_K layers as affine bits=4 group_size=32: {n_exact}/{len(q4_k_exact)} exact"
                    + ("" if n_exact == len(q4_k_exact) else " (the others rounded: use --dtype float32)"))
    print(summary)
    return 0
