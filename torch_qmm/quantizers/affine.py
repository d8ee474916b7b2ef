"""Shared pieces of every quantizer: codes from (scale, bias), packing, the error objectives.

Every method ends in the same place: integer codes q [rows, cols] and per-group scale and bias
[rows, cols/group_size] in the layer's dtype, packed into MLX's affine format (formats.py). The
codes are always computed from the scale and bias *as stored* (rounded to the dtype), so that what
was optimised is exactly what `mlx.core.dequantize` / `torch_qmm.dequantize` decode.
"""

from __future__ import annotations

import torch

from .. import reference
from ..ops import quantize as rtn_quantize

# Codes packed or unpacked at a time: reference.pack / unpack expand every code into its bits as
# int64, so a chunk of this many codes takes about CHUNK_CODES * bits * 8 bytes while it is worked on.
CHUNK_CODES = 1 << 18


def _rows_per_chunk(cols: int) -> int:
    return max(1, CHUNK_CODES // max(cols, 1))


def levels(bits: int) -> float:
    """The largest code, 2^bits - 1."""
    return float(2**bits - 1)


def codes(groups: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> torch.Tensor:
    """Nearest codes of float groups [rows, G, gs] for scale/bias [rows, G, 1]: for fixed scale and
    bias this minimises every element's error independently. A zero scale gives code 0."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((groups - bias) / safe).clamp_(0, levels(bits))
    return torch.where(scale == 0, torch.zeros_like(q), q)


def stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to the storage dtype, back in float32 (what the decoder will see)."""
    return t.to(dtype).to(torch.float32)


def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int, dtype: torch.dtype):
    """Codes [rows, cols] and scale/bias [rows, G] -> the affine triple (wq uint32, scales, biases)."""
    q = q.to(torch.int64)
    step = _rows_per_chunk(q.shape[1])
    wq = torch.cat([reference.pack(q[i:i + step], bits) for i in range(0, q.shape[0], step)])
    return wq, scale.to(dtype), bias.to(dtype)


def unpack_codes(wq: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed words -> float32 codes [rows, cols] (row-chunked reference.unpack)."""
    step = _rows_per_chunk(wq.shape[1] * 32 // bits)
    return torch.cat([reference.unpack(wq[i:i + step], bits).float() for i in range(0, wq.shape[0], step)])


def decode(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 W [rows, cols] = scale * q + bias (scale/bias [rows, G])."""
    rows, cols = q.shape
    g = q.reshape(rows, cols // group_size, group_size)
    return (g * scale.float().unsqueeze(-1) + bias.float().unsqueeze(-1)).reshape(rows, cols)


def rtn(w: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype):
    """MLX's round-to-nearest (torch_qmm.quantize) as (codes float32, scale, bias) in dtype."""
    wq, s, b = rtn_quantize(w.detach().to(dtype), group_size=group_size, bits=bits)
    return unpack_codes(wq, bits), s, b


def weight_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Sum of squared weight errors."""
    return float(((w.double() - w_hat.double()) ** 2).sum())


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum over calibration rows x of |x W^T - x W_hat^T|^2 = tr(D H D^T), H = sum x^T x, D = W - W_hat."""
    d = (w.double() - w_hat.double())
    return float(((d @ hessian.double()) * d).sum())
