"""Per-layer bits: an explicit mapping, or an average-bits budget spent where it helps most.

The budget follows the design of MLX-LM's dynamic quantization (mlx_lm.quant.dynamic_quant): two
bit widths, every layer starts at the low one, and the layers with the largest measured
sensitivity per parameter get the high one until the parameter-weighted average reaches the
target. MLX-LM measures sensitivity with gradients of the KL divergence; here it is the drop in the
layer's own relative output error, tr(D H D^T) / tr(W H W^T) on the calibration inputs (relative
weight error |D|^2 / |W|^2 without calibration), between round-to-nearest at the two widths.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..formats import SUPPORTED_BITS, check_format
from . import calibration as cal
from .affine import decode, output_error, rtn, weight_error


@dataclass(frozen=True)
class MixedBits:
    """An average-bits budget: `average` code bits per weight (weighted by parameter count; the
    scales and biases come on top), spent between `low` and `high` bits. None: the supported widths
    just below and above `average`."""

    average: float
    low: int | None = None
    high: int | None = None

    def __post_init__(self) -> None:
        # A config.json read back (TorchQmmConfig's mixed_bits) may hold any JSON value here.
        if isinstance(self.average, bool) or not isinstance(self.average, numbers.Real):
            raise TypeError(f"argument 'bits': MixedBits average must be a number of bits, got {self.average!r}")
        for name in ("low", "high"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise TypeError(f"argument 'bits': MixedBits {name} must be an integer number of bits or None, "
                                f"got {value!r}")

    def widths(self) -> tuple[int, int]:
        low = self.low if self.low is not None else max((b for b in SUPPORTED_BITS if b <= self.average), default=None)
        high = self.high if self.high is not None else min((b for b in SUPPORTED_BITS if b > self.average), default=None)
        if low is None or high is None:
            raise ValueError(f"argument 'bits': an average of {self.average} bits is outside the supported widths "
                             f"{SUPPORTED_BITS} (no width below and above it)")
        for b in (low, high):
            if b not in SUPPORTED_BITS:
                raise ValueError(f"argument 'bits': MixedBits widths must be in {SUPPORTED_BITS}, got {b}")
        if not low < high:
            raise ValueError(f"argument 'bits': MixedBits needs low < high, got low={low}, high={high}")
        if not low <= self.average <= high:
            raise ValueError(f"argument 'bits': the budget of {self.average} average bits cannot be met with "
                             f"widths {low} and {high} (it must lie between them)")
        return low, high


def from_mapping(bits: Mapping[str, int], names: list[str]) -> dict[str, int]:
    """name -> bits for every layer; the key "*" (optional) gives the bits of unnamed layers."""
    default = bits.get("*")
    unknown = sorted(set(bits) - set(names) - {"*"})
    if unknown:
        raise ValueError(f"argument 'bits' names layers that are not quantized here: {unknown[:5]}"
                         + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
                         + f"; quantized layers are e.g. {names[:3]}")
    out = {}
    for n in names:
        b = bits.get(n, default)
        if b is None:
            raise ValueError(f"argument 'bits' gives no bits for layer {n!r} (add it, or a default under '*')")
        check_format(b, 32)
        out[n] = int(b)
    return out


def relative_errors(layers: dict[str, nn.Linear], widths: tuple[int, ...], group_size: int, dtype_of,
                    hessians: dict[str, torch.Tensor] | None) -> dict[str, tuple[float, ...]]:
    """Relative (output, or weight when hessians is None) error of RTN per layer and width."""
    out = {}
    for name, layer in layers.items():
        w = layer.weight.detach().float()
        h = None if hessians is None else hessians[name]
        ref = float((w.double() ** 2).sum()) if h is None else output_error(w, torch.zeros_like(w), h)
        errs = []
        for b in widths:
            w_hat = decode(*rtn(w, b, group_size, dtype_of(layer)), group_size)
            e = weight_error(w, w_hat) if h is None else output_error(w, w_hat, h)
            errs.append(e / ref if ref > 0 else 0.0)
        out[name] = tuple(errs)
    return out


def sensitivities(model: nn.Module, layers: dict[str, nn.Linear], low: int, high: int, group_size: int,
                  dtype_of, data: list | None) -> dict[str, tuple[float, float]]:
    """name -> (relative error at low, at high), on the float model."""
    if data is None:
        return relative_errors(layers, (low, high), group_size, dtype_of, None)
    out: dict[str, tuple[float, float]] = {}

    def measure(stats: cal.InputStats, mine: dict[str, nn.Linear]) -> None:
        h = {n: stats.of(n)[0] for n in mine}
        out.update(relative_errors(mine, (low, high), group_size, dtype_of, h))

    cal.walk(model, layers, data,
             lambda block, _prefix, inputs, mine: measure(cal.collect(block, inputs, mine), mine),
             lambda rest: measure(cal.collect_model(model, data, rest), rest))
    return out


def assign(budget: MixedBits, layers: dict[str, nn.Linear], sens: dict[str, tuple[float, float]]) -> dict[str, int]:
    """Bits per layer: `low` everywhere, then `high` by decreasing error drop per parameter while the
    parameter-weighted average stays within the budget."""
    low, high = budget.widths()
    sizes = {n: layers[n].weight.numel() for n in layers}
    total = sum(sizes.values())
    allowance = (budget.average - low) * total  # bit-parameters left to spend
    out = {n: low for n in layers}
    order = sorted(layers, key=lambda n: (sens[n][0] - sens[n][1]) / sizes[n], reverse=True)
    for n in order:
        cost = (high - low) * sizes[n]
        if cost <= allowance + 1e-9:
            out[n] = high
            allowance -= cost
    return out


# Layers that MLX-LM's mixed recipes (mlx_lm convert --quant-predicate mixed_3_4 / mixed_3_6 / ...)
# give the high width in the blocks that get more bits.
RECIPE_HIGH_LAYERS = ("v_proj", "down_proj")


def recipe(names: list[str], low: int, high: int) -> dict[str, int]:
    """MLX-LM's fixed mixed recipe as a bits mapping: v_proj and down_proj get `high` bits in block
    i of n when i < n // 8, i >= 7n // 8 or (i - n // 8) % 3 == 2 (the first and last eighth of the
    blocks and every third block between, after llama.cpp's Q4_K_M choices); every other layer gets
    `low`; an output head named lm_head gets `high`. The block index is a name's first all-digit component (model.layers.<i>.mlp.down_proj)."""
    check_format(low, 32)
    check_format(high, 32)

    def block(name: str) -> int | None:
        return next((int(p) for p in name.split(".") if p.isdigit()), None)

    indices = [i for i in map(block, names) if i is not None]
    if not indices:
        raise ValueError(f"a mixed recipe needs layers inside numbered blocks, got e.g. {names[:3]}")
    n = max(indices) + 1
    out = {}
    for name in names:
        i = block(name)
        leaf = name.rpartition(".")[2]
        more = i is not None and (i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2)
        out[name] = high if (more and leaf in RECIPE_HIGH_LAYERS) or leaf == "lm_head" else low
    return out


def average_bits(bits: Mapping[str, int], layers: Mapping[str, nn.Linear]) -> float:
    """The parameter-weighted average code bits of a bits mapping."""
    sizes = {n: layers[n].weight.numel() for n in bits}
    return sum(bits[n] * sizes[n] for n in bits) / sum(sizes.values())
