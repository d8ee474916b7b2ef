"""`python -m torch_qmm convert SRC DST`: a transformers folder or a llama-family GGUF file into a
torch_qmm (transformers) or MLX model folder."""

from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from .. import ops, quantizers, reference
from ..cli_errors import UsageError
from ..convert import CONV1D_NOT_CONVERTED, is_conv1d, quantize_model
from ..formats import FORMATS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from ..nn import QuantLinear, resolve_format
from ..nn_moe import QuantFusedExperts, QuantSwitchLinear
from .experts import is_fused_experts, layout_of
from .gguf import K_AFFINE_BITS, GGUFFile, GGUFTensor, affine_exact, dequantize, k_quant_to_affine
from .gguf_moe import (block_experts, describe as describe_experts, expert_part, experts_module_name, fill_float,
                       float_experts_module, projection_stacks)
from .gguf_types import AFFINE_TYPES, FP_TYPES, Q4_K, type_name
from .modules import (GGUFLinear, QuantEmbedding, TiedQuantLinear, replace_embedding, replace_module,
                      replaceable_embedding, tie_float_output)
from .output_folder import check_destination, side_file_source, staged_output

DESCRIPTION = """\
Convert a model to a torch_qmm or MLX folder.

    python -m torch_qmm convert ./Llama-3.2-1B ./out --bits 4 --group-size 64   # transformers folder
    python -m torch_qmm convert ./Llama-3.2-1B ./out-mlx --format mlx           # MLX folder (mlx_lm)
    python -m torch_qmm convert ./model.Q8_0.gguf ./out-mlx --format mlx        # GGUF, lossless
    python -m torch_qmm convert ./model.Q8_0.gguf ./out-hf                      # GGUF, lossless (transformers)
    python -m torch_qmm convert ./Llama-3.2-1B ./out-mxfp4 --format mlx --mode mxfp4

A transformers folder (float weights) is quantized with --mode / --bits / --group-size (bits and
group size default to the mode's, as MLX's; see --help): every linear layer and the experts of
MoE blocks (routers stay float) except the output head (--format transformers, reloadable with
from_pretrained after `import torch_qmm`), or those, the output head and the
embedding (--format mlx, as mlx.nn.quantize does; a tied output head reuses the quantized embedding).
A folder torch_qmm already quantized keeps its layers' format, bit for bit (the layers float in it
that --format mlx quantizes take that format too); --mode / --bits / --group-size asking for another
format are refused: quantized layers are not re-quantized.

A llama-family GGUF file keeps its quantization where the output format can hold it exactly
(architectures llama, mistral, qwen2, qwen3, their MoE forms, gpt-oss):
Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and IQ4_NL become affine layers with group size 32 bit for bit (IQ4_NL as
8-bit layers: its 4-bit codes index int8 values), MXFP4 (gpt-oss's experts) mxfp4 layers bit for
bit (--format mlx: MLX keeps a mode per layer), Q4_K, Q5_K and IQ4_XS become bits 4, 5 and 8 /
group size 32 (exact with float32 scales, the default for GGUF; --dtype
float16/bfloat16 rounds them, and bfloat16 the others' float16 scales; the output says which layers). Layers
without an exact affine form (Q2_K, Q3_K, Q6_K, the lattice i-quants IQ1_S .. IQ3_S, float) stay float unless --requantize asks otherwise:
rest quantizes them with --bits/--group-size, all re-quantizes every layer (lossy); --bits,
--group-size, --method and --calibration apply only with --requantize. The transformers format keeps an exact
embedding (a tied output head reads it) and an exact output head, and quantizes no other
embedding or head (decoded exactly, a tied head stays tied to the embedding); its quantization_config holds one group size and mode, so there --requantize rest
quantizes with the exact layers' group size 32 and refuses another. Both formats get tokenizer
files built (by transformers) from the GGUF's tokenizer metadata. The output lists what happened
to every layer.

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
    parser.add_argument("--mode", choices=list(FORMATS), default=None,
                        help="MLX's quantization mode of the layers quantized by this run (default: affine; a "
                             f"folder torch_qmm quantized: its own); the modes' default bits / group size: {defaults}")
    parser.add_argument("--bits", type=int, choices=SUPPORTED_BITS, default=None,
                        help="bits per weight of the layers quantized by this run (default: the mode's, 4 for "
                             "affine; for GGUF only with --requantize); a folder torch_qmm quantized keeps its own")
    parser.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=None,
                        help="weights per scale/bias of the layers quantized by this run (default: the mode's, "
                             "64 for affine; for GGUF only with --requantize, and 32 for GGUF -> transformers "
                             "with --requantize rest: the exact layers'); a folder torch_qmm quantized keeps its own")
    parser.add_argument("--requantize", choices=["rest", "all"], default=None,
                        help="GGUF only. rest: quantize the layers without an exact affine form (Q2_K, Q3_K, Q6_K, the lattice i-quants, float) "
                             "to --bits/--group-size, keep the others exact; all: re-quantize every layer from "
                             "its decoded weights (lossy). Default: no re-quantization (lossless)")
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
        t = GGUFTensor("", layer.ggml_type, (layer.out_features, layer.in_features), layer.blocks.numpy())
        w = dequantize(t)
    elif layer.mode == "affine":
        w = reference.dequantize(layer.qweight, layer.scales, layer.biases, layer.bits, layer.group_size)
    else:  # an fp mode (GGUF's MXFP4): its values are exact in float32
        w = ops.dequantize(layer.qweight, layer.scales, None, layer.group_size, layer.bits, layer.mode,
                           dtype=torch.float32)
    out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if layer.bias is not None:
            out.bias.copy_(layer.bias)
    return out


def _k_affine(blocks, n: int, k: int, ggml_type: int, dtype: torch.dtype, name: str):
    """(wq, scales, biases in dtype, exact): Q4_K / Q5_K / IQ4_XS blocks as affine bits 4 / 5 / 8, group 32;
    exact is whether the scales and biases survived the cast to dtype (always in float32)."""
    wq, s32, b32 = k_quant_to_affine(blocks, n, k, ggml_type, torch.float32)
    scales, biases = s32.to(dtype), b32.to(dtype)
    if not (torch.isfinite(scales).all() and torch.isfinite(biases).all()):
        raise UsageError(f"{name}: {type_name(ggml_type)} scales/biases overflow {dtype}; convert with --dtype float32")
    exact = torch.equal(scales.float(), s32) and torch.equal(biases.float(), b32)
    return wq, scales, biases, exact


def _k_quants_to_affine_modules(model: nn.Module, f: GGUFFile, dtype: torch.dtype,
                                embeddings: bool = True) -> dict[str, bool]:
    """Replaces Q4_K / Q5_K / IQ4_XS GGUFLinear layers and (with `embeddings`) Q4_K embeddings (decoded
    to float by the loader; Q5_K and IQ4_XS ones are affine already) with their affine form; a float output tied to such an embedding becomes
    TiedQuantLinear. Returns {module name: exact}."""
    from .gguf_llama import architecture_of, hf_name

    arch = architecture_of(f)
    exact: dict[str, bool] = {}
    for name, m in list(model.named_modules()):
        if isinstance(m, GGUFLinear) and m.ggml_type in K_AFFINE_BITS:
            wq, scales, biases, exact[name] = _k_affine(m.blocks, m.out_features, m.in_features, m.ggml_type, dtype,
                                                        name)
            layer = QuantLinear(m.in_features, m.out_features, bias=m.bias is not None,
                                bits=K_AFFINE_BITS[m.ggml_type], group_size=32, dtype=dtype)
            layer.qweight.copy_(wq)
            layer.scales.copy_(scales)
            layer.biases.copy_(biases)
            if m.bias is not None:
                with torch.no_grad():
                    layer.bias.copy_(m.bias)
            replace_module(model, name, layer)
    for gname, t in f.tensors.items() if embeddings else ():
        f.check_unchanged()
        module_name = (hf_name(gname, arch) or "").rpartition(".")[0]
        if t.ggml_type != Q4_K or not gname.endswith(".weight") or not module_name:
            continue
        try:
            emb = model.get_submodule(module_name)
        except AttributeError:
            continue
        if type(emb) is not nn.Embedding:
            continue
        n, k = t.shape
        wq, scales, biases, exact[module_name] = _k_affine(t.raw, n, k, Q4_K, dtype, module_name)
        new = QuantEmbedding(n, k, 4, 32, dtype=dtype)
        new.qweight.copy_(wq)
        new.scales.copy_(scales)
        new.biases.copy_(biases)
        replace_embedding(model, module_name, new)
    return exact


def _experts_for_output(model: nn.Module, f: GGUFFile, dtype: torch.dtype, keep_affine: bool,
                        rest: tuple[int, int, str] | None = None) -> tuple[dict[str, bool], dict[str, str], dict[str, str]]:
    """Gives the MoE experts load_gguf_llama kept quantized a form the output formats hold: with
    keep_affine, experts whose projections all have an exact affine form (the affine types and
    Q4_K, Q5_K, IQ4_XS) become affine QuantSwitchLinear layers (MXFP4 ones stay mxfp4); every other block's experts become float again,
    as gguf decodes them. rest: (bits, group_size, mode) of --requantize rest: where one projection
    (gate_up_proj or down_proj) has an exact form and the other has not, as down_proj Q6_K beside
    Q4_K gate and up in llama.cpp's Q4_K_M files, the other alone is re-quantized (_requantized_switch)
    and the first kept exact. Returns ({experts: exact in dtype (its projections kept exact)},
    {experts: their GGUF types}, {experts: the projection re-quantized})."""
    exact, origin, requantized = {}, {}, {}
    parts_of = [expert_part(n) for n in f.tensors]
    blocks = {experts_module_name(p[0]): p[0] for p in parts_of if p is not None}
    for name, m in list(model.named_modules()):
        if name not in blocks:
            continue
        parts = block_experts(f, blocks[name])
        origin[name] = describe_experts(parts)  # also for experts the loader decoded to float
        if not isinstance(m, QuantFusedExperts):
            continue
        stacks = {proj: projection_stacks(parts, proj, m.interleaved) for proj in ("down_proj", "gate_up_proj")}
        layers = {}
        for proj, placed in stacks.items():
            layers[proj] = _affine_switch(getattr(m, proj), [st for st, _ in placed], dtype, name) if keep_affine else None
            if layers[proj] is None and rest is None:
                break  # down first: where it has no exact affine form, gate_up is not converted in vain
        missing = [proj for proj in stacks if layers.get(proj) is None]
        if rest is not None and len(missing) == 1:
            layers[missing[0]] = _requantized_switch(m, missing[0], stacks[missing[0]], dtype, rest)
            if layers[missing[0]] is not None:
                requantized[name] = missing[0]
        if any(layers.get(proj) is None for proj in stacks):
            replace_module(model, name, float_experts_module(m, parts, dtype))
            continue
        (m.gate_up_proj, gate_up_exact), (m.down_proj, down_exact) = layers["gate_up_proj"], layers["down_proj"]
        exact[name] = gate_up_exact and down_exact
    return exact, origin, requantized


def _requantized_switch(experts: QuantFusedExperts, proj: str, placed: list, dtype: torch.dtype,
                        rest: tuple[int, int, str]):
    """(projection `proj` of `experts` re-quantized as rest = (bits, group_size, mode) says, True), or
    None where its inputs are no multiple of the group size. Its weights are gguf's decode (one
    expert at a time), rounded once to dtype, then quantized as quantize_experts quantizes a float
    block (MLX's rounding), so that this projection comes out as it would from a float block."""
    bits, group_size, mode = rest
    layer = getattr(experts, proj)
    if layer.in_features % group_size:
        return None
    weight = torch.empty(layer.num_experts, layer.out_features, layer.in_features, dtype=dtype)
    fill_float(weight, placed)  # placed: gguf_moe.projection_stacks
    return QuantSwitchLinear.from_float(weight, layer.bias, bits, group_size, dtype, mode), True


def _affine_switch(layer: nn.Module, stacks: list, dtype: torch.dtype, name: str):
    """(an affine QuantSwitchLinear computing what `layer` does, exact in dtype) or None where the
    GGUF type has no exact affine form. stacks: its gguf_moe.ExpertStack(s)."""
    if isinstance(layer, QuantSwitchLinear) and layer.mode != "affine":  # MXFP4 as mxfp4: the file's bits
        return layer, True
    if isinstance(layer, QuantSwitchLinear):  # the affine types: to_affine(t, dtype) in the loader
        return layer, all(affine_exact(t, dtype) for st in stacks for t in st.experts)
    if layer.ggml_type not in K_AFFINE_BITS:
        return None
    e, out, k = layer.num_experts, layer.out_features, layer.in_features
    wq, scales, biases, exact = _k_affine(layer.blocks.reshape(e * out, -1), e * out, k, layer.ggml_type, dtype, name)
    return QuantSwitchLinear.from_quantized(wq.reshape(e, out, -1), scales.reshape(e, out, -1),
                                            biases.reshape(e, out, -1), bias=layer.bias,
                                            bits=K_AFFINE_BITS[layer.ggml_type], group_size=32, dtype=dtype), exact


def _weight_tensors(f: GGUFFile) -> dict[str, GGUFTensor]:
    """{transformers module name: the GGUF tensor of its weight}."""
    from .gguf_llama import architecture_of, hf_name

    arch, out = architecture_of(f), {}
    for gname, t in f.tensors.items():
        if expert_part(gname) is not None:  # the experts of a MoE block: _experts_for_output
            continue
        name = hf_name(gname, arch)
        if name and name.endswith(".weight"):
            out[name.rpartition(".")[0]] = t
    return out


def _gguf_types(f: GGUFFile) -> dict[str, str]:
    """{transformers module name: GGUF type name of its weight} (matrices only)."""
    return {name: type_name(t.ggml_type) for name, t in _weight_tensors(f).items() if len(t.shape) == 2}


# The GGUF types a layer keeps exactly as an affine layer of group size 32.
_EXACT_TYPES = AFFINE_TYPES + tuple(t for t in K_AFFINE_BITS if t not in AFFINE_TYPES)


def _exact_linears(f: GGUFFile) -> dict[str, str]:
    """{module: GGUF type} of the layers the transformers format keeps exact (affine, group size
    32): every matrix of an exact type, and each MoE projection (gate_up_proj of gate and up of one
    type, down_proj) of an exact type."""
    exact = {name: type_name(t.ggml_type) for name, t in _weight_tensors(f).items()
             if len(t.shape) == 2 and t.ggml_type in _EXACT_TYPES}
    for block in sorted({p[0] for p in map(expert_part, f.tensors) if p is not None}):
        parts = block_experts(f, block)
        types = {"gate_up_proj": {parts["gate"].ggml_type, parts["up"].ggml_type}, "down_proj": {parts["down"].ggml_type}}
        for proj, ts in types.items():
            if len(ts) == 1 and min(ts) in _EXACT_TYPES:
                exact[f"{experts_module_name(block)}.{proj}"] = type_name(min(ts))
    return exact


def _load_gguf(f: GGUFFile, dtype: torch.dtype, keep_affine: bool, rest: tuple[int, int, str] | None = None):
    """The GGUF model as a transformers model. keep_affine: the affine (and mxfp4) layers and the
    embedding stay, Q4_K / Q5_K / IQ4_XS layers become exact affine ones, everything else becomes
    float; without it every layer is float (the embedding decoded from the file by gguf, a tied
    output head an nn.Linear tied to it).
    rest: --requantize rest's (bits, group_size, mode), for the MoE experts (_experts_for_output).
    Returns (model, {quantized module: exact in dtype}, {module: GGUF type}, {experts: the projection
    re-quantized})."""
    from transformers import AutoModelForCausalLM

    from .gguf_llama import llama_config_from_gguf, load_gguf_llama

    float_embedding = not keep_affine
    config = llama_config_from_gguf(f)  # checked against the tensors before anything is built
    with torch.device("meta"):  # every tensor comes from the file (strict), the rotary frequencies from the config
        model = AutoModelForCausalLM.from_config(config).eval()
    print(load_gguf_llama(model, f, dtype=dtype, progress=True))
    exact = _k_quants_to_affine_modules(model, f, dtype, embeddings=not float_embedding) if keep_affine else {}
    experts_exact, experts_origin, requantized = _experts_for_output(model, f, dtype, keep_affine, rest)
    exact.update(experts_exact)
    tensors = _weight_tensors(f)
    for name, m in list(model.named_modules()):
        if isinstance(m, GGUFLinear) or (isinstance(m, QuantLinear) and not keep_affine):
            replace_module(model, name, _float_linear(m, dtype))
        elif isinstance(m, QuantEmbedding) and float_embedding:
            emb = nn.Embedding(m.num_embeddings, m.embedding_dim, dtype=dtype)
            with torch.no_grad():
                emb.weight.copy_(dequantize(tensors[name]))  # gguf's float32 decode, rounded once to dtype
            replace_module(model, name, emb)
        elif isinstance(m, TiedQuantLinear) and float_embedding:  # its weight is the embedding's, tied below
            replace_module(model, name, nn.Linear(m.in_features, m.out_features, bias=False, dtype=dtype, device="meta"))
        elif isinstance(m, (QuantLinear, QuantEmbedding)) and tensors[name].ggml_type in AFFINE_TYPES:
            exact[name] = affine_exact(tensors[name], dtype)
        elif isinstance(m, QuantLinear) and tensors[name].ggml_type in FP_TYPES:  # the file's bits
            exact[name] = True
    if float_embedding and config.tie_word_embeddings:
        tie_float_output(model, "lm_head", model.model.embed_tokens)
    if "quantization_config" in vars(model.config):  # load_gguf_llama's, of the layers as it loaded them:
        del model.config.quantization_config        # each output records the converted layers itself
    return model, exact, {**_gguf_types(f), **experts_origin}, requantized


def _calibration(args: argparse.Namespace, is_gguf: bool):
    """Token-id windows of --calibration (None without it); awq/gptq require it."""
    calibrated = quantizers.resolve(args.method).calibrated
    if args.calibration is None:
        if calibrated:
            raise UsageError(f"--method {args.method} needs --calibration FILE.txt (plain text)")
        return None
    if not calibrated:
        uses = ", ".join(n for n in quantizers.names() if quantizers.resolve(n).calibrated)
        raise UsageError(f"--calibration applies to the calibrated methods ({uses}); --method {args.method} is "
                         "data-free and would ignore it")
    if not args.calibration.is_file():
        raise UsageError(f"--calibration {args.calibration} is not a file")
    try:
        text = args.calibration.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.calibration}: the --calibration file is not UTF-8 text ({e})") from e
    if "\0" in text:  # valid UTF-8 but binary: plain text holds no NUL
        raise ValueError(f"{args.calibration}: the --calibration file is not plain text (it holds NUL bytes, the "
                         f"first at character {text.index(chr(0))})")
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
    """Quantizes the float linear layers, the fused experts of MoE blocks and the embeddings of
    `model` (MLX's rule; the linear layers with `method`); returns the names quantized by this call."""
    # (an embedding subclass whose forward QuantEmbedding does not do stays float; Gemma's scaled
    # ones are quantized with their scale, which mlx_lm's Gemma models apply themselves)
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and replaceable_embedding(m)}
    done = set()
    for name, emb in embeddings.items():
        if emb.embedding_dim % group_size == 0 and emb.max_norm is None:  # (max_norm: rows renormalized when read)
            new = QuantEmbedding.from_embedding(emb, bits=bits, group_size=group_size, mode=mode)
            done |= {name, *replace_embedding(model, name, new)}
    return done | _quantize_float_layers(model, bits, group_size, method, calibration, mode)


def _quantize_float_layers(model: nn.Module, bits: int, group_size: int, method: str, calibration, mode: str,
                           keep: set[str] = frozenset()) -> set[str]:
    """Quantizes the float nn.Linear layers and fused experts (of MoE blocks) of `model` but those
    named in `keep`; the layers kept exact (QuantLinear, GGUFLinear) are left as they are. Returns
    the names quantized."""
    with warnings.catch_warnings():
        # quantize_model records a transformers quantization_config and warns where one config cannot
        # hold the layers; the callers write (MLX) or check (transformers) the format themselves.
        warnings.filterwarnings("ignore", message="save_pretrained cannot record")
        summary = quantize_model(model, bits=bits, group_size=group_size, progress=True, method=method,
                                 calibration=calibration, mode=mode,
                                 filter_fn=lambda name, m: (type(m) is nn.Linear or is_fused_experts(m))
                                 and name not in keep)
    return set(summary.converted)


def _output_head(model: nn.Module) -> str | None:
    """The module name of the model's output head (transformers' get_output_embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, m in model.named_modules() if head is not None and m is head), None)


_LOSSLESS_CASTS = {("F16", torch.float32), ("BF16", torch.float32), ("F32", torch.float32), ("F16", torch.float16),
                   ("BF16", torch.bfloat16)}


def _why_float(name: str, m: nn.Module, src: str, output_format: str, requantize: str | None, head: str | None,
               group_size: int, kept_exact: str | None = None) -> str:
    """Why a GGUF-quantized layer was written as float. kept_exact: of MoE experts, the one projection
    with an exact affine form, which --requantize rest would keep."""
    if output_format == "transformers":
        if isinstance(m, nn.Embedding):
            if src in {type_name(t) for t in _EXACT_TYPES}:
                return (f"--requantize all leaves the embedding float in the transformers format; without "
                        f"--requantize it stays {src}, exact")
            return ("no exact affine form, and the transformers format quantizes no float embedding: --format mlx "
                    "--requantize rest quantizes it")
        if name == head:
            if src in {type_name(t) for t in _EXACT_TYPES}:
                return (f"--requantize all leaves the output head float in the transformers format; without "
                        f"--requantize it stays {src}, exact")
            return ("no exact affine form, and the transformers format quantizes no output head; --format mlx "
                    "--requantize rest does")
    if requantize:
        width = m.embedding_dim if isinstance(m, nn.Embedding) else getattr(m, "in_features", None)
        if width is not None and width % group_size:
            return f"its {width} inputs are not a multiple of --group-size {group_size}"
        return "left float by quantize_model (its warning says why)"
    if kept_exact is not None:
        other = "down_proj" if kept_exact == "gate_up_proj" else "gate_up_proj"
        return f"its {other} has no exact affine form: --requantize rest re-quantizes {other} alone, {kept_exact} stays exact"
    return "no exact affine form: --requantize rest quantizes it"


def _why_embedding_float(m: nn.Embedding, src: str, output_format: str, requantize: str | None,
                         group_size: int) -> str:
    """Why an embedding float in the source (src "float", or a GGUF file's F32 / F16 / BF16) was
    written float."""
    gguf = src != "float"
    if output_format == "transformers":
        return (f"the transformers format quantizes no float embedding; --format mlx"
                f"{' --requantize rest' if gguf else ''} does")
    if not replaceable_embedding(m):
        return f"a {type(m).__name__}, whose forward a quantized embedding would not do"
    if m.max_norm is not None:
        return f"max_norm={m.max_norm}: its rows are renormalized when read"
    if m.embedding_dim % group_size:
        return f"its {m.embedding_dim} inputs are not a multiple of --group-size {group_size}"
    return "--requantize rest quantizes it" if gguf and not requantize else "left float"


def _format_name(mode: str, bits, group_size: int) -> str:
    """A format as the report and the errors show it ("affine b4 gs64")."""
    return f"{mode} b{bits} gs{group_size}"


def _quant_format(m: nn.Module) -> str:
    """The format of a quantized layer ("affine b4 gs64"); the experts of a MoE block by their
    gate_up_proj's, and down_proj's too where it differs."""
    if isinstance(m, QuantFusedExperts):
        gate_up, down = _quant_format(m.gate_up_proj), _quant_format(m.down_proj)
        return gate_up if gate_up == down else f"gate_up_proj {gate_up}, down_proj {down}"
    return _format_name(m.mode, m.bits, m.group_size)


def _quantized_source(src: Path):
    """The TorchQmmConfig of a transformers folder torch_qmm quantized (its config.json's
    quantization_config), or None for any other folder."""
    from .json_files import read_json_object
    from .transformers import QUANT_METHOD, TorchQmmConfig

    path = src / "config.json"
    q = read_json_object(path).get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return None
    try:
        return TorchQmmConfig.from_dict(q)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: 'quantization_config' does not describe a torch_qmm format: {e}") from None


def _source_format(source) -> str:
    """The format of a folder torch_qmm quantized, from its TorchQmmConfig, as the errors show it
    ("affine b8 gs32"; "affine bits [4, 8] per layer gs64" where the bits differ between layers)."""
    if type(source.bits) is int:
        return _format_name(source.mode, source.bits, source.group_size)
    return f"{source.mode} bits {sorted(set(source.bits.values()))} per layer gs{source.group_size}"


def quantized_format(src: Path) -> str | None:
    """The format of a transformers folder torch_qmm quantized (`_source_format`), or None for any
    other folder."""
    source = _quantized_source(src)
    return None if source is None else _source_format(source)


def _keep_source_format(args: argparse.Namespace, source) -> None:
    """A folder torch_qmm quantized keeps the format of its quantized layers: they are not
    re-quantized (quantize_model refuses that too: it would compound the rounding). --mode /
    --bits / --group-size default to that format, and the layers this run quantizes (those float in
    the folder: the MLX format's embedding and output head) take it; a flag asking for another
    format, or a --method for float weights, is a UsageError naming the folder and both formats.
    Sets args.mode, args.bits and args.group_size."""
    per_layer = type(source.bits) is not int
    has = _source_format(source)
    asked = [f"{flag} {given}" for flag, given, own in (("--mode", args.mode, source.mode),
                                                        ("--bits", args.bits, None if per_layer else source.bits),
                                                        ("--group-size", args.group_size, source.group_size))
             if given is not None and given != own]
    if asked:
        raise UsageError(f"{args.src} is already quantized by torch_qmm ({has}); {' '.join(asked)} asks for "
                         f"another format, and convert does not re-quantize quantized layers (the rounding would "
                         f"compound). Convert the float model instead, or leave out {', '.join(a.split()[0] for a in asked)} "
                         "to keep the folder's format")
    if args.method != "rtn" or args.calibration is not None:
        raise UsageError(f"--method {args.method}{' --calibration' if args.calibration else ''} quantizes float "
                         f"weights; {args.src} is already quantized by torch_qmm ({has}) and keeps its layers as "
                         "they are: convert the float model instead")
    args.mode, args.group_size = source.mode, source.group_size
    args.bits = None if per_layer else source.bits


def _source_layers(model: nn.Module, src: Path) -> tuple[dict[str, str], dict[str, bool]]:
    """({module: format} of the quantized layers loaded from a folder torch_qmm quantized,
    {module: whether their scales and biases were loaded without rounding (a --dtype cast)})."""
    from .safetensors_io import Checkpoint
    from .transformers import stored_key

    ckpt = Checkpoint(src)
    stored = stored_key(model, ckpt)
    origin, exact = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, QuantEmbedding, QuantFusedExperts)):
            origin[name] = _quant_format(m)
            layers = ({f"{name}.{p}": getattr(m, p) for p in ("gate_up_proj", "down_proj")}
                      if isinstance(m, QuantFusedExperts) else {name: m})
            exact[name] = all(layer.scales.dtype == torch.uint8  # the fp modes' scale codes, never cast
                              or (ckpt.dtype_name(stored(f"{key}.scales", required=True)),
                                  layer.scales.dtype) in _LOSSLESS_CASTS
                              for key, layer in layers.items())
    return origin, exact


def _layer_report(model: nn.Module, origin: dict[str, str], quantized_now: set[str], exact: dict[str, bool],
                  output_format: str, requantize: str | None = None,
                  group_size: int = 64, requantized: dict[str, str] | None = None,
                  exact_projections: set[str] = frozenset()) -> list[tuple[str, str]]:
    """[(module name, what happened)] for every linear layer, fused experts module (of a MoE block)
    and embedding of the written model.
    exact: {quantized module: whether its scales/biases survived the --dtype}; quantized_now: the
    layers this run quantized; requantized: {experts: the one projection this run re-quantized};
    exact_projections: "experts.gate_up_proj" / "experts.down_proj" of the GGUF file's MoE blocks
    that have an exact affine form (_exact_linears)."""
    requantized = requantized or {}
    rows = []
    head = _output_head(model)
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, m in model.named_modules():
        src = origin.get(name, "float")
        if isinstance(m, TiedQuantLinear):
            fmt = f"tied to the embedding ({_quant_format(m._embedding)})"
        elif isinstance(m, (QuantLinear, QuantEmbedding, QuantFusedExperts)):
            fmt = _quant_format(m)
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            fmt = f"float {str(m.weight.dtype)[6:]}"
        elif is_fused_experts(m):
            fmt = f"float {str(m.get_parameter(layout_of(m).gate_up).dtype)[6:]}"
        elif is_conv1d(m):
            rows.append((name, f"kept float {str(m.weight.dtype)[6:]} ({CONV1D_NOT_CONVERTED})"))
            continue
        else:
            continue
        if isinstance(m, TiedQuantLinear):
            how = fmt
        elif type(m) is nn.Linear and id(m.weight) in embedding_weights:
            how = f"tied to the embedding ({fmt})"
        elif name in requantized:  # one projection re-quantized, the other as the file holds it
            proj = requantized[name]
            kept = next(p for p in ("gate_up_proj", "down_proj") if p != proj)
            if exact.get(name, True):
                how = f"re-quantized {proj} of {src} -> {fmt} ({kept} lossless; {proj}: no exact affine form)"
            else:
                how = (f"{src} scales rounded to {str(getattr(m, kept).scales.dtype)[6:]} in {kept}, {proj} re-quantized "
                       f"(no exact affine form) -> {fmt}")
        elif name in quantized_now:
            how = f"{'re-quantized' if src != 'float' else 'quantized'} {src} -> {fmt}"
        elif isinstance(m, (QuantLinear, QuantEmbedding, QuantFusedExperts)):
            scales = (m.down_proj if isinstance(m, QuantFusedExperts) else m).scales
            how = (f"lossless {src} -> {fmt}" if exact.get(name, True)
                   else f"{src} scales rounded to {str(scales.dtype)[6:]} -> {fmt}")
        elif src in ("float", "F32", "F16", "BF16"):
            how = f"kept {fmt}" if src == "float" else f"kept {src} -> {fmt}"
            width = m.embedding_dim if isinstance(m, nn.Embedding) else getattr(m, "in_features", None)
            if src != "float" and (src, m.weight.dtype) not in _LOSSLESS_CASTS:
                how += f" (rounded to {str(m.weight.dtype)[6:]})"
            if isinstance(m, nn.Embedding):
                how += f" ({_why_embedding_float(m, src, output_format, requantize, group_size)})"
            elif src == "float" and width is not None and width % group_size:
                how += f" (its {width} inputs are not a multiple of --group-size {group_size})"
        else:
            weight = m.get_parameter(layout_of(m).gate_up) if is_fused_experts(m) else m.weight
            decoded = "as gguf decodes it" if weight.dtype == torch.float32 else f"rounded to {str(weight.dtype)[6:]}"
            kept = [p for p in ("gate_up_proj", "down_proj") if f"{name}.{p}" in exact_projections]
            why = _why_float(name, m, src, output_format, requantize, head, group_size,
                             kept[0] if len(kept) == 1 else None)
            how = f"decoded {src} -> {fmt} ({decoded}; {why})"
        rows.append((name, how))
    return rows


def _rounded_scales(how: str) -> bool:
    return " scales rounded to " in how.split(" -> ")[0]


def _print_report(rows: list[tuple[str, str]]) -> None:
    width = max([len(n) for n, _ in rows] + [5])
    for name, how in rows:
        print(f"  {name:<{width}}  {how}")
    counts: dict[str, int] = {}
    for _, how in rows:
        kind = "rounded" if _rounded_scales(how) else how.split(" ")[0]
        counts[kind] = counts.get(kind, 0) + 1
    print("layers: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    rounded = ", ".join(sorted({how.split(" ")[0] for _, how in rows if _rounded_scales(how)}))
    if rounded:
        print(f"  ({rounded} scales/biases rounded to the --dtype: use --dtype float32 for exact {rounded} layers)")


def _quantizer_flags(args: argparse.Namespace) -> list[str]:
    """The options given that only quantizing uses (for a GGUF source: only with --requantize)."""
    return [f for f, given in (("--mode", args.mode != "affine"), ("--bits", args.bits is not None),
                               ("--group-size", args.group_size is not None), ("--method", args.method != "rtn"),
                               ("--calibration", args.calibration is not None)) if given]


def _check_arguments(args: argparse.Namespace, is_gguf: bool) -> None:
    try:
        resolve_format(args.mode, args.bits, args.group_size)
    except ValueError as e:
        raise UsageError(str(e).replace("argument 'bits'", "--bits").replace("argument 'group_size'", "--group-size")
                         .replace("(mode ", "(--mode ")) from None
    if args.mode != "affine" and args.method != "rtn":
        raise UsageError(f"--method {args.method} writes the affine format; --mode {args.mode} is quantized with "
                         "--method rtn")
    if not is_gguf:
        if args.requantize:
            raise UsageError(f"--requantize applies to GGUF sources only; {args.src} is a float transformers folder, "
                             "which is always quantized with --bits/--group-size")
        return
    flags = _quantizer_flags(args)
    if flags and not args.requantize:
        verb = "apply" if len(flags) > 1 else "applies"
        raise UsageError(f"{' and '.join(flags)} {verb} only to re-quantization: {args.src} keeps its own formats "
                         "(lossless) unless --requantize rest|all is given")


def _rest_group_size(args: argparse.Namespace, f: GGUFFile, group_size: int) -> int:
    """The group size --requantize rest quantizes with for the transformers format: one
    quantization_config holds one group size and mode, so where the file has layers kept exact
    (affine, group size 32) the others join them (--group-size defaults to 32 there); another
    --group-size or --mode is a UsageError."""
    exact = _exact_linears(f)
    if not exact:
        return group_size
    if args.mode == "affine" and args.group_size in (None, 32):
        return 32
    asked, fix = ((f"--group-size {args.group_size}", "--group-size 32 (the default here)") if args.mode == "affine"
                  else (f"--mode {args.mode}", "--mode affine"))
    types = ", ".join(sorted(set(exact.values())))
    raise UsageError(f"{args.src}: --requantize rest keeps {len(exact)} layers exact ({types}: affine, group size 32) "
                     f"and a transformers folder's quantization_config holds one group size and mode for all "
                     f"quantized layers, so {asked} cannot join them. Pass {fix}, or --requantize all to "
                     "re-quantize every layer, or --format mlx, which holds both")


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
    _check_causal_lm(src, config.get("architectures"))
    qc = config.get("quantization_config")
    if isinstance(config.get("quantization"), dict) or (isinstance(qc, dict) and "quant_method" not in qc):
        # mlx_lm's "quantization" entry (also written as a quantization_config without quant_method,
        # which transformers refuses with an error about the config, not the folder's kind).
        raise ValueError(f"{src} is an MLX folder (config.json has MLX's 'quantization' entry): convert reads "
                         "float transformers folders, folders torch_qmm quantized and GGUF files. Load an MLX "
                         "folder into a torch model with torch_qmm.interop.load_mlx")
    if not any(src.glob("*.safetensors")):
        pickled = sorted(f.name for f in src.iterdir() if f.name.endswith((".bin", ".pt", ".pth", ".ckpt")))
        found = f"only {', '.join(pickled)}: pickle, which convert does not load" if pickled else "none at all"
        raise ValueError(f"{src}: no .safetensors weights ({found}); convert reads safetensors only: save the model "
                         "with save_pretrained first")
    Checkpoint(src)


def _check_causal_lm(src: Path, architectures) -> None:
    """convert builds the folder's model as AutoModelForCausalLM does: a folder whose config.json
    names only architectures of another head (a classifier, a bare encoder, a masked LM) would lose
    its own head and gain a random one, so it is refused. A config without the field, or naming a
    causal LM or an architecture of none of those heads (a multimodal *ForConditionalGeneration,
    whose language model AutoModelForCausalLM builds), is taken as it is."""
    from transformers.models.auto import modeling_auto as auto

    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"{src / 'config.json'}: field 'architectures' must be a list of class names, got "
                         f"{architectures!r}")

    def names(mapping) -> set[str]:
        return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}

    causal = names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    other_heads = set().union(*(names(getattr(auto, m)) for m in (
        "MODEL_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES")
        if hasattr(auto, m))) - causal
    if architectures and all(a in other_heads for a in architectures):
        raise ValueError(f"{src / 'config.json'}: convert reads causal language models (AutoModelForCausalLM), "
                         f"this folder holds {', '.join(architectures)}: its own head would be dropped and a "
                         "random one written. Quantize such a model in Python with torch_qmm.quantize_model")


def from_pretrained(path: Path, **kwargs):
    """AutoModelForCausalLM.from_pretrained, its errors as ValueErrors naming the folder. A folder
    torch_qmm quantized loads its quantized layers: importing .transformers registers quant_method
    "torch_qmm" (without it transformers would initialise those layers at random)."""
    from transformers import AutoModelForCausalLM

    from . import transformers as _  # noqa: F401

    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, ZeroDivisionError) as e:
        what = ("quantizing the model while loading it failed" if _raised_by_torch_qmm(e) else
                "transformers could not build the model from its config/weights")
        raise ValueError(f"{path}: {what}: {type(e).__name__}: {' '.join(str(e).split())[:400]}") from e


def _raised_by_torch_qmm(error: BaseException) -> bool:
    """Whether the innermost frame of `error`'s traceback is torch_qmm's own code (its quantizers,
    called by transformers while loading), not transformers' or torch's."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)


_PACKAGE = Path(__file__).resolve().parent.parent


def run(args: argparse.Namespace) -> int:
    from .transformers import TorchQmmConfig, record_quantization_config

    src: Path = args.src
    if not src.exists():
        raise UsageError(f"source {src} does not exist")
    is_gguf = src.is_file() and src.suffix == ".gguf"
    if not is_gguf and not (src.is_dir() and (src / "config.json").is_file()):
        raise UsageError(f"source {src} is neither a .gguf file nor a transformers folder with config.json")
    source = None if is_gguf else _quantized_source(src)
    if source is not None:
        _keep_source_format(args, source)
    args.mode = args.mode or "affine"
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
    if is_gguf and args.format == "transformers" and args.requantize == "rest":
        group_size = _rest_group_size(args, gguf, group_size)
    with staged_output(args.dst) as out:
        origin: dict[str, str] = {}
        exact: dict[str, bool] = {}
        quantized_now: set[str] = set()
        requantized: dict[str, str] = {}  # MoE experts of which one projection alone was re-quantized
        # A MoE block's projection is re-quantized alone as quantize_model quantizes experts: by
        # rtn with one bit width (it leaves them float under another method or a calibration).
        per_layer = quantizers.resolve(args.method).kind != "rtn" or calibration is not None
        rest = (bits, group_size, args.mode) if args.requantize == "rest" and not per_layer else None
        if args.format == "mlx":
            from .mlx import save_mlx

            if is_gguf:
                model, exact, origin, requantized = _load_gguf(gguf, dtype or torch.float32,
                                                               keep_affine=args.requantize != "all", rest=rest)
            else:
                model = from_pretrained(src, dtype=dtype or "auto")
                if source is not None:
                    origin, exact = _source_layers(model, src)
            if not is_gguf or args.requantize:
                quantized_now = _quantize_for_mlx(model, bits, group_size, args.method, calibration, args.mode)
            save_mlx(model, out, config=model.config.to_dict())
        elif is_gguf and args.requantize != "all":
            # The exact layers as they are (the embedding too, a tied head reading it); --requantize
            # rest quantizes the float linear layers but the head.
            model, exact, origin, requantized = _load_gguf(gguf, dtype or torch.float32, keep_affine=True, rest=rest)
            model.config.tie_word_embeddings = bool(model.config.tie_word_embeddings)
            if args.requantize == "rest":
                quantized_now = _quantize_float_layers(model, bits, group_size, args.method, calibration, args.mode,
                                                       keep={_output_head(model)})
            why_not = record_quantization_config(model)
            if why_not is not None:
                raise ValueError(f"{src}: a transformers quantization_config cannot describe the converted layers: "
                                 f"{why_not}; convert with --format mlx")
            model.save_pretrained(out)
        else:
            cfg = TorchQmmConfig(bits=bits, group_size=group_size, method=args.method, calibration=calibration,
                                 mode=args.mode)
            if is_gguf:
                model, _, origin, _ = _load_gguf(gguf, dtype or torch.float32, keep_affine=False)
                model.config.tie_word_embeddings = bool(model.config.tie_word_embeddings)
                staging = out / ".float"  # inside this run's temporary folder; removed below
                model.save_pretrained(staging)
                model = from_pretrained(staging, quantization_config=cfg, dtype=dtype or "auto")
                shutil.rmtree(staging)
            elif source is not None:  # its layers as they are (the folder's config rebuilds them)
                model = from_pretrained(src, dtype=dtype or "auto")
                origin, exact = _source_layers(model, src)
            else:
                model = from_pretrained(src, quantization_config=cfg, dtype=dtype or "auto")
            if source is None:
                quantized_now = {n for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantFusedExperts))}
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
        rows = _layer_report(model, origin, quantized_now, exact, args.format, args.requantize if is_gguf else None,
                             group_size, requantized, set(_exact_linears(gguf)) if is_gguf else set())
    _print_report(rows)
    if is_gguf and args.requantize == "rest" and not quantized_now and not requantized:
        unused = _quantizer_flags(args)
        print("--requantize rest re-quantized no layer" + (f": {', '.join(unused)} went unused" if unused else ""))
    formats = sorted({how.split(" -> ")[-1].split(" (")[0] if " -> " in how
                      else how.split(" (")[0] if how.startswith("kept ") else how
                      for _, how in rows})
    print(f"wrote {args.dst} ({args.format}): {len(rows)} layers; formats: {'; '.join(formats)}")
    return 0

