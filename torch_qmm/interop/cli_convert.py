"""`python -m torch_qmm convert SRC DST`: a transformers folder or a llama-family GGUF file into a
torch_qmm (transformers) or MLX model folder."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from torch import nn

from .. import quantizers, reference
from ..cli_errors import UsageError
from ..convert import quantize_model
from ..formats import FORMATS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from ..nn import QuantLinear, resolve_format
from .gguf import GGUFFile, dequantize, q4_k_to_affine
from .gguf_types import Q4_K, type_name
from .modules import GGUFLinear, QuantEmbedding, TiedQuantLinear
from .output_folder import check_destination, side_file_source, staged_output

DESCRIPTION = """\
Convert a model to a torch_qmm or MLX folder.

    python -m torch_qmm convert ./Llama-3.2-1B ./out --bits 4 --group-size 64   # transformers folder
    python -m torch_qmm convert ./Llama-3.2-1B ./out-mlx --format mlx           # MLX folder (mlx_lm)
    python -m torch_qmm convert ./model.Q8_0.gguf ./out-mlx --format mlx        # GGUF, lossless
    python -m torch_qmm convert ./Llama-3.2-1B ./out-mxfp4 --format mlx --mode mxfp4

A transformers folder (float weights) is quantized with --mode / --bits / --group-size (bits and
group size default to the mode's, as MLX's; see --help): every linear layer
except the output head (--format transformers, reloadable with from_pretrained after importing
torch_qmm.interop.transformers), or the linear layers and the embedding (--format mlx, as
mlx.nn.quantize does; a tied output head reuses the quantized embedding).

A llama-family GGUF file keeps its quantization where the MLX format can hold it exactly:
Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 become affine layers with group size 32 bit for bit, Q4_K becomes
bits 4 / group size 32 (exact with float32 scales, the default for GGUF; --dtype float16/bfloat16
rounds them and the output says which layers). Layers without an exact affine form (Q6_K, float)
stay float unless --requantize asks otherwise; --bits/--group-size apply only with --requantize.
The transformers format holds one format for all layers, so GGUF -> transformers always
re-quantizes and needs --requantize all. Both formats get tokenizer files built (by transformers)
from the GGUF's tokenizer metadata. The output lists what happened to every layer.

DST must not exist or be empty (or pass --overwrite); it is written to a temporary folder next to
it and moved into place when complete, and never inside the source."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Files of a transformers folder that are not weights or config: copied to DST (tokenizer, ...).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, help="a transformers model folder (config.json + weights) or a .gguf file")
    parser.add_argument("dst", type=Path, help="the output folder (must not exist or be empty, see --overwrite)")
    parser.add_argument("--format", choices=["transformers", "mlx"], default="transformers",
                        help="output: a transformers folder with torch_qmm layers, or an MLX folder for mlx / "
                             "mlx_lm (default: %(default)s)")
    defaults = ", ".join(f"{m} {f.default_bits} / {f.default_group_size}" for m, f in FORMATS.items())
    parser.add_argument("--mode", choices=list(FORMATS), default="affine",
                        help="MLX's quantization mode of the layers quantized by this run (default: %(default)s); "
                             f"the modes' default bits / group size: {defaults}")
    parser.add_argument("--bits", type=int, choices=SUPPORTED_BITS, default=None,
                        help="bits per weight of the layers quantized by this run (default: the mode's, 4 for "
                             "affine; for GGUF only with --requantize)")
    parser.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=None,
                        help="weights per scale/bias of the layers quantized by this run (default: the mode's, "
                             "64 for affine; for GGUF only with --requantize)")
    parser.add_argument("--requantize", choices=["rest", "all"], default=None,
                        help="GGUF only. rest: quantize the layers without an exact affine form (Q6_K, float) "
                             "to --bits/--group-size, keep the others exact; all: re-quantize every layer from "
                             "its decoded weights (lossy). Default: no re-quantization")
    parser.add_argument("--dtype", choices=list(_DTYPES), default=None,
                        help="dtype of the float weights and of scales/biases (default: the source's; float32 "
                             "for GGUF)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing non-empty DST (only once the new folder is complete)")
    parser.add_argument("--method", choices=quantizers.names(), default="rtn",
                        help="quantizer; all write the same format. " + quantizers.help_text())
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
        raise UsageError(f"{name}: Q4_K scales/biases overflow {dtype}; convert with --dtype float32")
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


def _uninitialized(model_class, config) -> nn.Module:
    """The model without initializing its weights: built on the meta device, then given
    uninitialized CPU storage, whose pages stay untouched (not resident) for the layers the loader
    replaces; the rotary embedding, whose buffers are computed rather than loaded, is built for real."""
    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own storage: tie the output head again
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def _gguf_types(f: GGUFFile) -> dict[str, str]:
    """{transformers module name: GGUF type name of its weight}."""
    from .gguf_llama import hf_name

    out = {}
    for gname, t in f.tensors.items():
        name = hf_name(gname)
        if name and name.endswith(".weight") and len(t.shape) == 2:
            out[name.rpartition(".")[0]] = type_name(t.ggml_type)
    return out


def _load_gguf(f: GGUFFile, dtype: torch.dtype, keep_affine: bool):
    """The GGUF model as a transformers model. keep_affine (MLX output): affine layers stay, Q4_K
    layers become exact affine ones; everything else becomes float.
    Returns (model, {Q4_K module: exact}, {module: GGUF type})."""
    from transformers import LlamaForCausalLM

    from .gguf_llama import llama_config_from_gguf, load_gguf_llama

    config = llama_config_from_gguf(f)  # checked against the tensors before anything is built
    model = _uninitialized(LlamaForCausalLM, config)
    print(load_gguf_llama(model, f, dtype=dtype, progress=True))  # strict: every parameter comes from the file
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
    return model, q4_k_exact, _gguf_types(f)


def _calibration(args: argparse.Namespace, is_gguf: bool):
    """Token-id windows of --calibration (None without it); awq/gptq require it."""
    if args.calibration is None:
        if quantizers.resolve(args.method).calibrated:
            raise UsageError(f"--method {args.method} needs --calibration FILE.txt (plain text)")
        return None
    if not args.calibration.is_file():
        raise UsageError(f"--calibration {args.calibration} is not a file")
    try:
        text = args.calibration.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.calibration}: the --calibration file is not UTF-8 text ({e})") from e
    from transformers import AutoTokenizer

    from ..quantizers.calibration import from_text
    from .gguf_tokenizer import gguf_tokenizer

    src: Path = args.src
    tok = gguf_tokenizer(src) if is_gguf else AutoTokenizer.from_pretrained(src)  # the tokenizer written to DST
    try:
        return from_text(tok, text)
    except ValueError as e:
        raise ValueError(f"{args.calibration}: {e}") from e


def _quantize_for_mlx(model: nn.Module, bits: int, group_size: int, method: str = "rtn",
                     calibration=None, mode: str = "affine") -> set[str]:
    """Quantizes the float linear layers and embeddings of `model` (MLX's rule; the linear layers
    with `method`); returns the names quantized by this call."""
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embeddings = {n: m for n, m in model.named_modules() if type(m) is nn.Embedding}
    tied_outputs = {
        n: e for n, m in model.named_modules() if type(m) is nn.Linear
        for e, emb in embeddings.items() if m.weight is emb.weight
    }
    done = set()
    for name, emb in embeddings.items():
        if emb.embedding_dim % group_size == 0:
            _replace(model, name, QuantEmbedding.from_embedding(emb, bits=bits, group_size=group_size, mode=mode))
            done.add(name)
    for out_name, emb_name in tied_outputs.items():
        emb = model.get_submodule(emb_name)
        if tied and isinstance(emb, QuantEmbedding):
            _replace(model, out_name, TiedQuantLinear(emb))
            done.add(out_name)
    # The layers kept exact (QuantLinear, GGUFLinear) are left out: only float ones are quantized.
    summary = quantize_model(model, bits=bits, group_size=group_size, progress=True, method=method,
                             calibration=calibration, filter_fn=lambda _, m: type(m) is nn.Linear, mode=mode)
    return done | set(summary.converted)


# Why a GGUF-quantized layer was written as float, per output format.
_WHY_DECODED = {
    "mlx": "no exact affine form: --requantize rest quantizes it",
    "transformers": "the transformers format keeps the embedding and the output head float; "
                    "--format mlx keeps them quantized",
}


def _layer_report(model: nn.Module, origin: dict[str, str], quantized_now: set[str],
                  q4_k_exact: dict[str, bool], output_format: str) -> list[tuple[str, str]]:
    """[(module name, what happened)] for every linear layer and embedding of the written model."""
    rows = []
    for name, m in model.named_modules():
        src = origin.get(name, "float")
        if isinstance(m, TiedQuantLinear):
            fmt = f"tied to the embedding ({m._embedding.mode} b{m._embedding.bits} gs{m._embedding.group_size})"
        elif isinstance(m, (QuantLinear, QuantEmbedding)):
            fmt = f"{m.mode} b{m.bits} gs{m.group_size}"
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            fmt = f"float {str(m.weight.dtype)[6:]}"
        else:
            continue
        if isinstance(m, TiedQuantLinear):
            how = fmt
        elif name in quantized_now:
            how = f"{'re-quantized' if src != 'float' else 'quantized'} {src} -> {fmt}"
        elif isinstance(m, (QuantLinear, QuantEmbedding)):
            exact = q4_k_exact.get(name, True)
            how = f"{'lossless' if exact else 'Q4_K scales rounded to ' + str(m.scales.dtype)[6:]} {src} -> {fmt}"
        elif src in ("float", "F32", "F16", "BF16"):
            how = f"kept {fmt}" if src == "float" else f"kept {src} -> {fmt}"
        else:
            exact = "as gguf decodes it" if m.weight.dtype == torch.float32 else f"rounded to {str(m.weight.dtype)[6:]}"
            how = f"decoded {src} -> {fmt} ({exact}; {_WHY_DECODED[output_format]})"
        rows.append((name, how))
    return rows


def _print_report(rows: list[tuple[str, str]]) -> None:
    width = max([len(n) for n, _ in rows] + [5])
    for name, how in rows:
        print(f"  {name:<{width}}  {how}")
    counts: dict[str, int] = {}
    for _, how in rows:
        kind = how.split(" ")[0]
        counts[kind] = counts.get(kind, 0) + 1
    print("layers: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


def _check_arguments(args: argparse.Namespace, is_gguf: bool) -> None:
    try:
        resolve_format(args.mode, args.bits, args.group_size)
    except ValueError as e:
        raise UsageError(str(e).replace("argument 'bits'", "--bits").replace("argument 'group_size'", "--group-size")
                         .replace("(mode ", "(--mode ")) from None
    if args.mode != "affine" and args.method != "rtn":
        raise UsageError(f"--method {args.method} writes the affine format; --mode {args.mode} is quantized with "
                         "--method rtn")
    flags = [f for f, v in (("--mode", args.mode if args.mode != "affine" else None), ("--bits", args.bits),
                            ("--group-size", args.group_size)) if v is not None]
    if not is_gguf:
        if args.requantize:
            raise UsageError(f"--requantize applies to GGUF sources only; {args.src} is a float transformers folder, "
                             "which is always quantized with --bits/--group-size")
        return
    if args.format == "transformers" and args.requantize != "all":
        raise UsageError(f"{args.src}: the transformers format holds one format for all layers, so GGUF -> "
                         "transformers re-quantizes every layer (lossy). Use --format mlx for the exact layers, or "
                         "--requantize all [--bits B --group-size G] to re-quantize")
    if flags and not args.requantize:
        verb = "apply" if len(flags) > 1 else "applies"
        raise UsageError(f"{' and '.join(flags)} {verb} only to re-quantization: {args.src} keeps its own formats "
                         "(lossless) unless --requantize rest|all is given")


def _check_transformers_folder(src: Path) -> None:
    """Reads config.json and every safetensors header with our checks before transformers sees them.
    A folder without safetensors weights is refused: transformers would read its pytorch_model.bin
    (or other pickle files) through torch.load, and convert reads no pickle."""
    from .json_files import read_json_object
    from .safetensors_io import Checkpoint

    config = read_json_object(src / "config.json")
    if not isinstance(config.get("model_type"), str):
        raise ValueError(f"{src / 'config.json'}: field 'model_type' must be a string, got "
                         f"{config.get('model_type')!r}")
    if not any(src.glob("*.safetensors")):
        pickled = sorted(f.name for f in src.iterdir() if f.name.endswith((".bin", ".pt", ".pth", ".ckpt")))
        found = f"only {', '.join(pickled)}: pickle, which convert does not load" if pickled else "none at all"
        raise ValueError(f"{src}: no .safetensors weights ({found}); convert reads safetensors only: save the model "
                         "with save_pretrained first")
    Checkpoint(src)


def from_pretrained(path: Path, **kwargs):
    """AutoModelForCausalLM.from_pretrained, its errors as ValueErrors naming the folder."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, ZeroDivisionError) as e:
        raise ValueError(f"{path}: transformers could not build the model from its config/weights: "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:400]}") from e


def run(args: argparse.Namespace) -> int:
    from .transformers import TorchQmmConfig  # registers the quantizer

    src: Path = args.src
    if not src.exists():
        raise UsageError(f"source {src} does not exist")
    is_gguf = src.is_file() and src.suffix == ".gguf"
    if not is_gguf and not (src.is_dir() and (src / "config.json").is_file()):
        raise UsageError(f"source {src} is neither a .gguf file nor a transformers folder with config.json")
    _check_arguments(args, is_gguf)
    calibration = _calibration(args, is_gguf)
    check_destination(src, args.dst, args.overwrite)
    bits, group_size = resolve_format(args.mode, args.bits, args.group_size)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    if not is_gguf:
        _check_transformers_folder(src)
        side_files = [(f.name, side_file_source(src, f)) for f in sorted(src.iterdir())
                      if (f.is_file() or f.is_symlink()) and f.name != "config.json"
                      and not f.name.endswith(_WEIGHT_SUFFIXES)]

    gguf = GGUFFile(src) if is_gguf else None  # read once: the weights, config and tokenizer come from it
    with staged_output(args.dst) as out:
        origin: dict[str, str] = {}
        q4_k_exact: dict[str, bool] = {}
        quantized_now: set[str] = set()
        if args.format == "mlx":
            from .mlx import save_mlx

            if is_gguf:
                model, q4_k_exact, origin = _load_gguf(gguf, dtype or torch.float32,
                                                       keep_affine=args.requantize != "all")
            else:
                model = from_pretrained(src, dtype=dtype or "auto")
            if not is_gguf or args.requantize:
                quantized_now = _quantize_for_mlx(model, bits, group_size, args.method, calibration, args.mode)
            save_mlx(model, out, config=model.config.to_dict())
        else:
            cfg = TorchQmmConfig(bits=bits, group_size=group_size, method=args.method, calibration=calibration,
                                 mode=args.mode)
            if is_gguf:
                model, _, origin = _load_gguf(gguf, dtype or torch.float32, keep_affine=False)
                model.config.tie_word_embeddings = bool(model.config.tie_word_embeddings)
                staging = out / ".float"  # inside this run's temporary folder; removed below
                model.save_pretrained(staging)
                model = from_pretrained(staging, quantization_config=cfg, dtype=dtype or "auto")
                shutil.rmtree(staging)
            else:
                model = from_pretrained(src, quantization_config=cfg, dtype=dtype or "auto")
            quantized_now = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
            model.save_pretrained(out)
        if is_gguf:
            from .gguf_tokenizer import save_gguf_tokenizer

            written = save_gguf_tokenizer(gguf, out, shown_as=args.dst)
            if written:
                print(f"tokenizer from the GGUF metadata: {', '.join(written)}")
        else:
            for name, f in side_files:
                if not (out / name).exists():
                    shutil.copyfile(f, out / name)
        rows = _layer_report(model, origin, quantized_now, q4_k_exact, args.format)
    _print_report(rows)
    if any("rounded" in how for _, how in rows):
        print("  (Q4_K scales/biases rounded to the --dtype: use --dtype float32 for exact Q4_K layers)")
    formats = sorted({how.split(" -> ")[-1] for _, how in rows})
    print(f"wrote {args.dst} ({args.format}): {len(rows)} layers; formats: {'; '.join(formats)}")
    return 0

