"""`gptq`: Hessian-based error feedback, after GPTQ (Frantar, Ashkboos, Hoefler & Alistarh, 2022).

For one linear layer with calibration inputs X (rows x) and H = sum x^T x, the columns of W are
quantized one at a time; the error of each is spread over the not-yet-quantized columns through
the inverse Hessian, so that the layer's *output* error tr(D H D^T) stays small. The upper
Cholesky factor of H^-1 gives every column's update (GPTQ's formulation), processed in blocks of
columns with a lazy update of the rest.

Affine groups: each group's scale and bias are chosen (by MLX's min/max rule, as GPTQ's own
quantizer does, or with `clip` by the mse search weighted by each input's energy H_ii) on the
group's current, error-updated weights when its first column is reached. With activation order (columns by
decreasing H_ii) the groups are still MLX's contiguous groups of the original order: their scale
and bias are chosen up front from the original weights ("static groups"), the columns are visited
in the permuted order, and the codes are written back in the original order, so the stored format
is the unchanged affine triple.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import mse
from .affine import codes, pack, rtn

# Columns per lazy-update block (a multiple of every supported group size).
BLOCK = 128

# (columns W[:, first:first + k*group_size], first) -> (scale, bias) [rows, k] as stored.
GroupParams = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def rtn_params(bits: int, group_size: int, dtype: torch.dtype) -> GroupParams:
    """Group parameters by MLX's rule (torch_qmm.quantize, the min/max range)."""
    def params(w: torch.Tensor, _first: int):
        _, s, b = rtn(w.float(), bits, group_size, dtype)
        return s.to(w.dtype), b.to(w.dtype)
    return params


def mse_params(bits: int, group_size: int, dtype: torch.dtype,
               importance: torch.Tensor | None = None) -> GroupParams:
    """Group parameters by the mse search (clipped range, least squares), weighted per column by
    `importance` [cols] (e.g. H's diagonal: each input's energy) when given."""
    def params(w: torch.Tensor, first: int):
        c = None if importance is None else importance[first:first + w.shape[1]]
        _, s, b = mse.search(w, bits, group_size, dtype, c)
        return s.to(w.dtype), b.to(w.dtype)
    return params


def search(
    w: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    group_params: GroupParams,
    damp: float = 0.01,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [rows, cols], scale [rows, G], bias [rows, G]) in the dtype of `hessian` (float32, or
    float64 for reference checks). hessian: sum x^T x [cols, cols]; damp: fraction of the mean
    diagonal added to the diagonal (GPTQ's dampening)."""
    ct = hessian.dtype
    rows, cols = w.shape
    W = w.detach().to(ct).clone()
    H = hessian.detach().to(ct).clone()
    dead = torch.diagonal(H) == 0  # inputs that are always zero: any code will do
    H[dead, dead] = 1
    W[:, dead] = 0
    n_groups = cols // group_size
    scale = torch.zeros(rows, n_groups, dtype=ct)
    bias = torch.zeros(rows, n_groups, dtype=ct)
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        s0, b0 = group_params(W, 0)
        scale.copy_(s0)
        bias.copy_(b0)
        W = W[:, perm]
        H = H[perm][:, perm]
    else:
        perm = torch.arange(cols)
    H += damp * torch.diagonal(H).mean() * torch.eye(cols, dtype=ct)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    del H
    Q = torch.zeros_like(W)
    for i1 in range(0, cols, BLOCK):
        i2 = min(i1 + BLOCK, cols)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            grp = col // group_size
            if not act_order and col % group_size == 0:
                s_new, b_new = group_params(W1[:, i:i + group_size], col)
                scale[:, grp] = s_new[:, 0]
                bias[:, grp] = b_new[:, 0]
            s, b = scale[:, grp:grp + 1], bias[:, grp:grp + 1]
            wcol = W1[:, i:i + 1]
            q = codes(wcol.unsqueeze(1), s.unsqueeze(1), b.unsqueeze(1), bits).reshape(rows, 1)
            Q[:, i1 + i] = q[:, 0]
            err = (wcol - (q * s + b)) / h1[i, i]
            W1[:, i:] -= err * h1[i, i:].unsqueeze(0)
            E1[:, i] = err[:, 0]
        W[:, i2:] -= E1 @ hinv[i1:i2, i2:]
    codes_orig = torch.empty_like(Q)
    codes_orig[:, perm] = Q
    return codes_orig, scale, bias


def quantize(w, hessian, bits: int, group_size: int, dtype: torch.dtype, damp: float = 0.01,
             act_order: bool = False, clip: bool = False):
    """The packed affine triple (wq, scales, biases) in dtype. clip: group parameters by the
    H-diagonal-weighted mse search instead of the min/max range."""
    h = hessian.float()
    params = (mse_params(bits, group_size, dtype, torch.diagonal(h)) if clip
              else rtn_params(bits, group_size, dtype))
    q, s, b = search(w, h, bits, group_size, params, damp, act_order)
    return pack(q, s, b, bits, dtype)
