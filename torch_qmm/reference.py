"""The float64 oracle: pure torch, written for clarity, not speed.

Every backend and kernel is compared with these functions. Tests multiply by the *dequantized*
weights, so kernel error is measured separately from quantization error.
"""

from __future__ import annotations

import torch

from .formats import check_format


def unpack(wq: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed uint32 [rows, words] -> integer codes int64 [rows, words * 32 / bits].

    Each row is a little-endian bit stream: element k occupies bits [k*bits, (k+1)*bits).
    """
    rows, words = wq.shape
    # uint32 -> 32 bits per word, least-significant first.
    w64 = wq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bit_index = torch.arange(32, device=wq.device)
    stream = (w64.unsqueeze(-1) >> bit_index) & 1  # [rows, words, 32]
    stream = stream.reshape(rows, words * 32 // bits, bits)
    weights = 1 << torch.arange(bits, device=wq.device)
    return (stream * weights).sum(-1)


def dequantize(wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """float64 W [rows, cols] = scales * q + biases, with scales/biases taken at their stored precision."""
    scaled, b = _terms(wq, scales, biases, bits, group_size)
    return scaled + b


def dequantize_rounded(wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                       group_size: int) -> torch.Tensor:
    """W [rows, cols] in the scales' dtype as mlx.core.dequantize rounds it: s*q rounded to the
    scales' dtype, then that plus b rounded again (each step from its exact float64 value)."""
    scaled, b = _terms(wq, scales, biases, bits, group_size)
    dtype = scales.dtype
    return (scaled.to(dtype).to(torch.float64) + b).to(dtype)


def _terms(wq, scales, biases, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two float64 terms of every weight, s*q and b, each [rows, cols]."""
    check_format(bits, group_size)
    q = unpack(wq, bits).to(torch.float64)
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=-1)
    b = biases.to(torch.float64).repeat_interleave(group_size, dim=-1)
    return s * q, b


def qmm(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    transpose: bool = True,
) -> torch.Tensor:
    """float64 y[..., N] = x[..., K] @ W.T (transpose=True, W [N, K]) or x @ W (W [K, N])."""
    w = dequantize(wq, scales, biases, bits, group_size)
    xd = x.to(torch.float64)
    return xd @ (w.T if transpose else w)


def qmm_magnitude(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    transpose: bool = True,
) -> torch.Tensor:
    """float64 |x| @ (|s*q| + |b|): the size of the terms any implementation of the affine product adds.

    Error bounds of floating-point sums scale with the sum of the absolute terms. In the affine
    format each weight is itself a sum, w = s*q + b, and fast kernels hoist the bias out of the dot
    product (y = s * sum(q*x) + b * sum(x), after MLX), so where s*q and b nearly cancel the error is
    relative to |s*q| + |b|, not to |w|.
    """
    scaled, b = _terms(wq, scales, biases, bits, group_size)
    terms = scaled.abs() + b.abs()
    return x.to(torch.float64).abs() @ (terms.T if transpose else terms)


def quantize(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of mlx.core.quantize (affine) in float32 torch ops, returning (wq, scales, biases).

    Follows MLX's CPU algorithm: scale = max((max-min)/(2^bits-1), 1e-7), sign from the larger-
    magnitude extreme, which is then represented exactly (q0 = rint(edge/scale); scale = edge/q0,
    bias = edge when q0 != 0); q = clamp(rint((w - bias)/scale), 0, 2^bits-1).
    """
    check_format(bits, group_size)
    rows, cols = w.shape
    g = w.to(torch.float32).reshape(rows, cols // group_size, group_size)
    w_max = g.amax(-1, keepdim=True)
    w_min = g.amin(-1, keepdim=True)
    n_bins = float(2**bits - 1)
    min_is_edge = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scale = torch.where(min_is_edge, scale, -scale)
    edge = torch.where(min_is_edge, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, 1.0), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.clamp(torch.round((g - bias) / scale), 0, n_bins).to(torch.int64).reshape(rows, cols)
    return pack(q, bits), scale.squeeze(-1).to(w.dtype), bias.squeeze(-1).to(w.dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes int64 [rows, cols] -> packed uint32 [rows, cols * bits / 32] (inverse of unpack)."""
    rows, cols = q.shape
    bit_index = torch.arange(bits, device=q.device)
    stream = ((q.unsqueeze(-1) >> bit_index) & 1).reshape(rows, cols * bits // 32, 32)
    words = (stream << torch.arange(32, device=q.device)).sum(-1)  # int64, < 2^32
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32).view(torch.uint32)
