"""`awq`: activation-aware per-input-channel scaling, after AWQ (Lin, Tang, Tang, Yang, Gan & Han,
2023, "Activation-aware Weight Quantization").

For the linears that read one input x (e.g. q/k/v after the attention norm), W x = (W diag(s))
(x / s): scaling the columns of W by s = mean|x|^alpha protects the weights that multiply large
activations. alpha is searched on a grid by the output error tr(D H D^T) of the scaled-then-
quantized weights on the calibration inputs (H = sum x^T x); alpha = 0 is plain quantization.
The division x / s is folded into whatever produced x, so the float model is unchanged:
  - a norm (RMSNorm / LayerNorm) whose output is exactly x: its weight (and bias) / s;
  - the rows of a linear whose output reaches the layer through per-channel operations only
    (v_proj -> o_proj through the attention average; up_proj -> down_proj through the gated
    product), when the shapes match.
A fold is applied only after checking that it reproduces the module's output; where nothing can
take the fold, the layer is not scaled (the model stays exact) and only gets the
activation-weighted clipping search.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import calibration as cal
from .affine import decode, rtn

# alpha grid of the scale search (AWQ's: 20 points in [0, 1)).
ALPHAS = tuple(i / 20 for i in range(20))
# Weight rows scored at a time by the scale search.
SEARCH_ROWS = 256
# Linears whose input is a per-channel function of a sibling linear's output: name -> sibling.
ROW_FOLDS = {"o_proj": "v_proj", "down_proj": "up_proj"}


def scales_for(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, normalised to geometric mean of its extremes 1 (AWQ's normalisation)."""
    s = mean_abs.float().clamp(min=1e-5) ** alpha
    return s / (s.max() * s.min()).sqrt()


def search_scale(weights: list[torch.Tensor], hessian: torch.Tensor, mean_abs: torch.Tensor, bits: int,
                 group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(s [K], alpha) minimising sum over the layers of tr(D H D^T), D = W - Q(W diag(s)) / s.
    Rows are scored SEARCH_ROWS at a time (rows are independent), so the search's temporaries
    stay at a few copies of that many rows whatever the layers' size."""
    h = hessian.float()
    best = (torch.ones(h.shape[0]), 0.0, float("inf"))
    for alpha in ALPHAS:
        s = scales_for(mean_abs, alpha)
        err = 0.0
        for x in weights:
            for r0 in range(0, x.shape[0], SEARCH_ROWS):
                w = x[r0:r0 + SEARCH_ROWS].detach().float()
                q, qs, qb = rtn(w * s, bits, group_size, dtype)
                d = w - decode(q, qs, qb, group_size) / s
                err += float(((d @ h) * d).sum())
        if err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1]


def fold_into_norm(norm: nn.Module, s: torch.Tensor) -> bool:
    """Divides the norm's output by s through its weight (and bias); only if, on random inputs, the
    folded norm gives the original output / s to the weight dtype's rounding (a norm whose output
    is not proportional to its weight, e.g. one computing (1 + weight) * x, is left alone).
    Returns whether it folded."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != s.shape or not weight.dtype.is_floating_point:
        return False
    sample = torch.randn(8, s.numel(), generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    trial = copy.deepcopy(norm)
    with torch.no_grad():
        trial.weight.div_(s.to(weight.dtype))
        if isinstance(getattr(trial, "bias", None), torch.Tensor):
            trial.bias.div_(s.to(weight.dtype))
        want = norm(sample).float() / s
        got = trial(sample).float()
    eps = torch.finfo(weight.dtype).eps
    if not torch.allclose(got, want, rtol=8 * eps, atol=8 * eps * float(want.abs().max())):
        return False
    norm.load_state_dict(trial.state_dict())
    return True


def fold_into_rows(prev: nn.Linear, s: torch.Tensor) -> bool:
    """Divides prev's outputs (rows of its weight, its bias) by s; only when its out_features match."""
    if prev.out_features != s.numel():
        return False
    with torch.no_grad():
        prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    return True


def scale_columns(layer: nn.Linear, s: torch.Tensor) -> None:
    with torch.no_grad():
        layer.weight.mul_(s.to(layer.weight.dtype))


def norms(block: nn.Module, prefix: str) -> dict[str, nn.Module]:
    """The block's norm-like modules (leaf, not linear/embedding, a 1-D weight) by full name."""
    out = {}
    for rel, m in block.named_modules():
        w = getattr(m, "weight", None)
        if (rel and not isinstance(m, (nn.Linear, nn.Embedding)) and not list(m.children())
                and isinstance(w, torch.Tensor) and w.dim() == 1):
            out[prefix + rel] = m
    return out


def scale_block(model: nn.Module, stats: cal.InputStats, producers: dict[str, nn.Module],
                layers: dict[str, nn.Linear], bits: dict[str, int], group_size: int, dtype_of):
    """Searches and folds the scales of every input group of a block, on its float weights (all
    before any is quantized). Returns key -> (member names, H, s); s = 1 where nothing could fold."""
    chosen = {}
    for key, members in cal.groups(stats).items():
        h, mean_abs, _ = stats.of(key)
        s = torch.ones(h.shape[0])
        target = fold_target(model, key, stats, producers, members)
        if target is not None:
            cand, _alpha = search_scale([layers[n].weight for n in members], h, mean_abs,
                                        min(bits[n] for n in members), group_size, dtype_of(layers[members[0]]))
            folded = fold_into_rows(target, cand) if isinstance(target, nn.Linear) else fold_into_norm(target, cand)
            if folded:
                s = cand
                for n in members:
                    scale_columns(layers[n], s)
        chosen[key] = (members, h, s)
    return chosen


def fold_target(model: nn.Module, key: str, stats: cal.InputStats, producers: dict[str, nn.Module],
                members: list[str]):
    """What can absorb 1/s for the layers reading input `key`: the norm that produced it, or the
    sibling linear of ROW_FOLDS (v_proj for o_proj, up_proj for down_proj); None."""
    if key in stats.fed_by:
        return producers[stats.fed_by[key]]
    if len(members) != 1:
        return None
    parent, _, leaf = key.rpartition(".")
    sibling = ROW_FOLDS.get(leaf)
    if sibling is None:
        return None
    try:
        prev = model.get_submodule(f"{parent}.{sibling}" if parent else sibling)
    except AttributeError:
        return None
    layer = model.get_submodule(key)
    if type(prev) is not nn.Linear or prev.out_features != layer.in_features:
        return None
    return prev
