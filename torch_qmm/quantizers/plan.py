"""Which bits each layer gets and what the chosen method writes, for quantize_model.

Data-free methods (rtn, mse) quantize each layer when quantize_model swaps it. Calibrated methods
(awq, gptq) walk the model block by block first (calibration.walk): each block's layers are
quantized and their weights replaced by the dequantized values, so the next block is calibrated
on the outputs of the quantized model. Once the walk has run a block for the last time, its
layers are replaced in the model by `Dequantized` stand-ins that hold only the packed result, so
the float weights of the blocks that are done are freed (when nothing else holds them) while the
walk goes on: the pass holds the model, one block's statistics and block inputs, and never a
float and a packed copy of the whole model at once. quantize_model swaps the stand-ins for
QuantLinear at the end.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..formats import check_format
from ..nn import QuantLinear
from ..ops import dequantize
from . import awq, calibration as cal, gptq, mixed, mse
from .affine import rtn as rtn_codes
from .methods import AWQ, GPTQ, resolve

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Dequantized(nn.Module):
    """Stand-in for a float linear layer whose packed triple exists: its forward is F.linear with
    the triple dequantized to the layer's weight dtype, bit for bit what the float layer computes
    with that weight written back, while it holds only the packed triple (and the float bias)."""

    def __init__(self, layer: nn.Linear, triple: Triple, bits: int, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bits, self.group_size = bits, group_size
        self.weight_dtype = layer.weight.dtype
        self.triple = triple
        self.bias = layer.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, computed at each access (nothing float is held)."""
        return dequantize(*self.triple, group_size=self.group_size, bits=self.bits).to(self.weight_dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Plan:
    """Builds the QuantLinear of each layer (quantize_model calls `build`)."""

    def __init__(self, method: str, bits: dict[str, int], group_size: int, dtype: torch.dtype | None,
                 aliases: dict[str, list[str]] | None = None) -> None:
        self.method = method
        self.bits = bits
        self.group_size = group_size
        self.dtype = dtype
        self.done: dict[str, Triple] = {}  # results of the calibrated pass, by layer name
        self.aliases = aliases or {}  # layer name -> every name it is registered under

    def dtype_of(self, layer: nn.Module) -> torch.dtype:
        return self.dtype or (layer.weight_dtype if isinstance(layer, Dequantized) else layer.weight.dtype)

    def triple(self, name: str, layer: nn.Module) -> Triple:
        if isinstance(layer, Dequantized):
            return layer.triple
        if name in self.done:
            return self.done.pop(name)
        bits, dtype = self.bits[name], self.dtype_of(layer)
        if self.method == "mse":
            return mse.quantize(layer.weight, bits, self.group_size, dtype)
        from ..ops import quantize

        return quantize(layer.weight.detach().to(dtype), group_size=self.group_size, bits=bits)

    def build(self, name: str, layer: nn.Module) -> QuantLinear:
        """The QuantLinear of a layer: the float nn.Linear, or its Dequantized stand-in."""
        wq, scales, biases = self.triple(name, layer)
        dtype = self.dtype_of(layer)
        q = QuantLinear(layer.in_features, layer.out_features, bias=layer.bias is not None, bits=self.bits[name],
                        group_size=self.group_size, device=wq.device, dtype=dtype)
        with torch.no_grad():
            q.qweight.copy_(wq)
            q.scales.copy_(scales)
            q.biases.copy_(biases)
            if layer.bias is not None:
                q.bias.copy_(layer.bias.detach().to(dtype))
        return q

    def store(self, name: str, layer: nn.Linear, result: Triple, write_back: bool = True) -> None:
        """Keeps the result; write_back puts its dequantized weights in the float layer (for the
        blocks that run next; never for layers outside the blocks, whose weight may be tied)."""
        self.done[name] = result
        # The layer's temporaries are freed: hand them back now, so that the next layer's work
        # starts from the held state instead of on top of this one's freed heap.
        cal.release_freed_memory()
        if not write_back:
            return
        with torch.no_grad():
            layer.weight.copy_(dequantize(*result, group_size=self.group_size, bits=self.bits[name]).to(layer.weight.dtype))

    def retire(self, model: nn.Module, layers: dict[str, nn.Linear]) -> None:
        """Replaces each of `layers` whose result is stored by its Dequantized stand-in, under every
        name it is registered at (calibration.walk's after_block: the walk no longer runs them), so
        that its float weight can be freed."""
        for name, layer in layers.items():
            if name not in self.done or not isinstance(layer, nn.Linear):
                continue
            stand_in = Dequantized(layer, self.done.pop(name), self.bits[name], self.group_size)
            for alias in self.aliases.get(name, [name]):
                parent_name, _, child = alias.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, stand_in)
        layers.clear()
        cal.release_freed_memory()


def _bits(bits, group_size: int, layers: dict[str, nn.Linear]) -> dict[str, int] | mixed.MixedBits:
    if isinstance(bits, bool):
        raise TypeError(f"argument 'bits' must be an int, a mapping name -> bits or MixedBits, got {bits!r}")
    if isinstance(bits, int):
        check_format(bits, group_size)
        return {n: bits for n in layers}
    if isinstance(bits, float):
        bits = mixed.MixedBits(bits)
    if isinstance(bits, mixed.MixedBits):
        bits.widths()
        return bits
    if isinstance(bits, Mapping):
        return mixed.from_mapping(bits, list(layers))
    raise TypeError(f"argument 'bits' must be an int, a mapping name -> bits or MixedBits, got {type(bits).__name__}")


def prepare(model: nn.Module, names: Iterable[str], bits, group_size: int, method,
            calibration: Iterable | None, dtype: torch.dtype | None, progress: bool,
            aliases: dict[str, list[str]] | None = None) -> Plan:
    """Checks the arguments, assigns bits, and runs the calibrated pass if the method has one.
    `names`: the name of every layer to quantize in the model, each layer once (the others it is
    registered under in `aliases`: name -> all its names). The calibrated pass leaves the layers
    it quantized as Dequantized stand-ins in the model (Plan.build takes either)."""
    resolved_method = resolve(method)
    method, options, calibrated = resolved_method.kind, resolved_method.options, resolved_method.calibrated
    names = list(names)
    unique = {n: model.get_submodule(n) for n in names}
    resolved = _bits(bits, group_size, unique)
    budget = isinstance(resolved, mixed.MixedBits)
    if calibrated and calibration is None:
        raise ValueError(f"method={resolved_method.name!r} needs calibration data: pass calibration= an iterable of model "
                         "inputs (token-id tensors [1, T] or dicts of model kwargs)")
    if calibration is not None and not calibrated and not budget:
        warnings.warn(f"method={method!r} is data-free: argument 'calibration' is ignored", stacklevel=3)
    # Calibration also measures the sensitivities of a MixedBits budget, whatever the method.
    data = cal.samples(calibration) if calibration is not None and (calibrated or budget) else None
    plan = Plan(method, {}, group_size, dtype, aliases)
    if isinstance(resolved, mixed.MixedBits):
        low, high = resolved.widths()
        sens = mixed.sensitivities(model, unique, low, high, group_size, plan.dtype_of, data)
        resolved = mixed.assign(resolved, unique, sens)
    plan.bits = resolved
    del unique  # the walk looks each block's layers up when it reaches them
    if calibrated and names:
        with tqdm(total=len(names), desc=f"quantizing ({method})", unit="layer", disable=not progress) as bar:
            if method == "gptq":
                _gptq_pass(model, names, data, plan, options, bar)
            else:
                _awq_pass(model, names, data, plan, options, bar)
    return plan


def _gptq_pass(model, layers, data, plan: Plan, options: GPTQ, bar) -> None:
    gs = plan.group_size

    def quantize(stats: cal.InputStats, members: list[str], mine, write_back: bool = True) -> None:
        for n in members:
            layer = mine[n]
            h = stats.of(n)[0]
            plan.store(n, layer, gptq.quantize(layer.weight, h, plan.bits[n], gs, plan.dtype_of(layer),
                                               options.damp, options.act_order, options.clip, options.refit),
                       write_back)
            bar.update(1)

    def on_block(block, _prefix, inputs, mine) -> None:
        # All layers of the block from one pass over its inputs (the outputs of the quantized blocks
        # before it), or with `sequential` each input group from a pass of its own after the
        # groups before it are quantized; the Hessians are freed with `stats`.
        stats = cal.collect(block, inputs, mine)
        for i, members in enumerate(cal.groups(stats).values()):
            if options.sequential and i:
                stats = cal.collect(block, inputs, {n: mine[n] for n in members})
            quantize(stats, members, mine)

    def on_rest(rest) -> None:
        stats = cal.collect_model(model, data, rest)
        for members in cal.groups(stats).values():
            quantize(stats, members, rest, write_back=False)

    cal.walk(model, layers, data, on_block, on_rest, lambda mine: plan.retire(model, mine))


def _awq_pass(model, layers, data, plan: Plan, options: AWQ, bar) -> None:
    gs = plan.group_size
    g = options.gptq

    def quantize(members, mine, h, s, write_back: bool = True) -> None:
        # The layers' columns are scaled by s and their inputs divided by it: H of the scaled inputs.
        inv = 1 / s
        h_scaled = h * inv.unsqueeze(1) * inv.unsqueeze(0)
        quantize_scaled(members, mine, h_scaled, write_back)

    def quantize_scaled(members, mine, h_scaled, write_back: bool = True) -> None:
        for n in members:
            layer = mine[n]
            bits, dtype = plan.bits[n], plan.dtype_of(layer)
            if g is None:
                result = mse.quantize(layer.weight, bits, gs, dtype, torch.diagonal(h_scaled))
            else:
                result = gptq.quantize(layer.weight, h_scaled, bits, gs, dtype, g.damp, g.act_order, g.clip, g.refit)
            plan.store(n, layer, result, write_back)
            bar.update(1)

    def on_block(block, prefix, inputs, mine) -> None:
        producers = awq.norms(block, prefix)
        stats = cal.collect(block, inputs, mine, producers=producers)
        chosen = awq.scale_block(model, stats, producers, mine, plan.bits, gs, plan.dtype_of)
        del stats
        for i, (members, h, s) in enumerate(chosen.values()):
            if g is not None and g.sequential and i:
                # The scales are folded: this pass's inputs are already the scaled ones.
                del h
                again = cal.collect(block, inputs, {n: mine[n] for n in members})
                quantize_scaled(members, mine, again.of(members[0])[0])
                del again
            else:
                quantize(members, mine, h, s)

    def on_rest(rest) -> None:
        stats = cal.collect_model(model, data, rest)
        for key, members in cal.groups(stats).items():
            h = stats.of(key)[0]
            quantize(members, rest, h, torch.ones(h.shape[0]), write_back=False)

    cal.walk(model, layers, data, on_block, on_rest, lambda mine: plan.retire(model, mine))
