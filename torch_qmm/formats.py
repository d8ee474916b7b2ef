"""The affine format's parameters, in one place for Python (csrc/format.h mirrors them for C++).

MLX's affine format: W [rows, cols] quantized along cols in groups of `group_size`;
packed uint32 [rows, cols * bits / 32], each row one little-endian bit stream (element k at bits
[k*bits, (k+1)*bits)); scales and biases [rows, cols / group_size]; w ~= scale * q + bias.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packed_words(cols: int, bits: int) -> int:
    """uint32 words per packed row of `cols` values of `bits` bits."""
    return cols * bits // 32


def check_format(bits: int, group_size: int) -> None:
    """Raises ValueError naming the argument when bits or group_size is unsupported."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"argument 'bits' must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"argument 'group_size' must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
