"""GGUF files (read with the `gguf` package): checked tensors, lossless conversion of the
32-weight block types and Q5_K to MLX's affine format, K-quant blocks for the native gguf_qmm op.

Lossless conversions (group_size 32, one GGUF block = one affine group; w = scale * q + bias):
  Q8_0  w = d * i8                 -> bits 8, q = i8 + 128 (sign bit flipped), scale d, bias -128 d
  Q4_0  w = d * (q - 8)            -> bits 4, scale d, bias -8 d
  Q4_1  w = d * q + m              -> bits 4, scale d, bias m
  Q5_0  w = d * (q - 16)           -> bits 5, scale d, bias -16 d
  Q5_1  w = d * q + m              -> bits 5, scale d, bias m
  Q5_K  w = d*sc_j*q - dmin*m_j   -> bits 5, one group per sub-block j of 32: scale d*sc_j,
                                     bias -dmin*m_j (6-bit sc_j, m_j: exact in float32 only)
  IQ4_NL w = d * kv[q]             -> bits 8, q8 = kv[q] + 128, scale d, bias -128 d
  IQ4_XS w = d*(l_j - 32)*kv[q]    -> bits 8, one group per sub-block j of 32: q8 = kv[q] + 128,
                                     scale d*(l_j - 32), bias -128 * scale (6-bit l_j: exact
                                     in float32 only)
  (kv: llama.cpp's 16 int8 values kvalues_iq4nl, -127 .. 113; the 8-bit codes double the
  memory of the file's 4-bit ones)
d and m are float16 in the file, so scales/biases are exact in float32 (and in float16 unless
-128 d overflows, which is checked; Q5_K's products of a float16 and a 6-bit integer have up to
17 significant bits: rounded in float16); the codes are repacked from GGUF's nibble order (byte j
holds weights j and j + 16; Q5_K: chunks of 32 bytes, low nibbles one sub-block, high the next)
into MLX's little-endian bit stream.
The K-quants Q2_K .. Q6_K, IQ4_XS and the lattice i-quants (NATIVE_TYPES) stay as their block bytes in linear layers (GGUFLinear /
torch_qmm::gguf_qmm) by default; a Q5_K embedding takes the affine form above (QuantEmbedding).

MXFP4 (FP_TYPES) is MLX's mxfp4 bit for bit (to_fp): a block of 32 weights is one E8M0 exponent
byte e (scale 2^(e - 127)) and 16 bytes of E2M1 codes; only the codes' order differs (byte j
holds weights j and j + 16, as Q4_0; MLX's stream holds weights 2j and 2j + 1 in byte j).

Q4_K and Q5_K have that exact affine form (k_quant_to_affine, q4_k_to_affine; used by `convert`):
each super-block of 256 weights is 8 groups of 32, w = d*sc_j*q - dmin*m_j -> bits 4 / 5,
group_size 32, scale d*sc_j, bias -dmin*m_j. d, dmin are float16 and sc_j, m_j 6-bit integers, so
the products have at most 17 significant bits: exact in float32, rounded in float16/bfloat16.
IQ4_XS, native too, has the 8-bit form above (k_quant_to_affine as well).
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from ..gguf_blocks import IQ4_VALUES, f16_scales
from ..nn import QuantLinear
from .gguf_types import (
    AFFINE_TYPES,
    IQ4_NL,
    IQ4_XS,
    BF16,
    F16,
    F32,
    FLOAT_TYPES,
    FP_TYPES,
    GGML_TYPES,
    NATIVE_TYPES,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q8_0,
    SUPPORTED_TYPES,
    block_info,
    supported_list,
    type_name,
)
from .gguf_header import GGUFFormatError, read_header
from .gguf_header import value as metadata_value
from .modules import GGUFLinear, QuantEmbedding

__all__ = ["GGUFFile", "GGUFTensor", "check_finite", "dequantize", "to_affine", "affine_exact", "q4_k_to_affine",
           "k_quant_to_affine", "to_fp",
           "to_blocks", "linear_from_gguf"]

# The affine 8-bit codes (value + 128) of the 16 values IQ4_NL's and IQ4_XS's 4-bit codes index.
_IQ4_CODES8 = (np.array(IQ4_VALUES, dtype=np.int16) + 128).astype(np.uint8)
IQ4_XS_BLOCK_BYTES = 136  # f16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of nibbles
Q4_K_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles
Q5_K_BLOCK_BYTES = 176  # the same, with 32 bytes of 5th bits (qh) before the nibbles


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file. `shape` is in torch order ([N, K] for a matrix: ggml's ne reversed);
    `raw` is its bytes, uint8 [rows, bytes per row] (`data`: a view of the memory-mapped file, or
    an array in memory); `source` the file it came from (named in errors); `file` the open
    GGUFFile `data` maps, checked before `raw` hands the bytes out (GGUFFile.check_unchanged)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray
    source: str = "<memory>"
    file: GGUFFile | None = field(default=None, repr=False, compare=False)

    @property
    def raw(self) -> np.ndarray:
        """The bytes, once the mapped file is known to be still whole (a read past the end of a
        file cut short would kill the process with SIGBUS, not raise)."""
        if self.file is not None:
            self.file.check_unchanged()
        return self.data

    def part(self, name: str, shape: tuple[int, ...], raw: np.ndarray) -> GGUFTensor:
        """A tensor of the same type and file over some of these bytes (raw: a view of self.raw)."""
        return GGUFTensor(name, self.ggml_type, shape, raw, self.source, self.file)

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A GGUF file whose header was checked against the file (gguf_header.read_header) before any
    tensor is touched; tensors are views of the memory-mapped file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        header = read_header(self.path)
        self.header = header
        with open(self.path, "rb") as f:  # the checked file (never empty)
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = len(self._mmap)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensors: dict[str, GGUFTensor] = {}
        for info in header.tensors:
            shape = tuple(reversed(info.ne))
            row = shape[-1] if shape else 1
            per_block, block_bytes = block_info(info.ggml_type)
            raw = self._map[info.offset:info.offset + info.nbytes]
            rows = math.prod(shape[:-1])
            self.tensors[info.name] = GGUFTensor(info.name, info.ggml_type, shape,
                                                 raw.reshape(rows, row // per_block * block_bytes), str(self.path), self)

    def check_unchanged(self) -> None:
        """GGUFFormatError when the file is shorter than when it was opened (truncated or rewritten
        in place by another process since): reading mapped bytes past its new end would kill the
        process (SIGBUS), so every GGUFTensor of this file checks before handing out its bytes (raw)."""
        now = self._mmap.size()
        if now < self._size:
            raise GGUFFormatError(f"{self.path}: the file is now {now} bytes, shorter than the {self._size} it had "
                                  "when opened (truncated or rewritten since): open it again once it is complete")

    @property
    def metadata(self) -> dict[str, object]:
        """Key-value metadata as Python values (arrays as lists)."""
        return {key: self.get_metadata(key) for key in self.header.kv}

    def get_metadata(self, key: str, default=None):
        entry = self.header.kv.get(key)
        if entry is None:
            return default
        return metadata_value(memoryview(self._map), entry, self.path)

    @property
    def architecture(self) -> str | None:
        arch = self.get_metadata("general.architecture")
        if arch is not None and not isinstance(arch, str):
            raise GGUFFormatError(f"{self.path}: metadata 'general.architecture' must be a string, got {arch!r}")
        return arch


def _require(t: GGUFTensor, allowed: tuple[int, ...], what: str) -> None:
    if t.ggml_type not in allowed:
        raise ValueError(
            f"{t.source}: tensor {t.name!r} has type {t.type_name}; {what} supports "
            f"{', '.join(type_name(a) for a in allowed)} (torch_qmm reads: {supported_list()})"
        )


def _corrupt_values(t: GGUFTensor, what: str) -> GGUFFormatError:
    return GGUFFormatError(f"{t.source}: tensor {t.name!r} ({t.type_name}) holds NaN or Inf {what}: the file is "
                           "corrupt (a model's weights and block scales are finite)")


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """float32 tensor of `t`'s shape, decoded by the gguf package (the reference decoder).
    Raises GGUFFormatError when the decoded values are not all finite (a corrupt file)."""
    _require(t, SUPPORTED_TYPES, "dequantize")
    if math.prod(t.shape) == 0:  # a dim of 0 (the header allows it): no values, whatever the other dims
        return torch.empty(t.shape, dtype=torch.float32)
    if t.ggml_type == F32:
        values = t.raw.view(np.float32)
    elif t.ggml_type == F16:
        values = t.raw.view(np.float16).astype(np.float32)
    elif t.ggml_type == BF16:
        out = torch.from_numpy(t.raw.view(np.int16).copy()).view(torch.bfloat16).float().reshape(t.shape)
        if not torch.isfinite(out).all():
            raise _corrupt_values(t, "values")
        return out
    else:
        return _decode_in_slices(t)
    out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(t.shape)  # a writable copy
    if not torch.isfinite(out).all():
        raise _corrupt_values(t, "values")
    return out


# The gguf package's decode holds several arrays of the size of what it decodes at once (about 5x
# the float32 result for Q4_1): blocks are decoded this many float32 bytes of rows at a time.
DECODE_SLICE_BYTES = 32 * 2**20


def _decode_in_slices(t: GGUFTensor) -> torch.Tensor:
    """dequantize of a block type: each slice of rows decoded by the gguf package into the result."""
    qtype = GGMLQuantizationType(t.ggml_type)
    rows, row = t.raw.shape[0], (t.shape[-1] if t.shape else 1)  # raw: one row of W's blocks per row
    out = torch.empty(rows, row, dtype=torch.float32)
    step = max(1, DECODE_SLICE_BYTES // (4 * row))
    for r in range(0, rows, step):
        with np.errstate(all="ignore"):  # a corrupt block's Inf / NaN: refused below, not warned about
            values = gguf_quants.dequantize(np.ascontiguousarray(t.raw[r:r + step]), qtype)
        if not np.isfinite(values).all():
            raise _corrupt_values(t, "block scales")
        out[r:r + step] = torch.from_numpy(values.reshape(-1, row))
    return out.reshape(t.shape)


def check_finite(t: GGUFTensor, slice_bytes: int) -> bool:
    """Decodes `t` a slice of rows at a time (at most `slice_bytes` of float32 each, so memory
    stays bounded for any tensor) and raises GGUFFormatError at the first value that is not
    finite. Returns False, decoding nothing, for a type the gguf package cannot decode."""
    try:
        qtype = GGMLQuantizationType(t.ggml_type)
    except ValueError:
        return False
    if math.prod(t.shape) == 0:  # no values to check (rows of 0 values, or 0 rows)
        return True
    rows, per_row = t.raw.shape[0], max(1, math.prod(t.shape[-1:]))
    step = max(1, slice_bytes // (4 * per_row))
    for r in range(0, rows, step):
        try:
            with np.errstate(all="ignore"):  # a corrupt block's Inf / NaN: refused below, not warned about
                finite = np.isfinite(gguf_quants.dequantize(np.ascontiguousarray(t.raw[r:r + step]), qtype)).all()
        except NotImplementedError:
            return False
        if not finite:
            raise _corrupt_values(t, "values" if t.ggml_type in FLOAT_TYPES else "block scales")
    return True


def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [rows, K] -> uint32 [rows, K*bits/32], each row a little-endian bit stream."""
    rows, k = codes.shape
    if bits == 8:
        packed = codes.astype(np.uint8)
    elif bits == 4:
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    else:
        stream = (codes[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1
        packed = np.packbits(stream.reshape(rows, k * bits).astype(np.uint8), axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").reshape(rows, k * bits // 32)


def _affine64(t: GGUFTensor) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(bits, block bytes [rows, groups, bytes per block], scales, biases float64 [rows, K/32]) of
    an AFFINE_TYPES matrix: every value exact (float16 fields times integers of at most 6 bits)."""
    rows, k = t.raw.shape[0], t.shape[-1]
    if t.ggml_type == Q5_K:
        b = t.raw.reshape(rows, k // 256, Q5_K_BLOCK_BYTES)
        scales, biases = _k_scales_biases64(b)
        return 5, b, scales.reshape(rows, k // 32), biases.reshape(rows, k // 32)
    if t.ggml_type == IQ4_XS:
        b = t.raw.reshape(rows, k // 256, IQ4_XS_BLOCK_BYTES)
        # sub-block j's 6-bit l_j: the j-th nibble of scales_l (4 bytes at 4), and bits 2j, 2j + 1
        # of scales_h (uint16 at 2) above it
        low = np.stack([b[..., 4:8] & 0xF, b[..., 4:8] >> 4], axis=-1).reshape(rows, k // 256, 8)
        high = (b[..., 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
        with np.errstate(invalid="ignore"):  # inf * 0 in a corrupt block: NaN, refused by the callers
            scales = _f16_field(b, 0)[..., None] * ((low | (high << 4)).astype(np.float64) - 32)
        return 8, b, scales.reshape(rows, k // 32), -128.0 * scales.reshape(rows, k // 32)
    _, block_bytes = block_info(t.ggml_type)
    b = t.raw.reshape(rows, k // 32, block_bytes)
    d = _f16_field(b, 0)
    if t.ggml_type in (Q8_0, IQ4_NL):
        return 8, b, d, -128.0 * d
    if t.ggml_type in (Q4_1, Q5_1):
        return (4 if t.ggml_type == Q4_1 else 5), b, d, _f16_field(b, 2)
    return (4 if t.ggml_type == Q4_0 else 5), b, d, (-8.0 if t.ggml_type == Q4_0 else -16.0) * d


def _affine_codes(t: GGUFTensor, b: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, K] of an AFFINE_TYPES matrix (its blocks b as _affine64 gives them)."""
    rows, k = t.raw.shape[0], t.shape[-1]

    def nibbles(qs: np.ndarray) -> np.ndarray:  # byte j holds weights j (low) and j + 16 (high)
        return np.concatenate([qs & 0xF, qs >> 4], axis=-1)

    def high_bits(lo: int) -> np.ndarray:  # Q5: bit j of the 32-bit qh is the 5th bit of weight j
        qh = b[..., lo:lo + 4].copy().view("<u4")
        return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)

    if t.ggml_type == Q5_K:
        codes = _k_codes(b, Q5_K)
    elif t.ggml_type in (IQ4_NL, IQ4_XS):  # byte j of each 16 holds weights j and j + 16 of a sub-block
        qs = b[..., 2:18] if t.ggml_type == IQ4_NL else b[..., 8:].reshape(rows, k // 256, 8, 16)
        codes = _IQ4_CODES8[nibbles(qs)]
    elif t.ggml_type == Q8_0:
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif t.ggml_type == Q4_0:
        codes = nibbles(b[..., 2:18])
    elif t.ggml_type == Q4_1:
        codes = nibbles(b[..., 4:20])
    elif t.ggml_type == Q5_0:
        codes = nibbles(b[..., 6:22]) | (high_bits(2) << 4)
    else:  # Q5_1
        codes = nibbles(b[..., 8:24]) | (high_bits(4) << 4)
    return codes.reshape(rows, k)


def to_affine(
    t: GGUFTensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Converts a Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q5_K / IQ4_NL / IQ4_XS matrix losslessly to
    the affine format.

    Returns (wq uint32 [N, K*bits/32], scales, biases [N, K/32] in `dtype`, bits, group_size=32).
    Exact in float32; float16 is checked for overflow (and keeps the 32-weight types exact; Q5_K's
    17-bit scales are rounded); bfloat16 rounds. affine_exact says which.
    """
    _require(t, AFFINE_TYPES, "to_affine")
    bits, b, d, bias = _affine64(t)
    if not (np.isfinite(d).all() and np.isfinite(bias).all()):
        raise _corrupt_values(t, "block scales")
    wq = torch.from_numpy(_pack_bits(_affine_codes(t, b), bits))
    scales = torch.from_numpy(d).to(dtype)
    biases = torch.from_numpy(bias).to(dtype)
    if not (torch.isfinite(scales).all() and torch.isfinite(biases).all()):
        raise ValueError(f"{t.source}: tensor {t.name!r}: its finite scales/biases overflow {dtype}; convert with "
                         "dtype=torch.float32")
    return wq, scales, biases, bits, 32


MXFP4_BLOCK_BYTES = 17  # the E8M0 exponent byte, then 16 bytes of E2M1 code pairs
# |E2M1 value| of each code's low three bits (the fourth is the sign).
_E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_fp(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """An FP_TYPES matrix [N, K] as MLX's format of the same bits: (wq uint32 [N, K/8] (4-bit
    codes, MLX's little-endian stream), scales uint8 [N, K/32] (E8M0 bytes), mode "mxfp4").

    A block whose scale byte is 255 (NaN in the OCP MX format; ggml and MLX give it different
    values) or whose values overflow float32 is refused (GGUFFormatError naming the tensor).
    """
    _require(t, tuple(FP_TYPES), "to_fp")
    rows, k = t.raw.shape[0], t.shape[-1]
    b = t.raw.reshape(rows, k // 32, MXFP4_BLOCK_BYTES)
    exponents, qs = b[..., 0], b[..., 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [rows, groups, 32] in weight order
    largest = _E2M1_MAGNITUDES[(codes & 7).max(axis=-1)]
    with np.errstate(over="ignore"):
        overflow = np.ldexp(largest, exponents.astype(np.int64) - 127) > np.finfo(np.float32).max
    if (exponents == 255).any() or overflow.any():
        raise GGUFFormatError(f"{t.source}: tensor {t.name!r} ({t.type_name}) holds a block with scale byte 255 or "
                              "values beyond float32: the file is corrupt (a model's weights are finite)")
    wq = torch.from_numpy(_pack_bits(codes.reshape(rows, k), 4))
    return wq, torch.from_numpy(np.ascontiguousarray(exponents)), FP_TYPES[t.ggml_type]


def affine_exact(t: GGUFTensor, dtype: torch.dtype) -> bool:
    """Whether to_affine(t, dtype) keeps the weights of an AFFINE_TYPES matrix exactly: every
    scale and bias survives the cast to dtype (all are exact in float64, and in float32). True in
    float32; in float16 for the 32-weight types (float16 fields, times powers of two) unless -128 d
    overflows (to_affine refuses that), not for most Q5_K / IQ4_XS scales (up to 17 / 16 bits);
    bfloat16 (8 significant bits) rounds most."""
    _require(t, AFFINE_TYPES, "affine_exact")
    _, _, d, bias = _affine64(t)
    for values in (d, bias):
        exact = torch.from_numpy(values)
        if not torch.equal(exact.to(dtype).double(), exact):
            return False
    return True


def _f16_field(b: np.ndarray, lo: int) -> np.ndarray:
    """The float16 at bytes lo, lo + 1 of every block of b [..., block bytes], as float64 [...]."""
    return b[..., lo:lo + 2].copy().view("<f2")[..., 0].astype(np.float64)


def _k_scales_biases64(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks b [N, S, block bytes] (f16 d, f16 dmin, 12 bytes of 6-bit scales
    and mins first in both) -> (d*sc_j, -dmin*m_j) float64 [N, S, 8], exact (17 significant bits)."""
    d, dmin = _f16_field(b, 0)[..., None], _f16_field(b, 2)[..., None]  # [N, S, 1]
    # 12 scale bytes (llama.cpp get_scale_min_k4): sub-blocks 0-3 take the low 6 bits of bytes 0-3
    # (scale) and 4-7 (min); 4-7 take the nibbles of bytes 8-11 plus the top 2 bits of 0-3 / 4-7.
    lo, hi, mix = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [N, S, 8]
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    with np.errstate(invalid="ignore"):  # inf * 0 in a corrupt block: NaN, refused by the callers
        return d * sc, -(dmin * mn)


def _k_codes(b: np.ndarray, ggml_type: int) -> np.ndarray:
    """uint8 codes [N, S, 256] of Q4_K / Q5_K super-blocks b [N, S, block bytes]. The nibble bytes
    (Q4_K at 16, Q5_K at 48) are 4 chunks of 32: sub-block 2c is chunk c's low nibbles, 2c + 1 its
    high ones. Q5_K's 32 bytes qh at 16: bit j of byte l is the 5th bit of weight l of sub-block j."""
    n, s = b.shape[:2]
    qs = b[..., -128:].reshape(n, s, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, s, 8, 32)
    if ggml_type == Q5_K:
        qh = b[..., 16:48].reshape(n, s, 1, 32)
        codes |= ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4
    return codes.reshape(n, s, 256)


# The K-quants with an exact affine form of group size 32 (one group per sub-block): their bits.
# (with IQ4_XS, whose sub-blocks of 32 take 8 bits: to_affine's form)
K_AFFINE_BITS = {Q4_K: 4, Q5_K: 5, IQ4_XS: 8}


def _k_affine64(blocks, N: int, K: int, ggml_type: int, op: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K / IQ4_XS blocks -> (wq uint32 [N, K*bits/32], scales, biases float64 [N, K/32]),
    with checks."""
    name, block_bytes = type_name(ggml_type), block_info(ggml_type)[1]
    if isinstance(blocks, torch.Tensor):
        if blocks.dtype != torch.uint8:
            raise ValueError(f"{op}: blocks must be uint8, got {blocks.dtype}")
        arr = blocks.detach().cpu().numpy()
    else:
        arr = np.asarray(blocks)
        if arr.dtype != np.uint8:
            raise ValueError(f"{op}: blocks must be uint8, got {arr.dtype}")
    N, K = int(N), int(K)
    if N < 1 or K < 256 or K % 256 != 0:
        raise ValueError(f"{op}: need N >= 1 and K a positive multiple of 256 ({name} super-block), "
                         f"got N={N}, K={K}")
    expected = (N, K // 256 * block_bytes)
    if tuple(arr.shape) != expected:
        raise ValueError(f"{op}: blocks must be uint8 [N, K/256 * {block_bytes}] = {list(expected)} "
                         f"for N={N}, K={K}, got shape {list(arr.shape)}")
    if ggml_type in AFFINE_TYPES:  # Q5_K, IQ4_XS: to_affine's form
        t = GGUFTensor(op, ggml_type, (N, K), arr)
        _, b, scales, biases = _affine64(t)
        codes = _affine_codes(t, b)
    else:
        b = arr.reshape(N, K // 256, block_bytes)
        scales, biases = _k_scales_biases64(b)
        scales, biases = scales.reshape(N, K // 32), biases.reshape(N, K // 32)
        codes = _k_codes(b, ggml_type).reshape(N, K)
    if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
        raise ValueError(f"{op}: the blocks have non-finite float16 d/dmin (corrupt blocks?)")
    return _pack_bits(codes, K_AFFINE_BITS[ggml_type]), scales, biases


def k_quant_to_affine(
    blocks: torch.Tensor | np.ndarray, N: int, K: int, ggml_type: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K, Q5_K or IQ4_XS blocks of a matrix W [N, K] -> the affine format with bits 4, 5 or 8
    (K_AFFINE_BITS), group_size 32: q4_k_to_affine for any of them (Q5_K: blocks uint8
    [N, K/256 * 176], wq uint32 [N, K*5/32]; IQ4_XS: [N, K/256 * 136], [N, K/4])."""
    return _k_quant_to_affine(blocks, N, K, ggml_type, dtype, "k_quant_to_affine")


def _k_quant_to_affine(blocks, N: int, K: int, ggml_type: int, dtype: torch.dtype, op: str):
    """k_quant_to_affine, its errors prefixed by op (the public function called)."""
    if isinstance(ggml_type, bool) or not isinstance(ggml_type, int) or int(ggml_type) not in K_AFFINE_BITS:
        raise ValueError(f"{op}: argument 'ggml_type' must be 12 (Q4_K), 13 (Q5_K) or 23 (IQ4_XS), got {ggml_type!r}")
    wq, scales64, biases64 = _k_affine64(blocks, N, K, int(ggml_type), op)
    scales = torch.from_numpy(scales64).to(dtype)
    biases = torch.from_numpy(biases64).to(dtype)
    if not (torch.isfinite(scales).all() and torch.isfinite(biases).all()):
        raise ValueError(f"{op}: scales/biases overflow {dtype}; use dtype=torch.float32")
    return torch.from_numpy(wq), scales, biases


def q4_k_to_affine(
    blocks: torch.Tensor | np.ndarray, N: int, K: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks of a matrix W [N, K] -> the affine format with bits=4, group_size=32.

    Each Q4_K super-block (256 weights: f16 d, f16 dmin, 8 sub-blocks of 32 with 6-bit scale sc_j
    and min m_j, 4-bit codes q) decodes as w = d*sc_j*q - dmin*m_j, so one sub-block is one affine
    group: scale d*sc_j, bias -dmin*m_j, code q (repacked from GGUF's nibble order into the affine
    little-endian bit stream).

    Exactness: with dtype=torch.float32 (the default) the scales and biases are exact (an 11-bit
    float16 significand times a 6-bit integer), so torch_qmm.reference.dequantize gives exactly the
    weights llama.cpp / gguf.quants.dequantize decode (float32 rounding of scale*q + bias included).
    With float16 or bfloat16 the scales/biases are ROUNDED to that dtype: no longer exact (and a
    float16 overflow raises ValueError).

    Args:
        blocks: uint8 [N, K/256 * 144] (torch tensor or numpy array), each row the super-blocks of
            one row of W as llama.cpp writes them (what GGUFLinear.blocks / to_blocks hold).
        N, K: the matrix shape; K a multiple of 256.
        dtype: dtype of scales and biases.

    Returns:
        (wq uint32 [N, K/8], scales [N, K/32], biases [N, K/32]).

    Raises:
        ValueError for a wrong blocks dtype/shape, K not a multiple of 256, non-finite d/dmin, or
        scales/biases overflowing `dtype`.
    """
    return _k_quant_to_affine(blocks, N, K, Q4_K, dtype, "q4_k_to_affine")


def to_blocks(t: GGUFTensor) -> torch.Tensor:
    """The block bytes of a matrix of a native type (NATIVE_TYPES) as uint8 [N, K/256 * block_bytes]
    (a copy), its float16 super-block scales checked finite."""
    _require(t, NATIVE_TYPES, "gguf_qmm")
    _, block_bytes = block_info(t.ggml_type)
    blocks = np.array(t.raw, copy=True)
    blocks = torch.from_numpy(blocks)
    if not torch.isfinite(f16_scales(blocks.reshape(-1, block_bytes), t.ggml_type)).all():
        raise _corrupt_values(t, "block scales")
    return blocks


def _check_matrix(t: GGUFTensor, what: str, expected: str) -> None:
    if len(t.shape) != 2 or 0 in t.shape:
        raise ValueError(f"{t.source}: tensor {t.name!r}: {what} must be {expected}, got shape {list(t.shape)}")


def linear_from_gguf(
    t: GGUFTensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The layer for a GGUF weight [N, K]: GGUFLinear (NATIVE_TYPES: Q2_K .. Q6_K, IQ4_XS, the lattice
    i-quants; the file's blocks), QuantLinear (the 32-weight block types, lossless; MXFP4 as mode "mxfp4", the same
    bits) or nn.Linear (F32 / F16 / BF16)."""
    _check_matrix(t, "a linear weight", "[out_features >= 1, in_features >= 1]")
    n, k = t.shape
    if t.ggml_type in NATIVE_TYPES:
        layer = GGUFLinear(k, n, t.ggml_type, bias=bias is not None, dtype=dtype)
        layer.blocks.copy_(to_blocks(t))
    elif t.ggml_type in AFFINE_TYPES:
        wq, scales, biases, bits, gs = to_affine(t, dtype)
        layer = QuantLinear(k, n, bias=bias is not None, bits=bits, group_size=gs, dtype=dtype)
        layer.qweight.copy_(wq)
        layer.scales.copy_(scales)
        layer.biases.copy_(biases)
    elif t.ggml_type in FP_TYPES:
        wq, scales, mode = to_fp(t)
        layer = QuantLinear(k, n, bias=bias is not None, mode=mode, dtype=dtype)
        layer.qweight.copy_(wq)
        layer.scales.copy_(scales)
    elif t.ggml_type in FLOAT_TYPES:
        layer = torch.nn.Linear(k, n, bias=bias is not None, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(dequantize(t))
    else:
        _require(t, SUPPORTED_TYPES, "linear_from_gguf")
    if bias is not None:
        with torch.no_grad():
            layer.bias.copy_(bias)
    return layer


def _q4_k_table(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """A Q4_K matrix in the affine format (bits 4, groups of 32), float32 scales and biases: exact
    (q4_k_to_affine)."""
    n, k = t.shape
    try:
        return (*_k_quant_to_affine(t.raw, n, k, Q4_K, torch.float32, "embedding_from_gguf"), 4, 32)
    except ValueError as e:  # (non-finite block scales)
        raise GGUFFormatError(f"{t.source}: tensor {t.name!r} ({t.type_name}): {e}") from None


def embedding_from_gguf(t: GGUFTensor, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The embedding for a GGUF table [vocab, dim]: QuantEmbedding for the lossless block types
    (and Q4_K in float32, where its affine form is exact: q4_k_to_affine), nn.Embedding (decoded
    once) for float and the other K-quant tables."""
    _check_matrix(t, "an embedding table", "[vocab >= 1, dim >= 1]")
    n, k = t.shape
    q4_k = t.ggml_type == Q4_K and dtype == torch.float32
    if t.ggml_type in AFFINE_TYPES or q4_k:
        wq, scales, biases, bits, gs = _q4_k_table(t) if q4_k else to_affine(t, dtype)
        emb = QuantEmbedding(n, k, bits, gs, dtype=dtype)
        emb.qweight.copy_(wq)
        emb.scales.copy_(scales)
        emb.biases.copy_(biases)
        return emb
    _require(t, SUPPORTED_TYPES, "embedding_from_gguf")
    emb = torch.nn.Embedding(n, k, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(dequantize(t))
    return emb
