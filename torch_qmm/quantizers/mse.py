"""`mse`: per group, the scale and bias that minimise the (optionally weighted) reconstruction
error sum_i c_i (w_i - (s q_i + b))^2, data-free.

Two stages per group, all groups at once:
1. clipping-range search: the range [min, max] shrunk by a grid of ratios (the clipping search of
   AWQ's auto-clip and llama.cpp's k-quant range search, here on the affine grid);
2. alternating minimisation from the best range: codes by rounding (optimal for a fixed scale and
   bias), then scale and bias by weighted least squares (optimal for fixed codes) -- the
   L2 case of the alternating scheme of HQQ (Badri & Shaji, half-quadratic quantization).
MLX's round-to-nearest result is the starting candidate and every candidate is scored with the
scale and bias rounded to the storage dtype, so no group ends worse than RTN.
"""

from __future__ import annotations

import torch

from .affine import codes, levels, pack, rtn, stored

# Shrink ratios of the clipping-range search (1.0 = the full range, as RTN).
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))
# Alternating least-squares steps after the range search.
REFINE_STEPS = 10
# Weight rows searched at a time (rows are independent): the search's temporaries, several copies
# of the rows searched, stay that small whatever the layer's size.
SEARCH_ROWS = 256


def search(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes float32 [rows, cols], scale [rows, G], bias [rows, G]) in dtype.

    importance: optional non-negative weights c, per column [cols] (e.g. E[x^2] of the layer's
    input) or per element [rows, cols]; None weighs all elements equally (plain weight error).
    """
    if w.shape[0] <= SEARCH_ROWS:
        return _search_rows(w, bits, group_size, dtype, importance)
    parts = [_search_rows(w[r0:r0 + SEARCH_ROWS], bits, group_size, dtype,
                          importance[r0:r0 + SEARCH_ROWS] if importance is not None and importance.dim() == 2
                          else importance)
             for r0 in range(0, w.shape[0], SEARCH_ROWS)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _search_rows(w, bits, group_size, dtype, importance):
    rows, cols = w.shape
    n_groups = cols // group_size
    g = w.detach().float().reshape(rows, n_groups, group_size)
    if importance is None:
        c = torch.ones(1, 1, group_size).expand(1, n_groups, group_size)
    else:
        c = importance.detach().float().clamp(min=0)
        c = c.reshape(-1 if c.dim() == 2 else 1, n_groups, group_size)
    q0, s0, b0 = rtn(w, bits, group_size, dtype)
    best_q = q0.reshape(rows, n_groups, group_size)
    best_s = s0.float().unsqueeze(-1)
    best_b = b0.float().unsqueeze(-1)
    best_err = (c * (g - (best_q * best_s + best_b)) ** 2).sum(-1, keepdim=True)

    def consider(s: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal best_q, best_s, best_b, best_err
        s, b = stored(s, dtype), stored(b, dtype)
        q = codes(g, s, b, bits)
        err = (c * (g - (q * s + b)) ** 2).sum(-1, keepdim=True)
        better = err < best_err
        best_q = torch.where(better, q, best_q)
        best_s = torch.where(better, s, best_s)
        best_b = torch.where(better, b, best_b)
        best_err = torch.where(better, err, best_err)

    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    for ratio in CLIP_RATIOS:
        consider((hi - lo) * ratio / levels(bits), lo * ratio)
    for _ in range(REFINE_STEPS):
        s, b = _least_squares(g, best_q, c, best_s, best_b)
        consider(s, b)
    return best_q.reshape(rows, cols), best_s.squeeze(-1).to(dtype), best_b.squeeze(-1).to(dtype)


def _least_squares(g, q, c, s_prev, b_prev):
    """Weighted least-squares (s, b) of g ~ s q + b per group; keeps the previous pair where the
    system is singular (all codes equal, or no weight)."""
    sw = c.sum(-1, keepdim=True).expand_as(s_prev)
    sq = (c * q).sum(-1, keepdim=True)
    sqq = (c * q * q).sum(-1, keepdim=True)
    sx = (c * g).sum(-1, keepdim=True)
    sqx = (c * q * g).sum(-1, keepdim=True)
    det = sw * sqq - sq * sq
    ok = det.abs() > 1e-12 * (sw * sqq).abs().clamp(min=1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    s = torch.where(ok, (sw * sqx - sq * sx) / safe, s_prev)
    b = torch.where(ok, (sqq * sx - sq * sqx) / safe, b_prev)
    return s, b


def magnitude_importance(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Data-free element weights |w| + mean |w| of the group: errors on large weights cost more
    (the weighting llama.cpp's k-quant search uses without an importance matrix)."""
    a = w.detach().float().abs()
    g = a.reshape(a.shape[0], -1, group_size)
    return (g + g.mean(-1, keepdim=True)).reshape(a.shape)


def quantize(w, bits: int, group_size: int, dtype: torch.dtype, importance=None):
    """The packed affine triple (wq, scales, biases) of `search`."""
    q, s, b = search(w, bits, group_size, dtype, importance)
    return pack(q, s, b, bits, dtype)
