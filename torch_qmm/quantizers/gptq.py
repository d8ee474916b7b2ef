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

Refit (`refit` rounds): with the codes fixed, each row's group scales and biases that minimise the
layer's output error (w - w_hat) H (w - w_hat)^T are the solution of a small linear system (2G
unknowns per row: the least squares of the affine grid under the Hessian). Between consecutive
refits the error feedback runs again with the refitted scales and biases held fixed (new codes);
per row whichever candidate has the least output error is kept, so no step makes a row worse: the alternating
scheme of mse.py (after HQQ) with the layer's output error in place of the weight error. The
output error here is measured with GPTQ's dampened Hessian, the objective the error feedback
itself works on.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import mse
from .calibration import release_freed_memory
from .affine import codes, decode, pack, rtn, stored

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


def fixed_params(scale: torch.Tensor, bias: torch.Tensor, group_size: int) -> GroupParams:
    """Group parameters given up front (scale, bias [rows, G])."""
    def params(w: torch.Tensor, first: int):
        g0 = first // group_size
        k = w.shape[1] // group_size
        return scale[:, g0:g0 + k], bias[:, g0:g0 + k]
    return params


def damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Adds damp * mean(diag h) to h's diagonal, in place (GPTQ's dampening); returns h."""
    torch.diagonal(h).add_(damp * torch.diagonal(h).mean())
    return h


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
    damped(H, damp)
    # One [cols, cols] temporary at a time besides H: the Cholesky factor, H^-1, its upper factor.
    hinv = torch.linalg.cholesky(H)
    del H
    hinv = torch.cholesky_inverse(hinv)
    hinv = torch.linalg.cholesky(hinv, upper=True)
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
        release_freed_memory()
    codes_orig = torch.empty_like(Q)
    codes_orig[:, perm] = Q
    return codes_orig, scale, bias


# Rows of one refit chunk: the per-row products P [rows, G, G, group_size] take about
# rows * G * cols floats, kept near REFIT_CHUNK_FLOATS (16 MiB).
REFIT_CHUNK_FLOATS = 1 << 22


def row_errors(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Per row, (w - w_hat) H (w - w_hat)^T [rows]."""
    d = w - w_hat
    return ((d @ hessian) * d).sum(1)


def refit_params(w: torch.Tensor, hessian: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                 group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, bias) [rows, G] minimising each row's (w - s q - b) H (w - s q - b)^T for the codes q
    fixed: per row the normal equations of its 2G unknowns, A theta = c with A = M^T H M and
    c = M^T H w (M [cols, 2G]: the row's codes masked by group, then the groups' indicators).
    A tiny ridge towards the given (scale, bias) keeps groups whose codes are all equal solvable."""
    rows, cols = w.shape
    G = cols // group_size
    ct = hessian.dtype
    hg = hessian.reshape(G, group_size, G, group_size)
    ones_block = hg.sum((1, 3))  # A_11[g, h]: indicator against indicator, the same for every row
    hw = (w.to(ct) @ hessian).reshape(rows, G, group_size)
    out_s, out_b = torch.empty(rows, G, dtype=ct), torch.empty(rows, G, dtype=ct)
    step = max(1, REFIT_CHUNK_FLOATS // (G * cols))
    for r0 in range(0, rows, step):
        qg = q[r0:r0 + step].to(ct).reshape(-1, G, group_size)
        n = qg.shape[0]
        p = torch.einsum("rga,gahb->rghb", qg, hg)  # P[r, g, h, b] = sum_a q[r,g,a] H[g,a,h,b]
        a_qq = torch.einsum("rghb,rhb->rgh", p, qg)
        a_q1 = p.sum(-1)
        del p
        a = torch.empty(n, 2 * G, 2 * G, dtype=ct)
        a[:, :G, :G] = a_qq
        a[:, :G, G:] = a_q1
        a[:, G:, :G] = a_q1.transpose(1, 2)
        a[:, G:, G:] = ones_block
        hw_r = hw[r0:r0 + n]
        c = torch.cat([(qg * hw_r).sum(-1), hw_r.sum(-1)], 1)
        theta0 = torch.cat([scale[r0:r0 + n].to(ct), bias[r0:r0 + n].to(ct)], 1)
        ridge = 1e-7 * torch.diagonal(a, dim1=1, dim2=2).mean(1).clamp(min=1e-30)
        a = a + ridge[:, None, None] * torch.eye(2 * G, dtype=ct)
        theta = torch.linalg.solve(a, (c + ridge[:, None] * theta0).unsqueeze(-1)).squeeze(-1)
        out_s[r0:r0 + n], out_b[r0:r0 + n] = theta[:, :G], theta[:, G:]
    return out_s, out_b


def refine(w: torch.Tensor, hessian: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
           bits: int, group_size: int, dtype: torch.dtype, rounds: int, damp: float = 0.01,
           act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rounds` refits from (q, scale, bias), the error feedback rerun between consecutive ones
    with the refitted scales and biases held fixed; per row the best candidate by output error,
    with scales and biases as stored (rounded to dtype)."""
    ct = hessian.dtype
    hessian = damped(hessian.clone(), damp)
    W = w.detach().to(ct)
    best_q, best_s, best_b = q.to(ct), stored(scale, dtype).to(ct), stored(bias, dtype).to(ct)
    best_e = row_errors(W, decode(best_q, best_s, best_b, group_size).to(ct), hessian)

    def consider(cq, cs, cb):
        nonlocal best_q, best_s, best_b, best_e
        e = row_errors(W, decode(cq, cs, cb, group_size).to(ct), hessian)
        better = e < best_e
        best_q = torch.where(better[:, None], cq, best_q)
        best_s = torch.where(better[:, None], cs, best_s)
        best_b = torch.where(better[:, None], cb, best_b)
        best_e = torch.where(better, e, best_e)

    for i in range(rounds):
        if i:
            q_new, _, _ = search(W, hessian, bits, group_size, fixed_params(best_s, best_b, group_size), damp,
                                 act_order)
            consider(q_new, best_s, best_b)
        s_new, b_new = refit_params(W, hessian, best_q, best_s, best_b, group_size)
        consider(best_q, stored(s_new, dtype).to(ct), stored(b_new, dtype).to(ct))
    return best_q, best_s, best_b


def quantize(w, hessian, bits: int, group_size: int, dtype: torch.dtype, damp: float = 0.01,
             act_order: bool = False, clip: bool = False, refit: int = 0):
    """The packed affine triple (wq, scales, biases) in dtype. clip: group parameters by the
    H-diagonal-weighted mse search instead of the min/max range; refit: rounds of `refine`."""
    h = hessian.float()
    params = (mse_params(bits, group_size, dtype, torch.diagonal(h)) if clip
              else rtn_params(bits, group_size, dtype))
    q, s, b = search(w, h, bits, group_size, params, damp, act_order)
    if refit:
        q, s, b = refine(w, h, q, s, b, bits, group_size, dtype, refit, damp, act_order)
    return pack(q, s, b, bits, dtype)
