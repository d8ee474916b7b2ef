"""Model-level benchmark: a small Llama-style transformer built from a config (no downloads), or a
transformers causal-LM folder on disk (`--model PATH`, loaded locally with from_pretrained).

Reports forward time at M=1 (decode) and M=128 (prefill) tokens, weight memory before and after
`quantize_model`, and the output error of the quantized model against the float model.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..convert import quantize_model
from ..devices import median_ms


@dataclasses.dataclass
class ModelConfig:
    dim: int = 2048
    hidden: int = 5632
    layers: int = 4
    heads: int = 16
    vocab: int = 8192


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.norm1, self.norm2 = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class TinyTransformer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


class _LogitsOnly(nn.Module):
    """A transformers causal LM called like TinyTransformer: token ids -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def build_model(spec: str | None) -> tuple[nn.Module, int, dict]:
    """(model, vocabulary size, description) for `spec`: "tiny"/None, a JSON config file of
    ModelConfig fields, or a transformers model folder (config.json + weights) of float weights:
    the benchmark compares the float model with its quantized copy, so a folder torch_qmm
    quantized, which has no float reference, is a UsageError."""
    if spec and Path(spec).is_dir():
        from ..interop.cli_convert import from_pretrained, quantized_format  # optional: the `transformers` extra

        from ..cli_errors import UsageError

        expects = ("the model benchmark compares a float model with its quantized copy and expects a float "
                   "transformers folder (such as the one it was converted from) or a JSON file of ModelConfig fields")
        if (Path(spec) / "config.json").is_file() and (fmt := quantized_format(Path(spec))):
            raise UsageError(f"argument --model: {spec} is a transformers folder quantized by torch_qmm ({fmt}); "
                             + expects)
        if (Path(spec) / "config.json").is_file() and _mlx_quantized(Path(spec) / "config.json"):
            raise UsageError(f"argument --model: {spec} is an MLX folder quantized by mlx_lm (its config.json has "
                             f"'quantization'); {expects}")
        model = from_pretrained(Path(spec))
        return _LogitsOnly(model), model.config.vocab_size, {"path": str(spec), "type": model.config.model_type}
    if spec and Path(spec).suffix == ".gguf":  # as convert tells a GGUF source
        from ..cli_errors import UsageError

        raise UsageError(f"argument --model: {spec} is a GGUF file, whose weights are quantized: the model benchmark "
                         "compares a float model with its quantized copy and expects 'tiny', a JSON file of "
                         "ModelConfig fields or a float transformers folder")
    cfg = load_config(spec)
    torch.manual_seed(0)
    return TinyTransformer(cfg), cfg.vocab, dataclasses.asdict(cfg)


def _mlx_quantized(config_json: Path) -> bool:
    """Whether a config.json is mlx_lm's for quantized weights: a "quantization" entry, or a
    "quantization_config" without transformers' "quant_method"."""
    from ..interop.json_files import read_json_object

    config = read_json_object(config_json)
    qc = config.get("quantization_config")
    return isinstance(config.get("quantization"), dict) or (isinstance(qc, dict) and "quant_method" not in qc)


def load_config(spec: str | None) -> ModelConfig:
    """`None`/"tiny": the default; a path to a JSON file with ModelConfig fields otherwise."""
    if spec in (None, "", "tiny"):
        return ModelConfig()
    from ..cli_errors import UsageError
    from ..interop.json_files import read_json_object

    if not Path(spec).is_file():
        raise UsageError(f"argument --model: {spec} is not 'tiny', a JSON file or a model folder")
    fields = read_json_object(spec)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{spec}: unknown ModelConfig fields {unknown} (expected some of {sorted(known)})")
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{spec}: field {name!r} must be a positive integer, got {value!r}")
    cfg = ModelConfig(**fields)
    if cfg.dim % cfg.heads:
        raise ValueError(f"{spec}: field 'dim' = {cfg.dim} must be a multiple of 'heads' = {cfg.heads}")
    return cfg


def _bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def run_model(spec: str | None, device: str, dtype: torch.dtype, bits: int, group_size: int, repeats: int,
              tokens: tuple[int, ...] = (1, 128)) -> dict:
    model, vocab, description = build_model(spec)
    model = model.to(device=device, dtype=dtype).eval()
    quantized = copy.deepcopy(model)
    bytes_before = _bytes(model)
    summary = quantize_model(quantized, bits=bits, group_size=group_size, progress=False)
    bytes_after = _bytes(quantized)
    out = {"config": description, "device": device, "dtype": str(dtype)[6:], "bits": bits,
           "group_size": group_size, "bytes_before": bytes_before, "bytes_after": bytes_after,
           "layers_quantized": len(summary.converted), "by_tokens": {}}
    with torch.no_grad():
        for m in tokens:
            ids = torch.randint(0, vocab, (1, m), device=device)
            y_ref = model(ids).double()
            y = quantized(ids).double()
            out["by_tokens"][m] = {
                "float_ms": median_ms(lambda: model(ids), device, repeats, warmup=1),
                "quantized_ms": median_ms(lambda: quantized(ids), device, repeats, warmup=1),
                "rel_error": ((y - y_ref).norm() / y_ref.norm()).item(),
            }
    return out


def format_model(r: dict) -> str:
    lines = [f"model {r['config']} on {r['device']}, {r['dtype']}, {r['bits']}-bit, group size {r['group_size']}",
             f"  weights: {r['bytes_before'] / 2**20:.1f} MiB -> {r['bytes_after'] / 2**20:.1f} MiB "
             f"({r['layers_quantized']} linear layers quantized)"]
    for m, t in r["by_tokens"].items():
        lines.append(f"  M={m:>4}: float {t['float_ms']:.2f} ms, quantized {t['quantized_ms']:.2f} ms "
                     f"({t['float_ms'] / t['quantized_ms']:.2f}x), relative output error {t['rel_error']:.4f}")
    lines.append("  (relative output error: ||y_q - y|| / ||y|| of the quantized model's logits y_q against the "
                 f"same model unquantized in {r['dtype']}, one random token sequence, in float64)")
    return "\n".join(lines)
