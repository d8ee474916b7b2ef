"""The quantization formats, read once from the C++ table (csrc/format_spec.h, the one place they
are defined) through ``torch.ops.torch_qmm._formats()``.

    FORMATS["mxfp4"].group_sizes        # (32,)
    FORMATS["affine"].default_bits      # 4

Every format stores W [rows, cols] quantized along cols in groups of ``group_size`` (docs/formats.md):
packed uint32 [rows, cols * bits / 32], each row one little-endian bit stream (element k at bits
[k*bits, (k+1)*bits)); scales [rows, cols / group_size] (affine: w's dtype, w ~= scale * q + bias
with biases of the same shape; the fp modes: uint8 scale codes, w = scale * element(q), no biases).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from . import _C  # noqa: F401  (loads the library that defines the ops)


@dataclass(frozen=True)
class Format:
    """One row of the format table (csrc/format_spec.h)."""

    mode: str  # MLX's mode string
    index: int  # the C++ Mode value
    element: str  # "uint" (affine codes), "e2m1", "e4m3"
    scale: str  # "float" (scales in w's dtype), "e8m0", "e4m3" (uint8 scale codes)
    has_biases: bool
    bits: tuple[int, ...]  # allowed bit widths (MLX's)
    group_sizes: tuple[int, ...]  # allowed group sizes (MLX's)
    default_bits: int
    default_group_size: int
    element_max: float  # largest |element value| (0 for "uint")

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """uint8 for coded scales; None where scales take the weights' float dtype."""
        return None if self.scale == "float" else torch.uint8


def _read_table() -> dict[str, Format]:
    rows = json.loads(torch.ops.torch_qmm._formats())
    return {
        r["mode"]: Format(
            mode=r["mode"], index=r["index"], element=r["element"], scale=r["scale"], has_biases=r["has_biases"],
            bits=tuple(r["bits"]), group_sizes=tuple(r["group_sizes"]), default_bits=r["default_bits"],
            default_group_size=r["default_group_size"], element_max=float(r["element_max"]),
        )
        for r in rows
    }


FORMATS: dict[str, Format] = _read_table()
MODES = tuple(FORMATS)

SUPPORTED_BITS = FORMATS["affine"].bits
SUPPORTED_GROUP_SIZES = FORMATS["affine"].group_sizes
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def format_of(mode: str) -> Format:
    """The format named `mode`; ValueError naming the known ones otherwise."""
    f = FORMATS.get(mode) if isinstance(mode, str) else None
    if f is None:
        known = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"argument 'mode' must be one of {known}, got {mode!r}")
    return f


def packed_words(cols: int, bits: int) -> int:
    """uint32 words per packed row of `cols` values of `bits` bits."""
    return cols * bits // 32


def check_format(bits: int, group_size: int, mode: str = "affine") -> None:
    """Raises ValueError naming the argument when mode, bits or group_size is not allowed."""
    f = format_of(mode)
    for arg, value, allowed in (("bits", bits, f.bits), ("group_size", group_size, f.group_sizes)):
        if value not in allowed:
            expected = str(allowed[0]) if len(allowed) == 1 else f"one of {allowed}"
            raise ValueError(f"argument '{arg}' must be {expected}, got {value} (mode {mode!r})")
