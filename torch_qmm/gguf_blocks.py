"""GGUF K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and i-quant blocks (IQ4_XS and the lattice types
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) decoded to float32 with plain torch ops on uint8.

`dequantize_rows(blocks, ggml_type)` gives the weights gguf.quants.dequantize gives, bit for bit
(tests/test_gguf_qmm_backward.py), with tensor ops only (nothing device-specific; tested on CPU), and traces
under torch.compile. gguf_qmm's backward (torch_qmm/ops.py) uses it; the kernels decode in-kernel
(csrc/cpu, metal/gguf_format.h).

Layouts (llama.cpp's block_q2_K / q3_K / q4_K / q5_K / q6_K / iq4_xs; 256 weights per super-block, one super-block
after another along a row of W):
  Q2_K, 84 bytes: 16 bytes of 4-bit scales sc_j (low nibble) and mins m_j (high nibble) of the
    sub-blocks of 16, 64 bytes of 2-bit codes q, f16 d, f16 dmin; w = (d*sc_j)*q - dmin*m_j.
  Q3_K, 110 bytes: 32 bytes of the codes' high bits, 64 of their low 2 bits, 12 bytes of 6-bit
    scales (sc_j - 32 of the sub-blocks of 16), f16 d; w = (d*(sc_j - 32))*(q - 4), q = 0..7.
  Q4_K, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales sc_j and mins m_j of the 8 sub-blocks
    of 32, 128 bytes of 4-bit codes q; w = (d*sc_j)*q - dmin*m_j.
  Q5_K, 176 bytes: Q4_K's d, dmin and scale bytes, 32 bytes of the codes' fifth bits, Q4_K's 128
    bytes of low 4 bits; w = (d*sc_j)*q - dmin*m_j, q = 0..31.
  Q6_K, 210 bytes: 128 bytes of the codes' low 4 bits, 64 bytes of their high 2 bits, 16 int8
    scales sc_j of the sub-blocks of 16, f16 d; w = (d*sc_j)*(q - 32).
  IQ4_XS, 136 bytes: f16 d, a uint16 of the high 2 bits and 4 bytes of the low 4 bits of the
    6-bit scales l_j of the 8 sub-blocks of 32, 128 bytes of 4-bit codes q indexing 16 int8 values
    v (IQ4_VALUES); w = (d*(l_j - 32))*v[q] (exact: at most 11 + 5 + 7 significant bits).
  The lattice i-quants (fields in metal/gguf_format.h, Lattice): 32 groups of 8 weights, each a
    codebook entry (the gguf package's grids, which metal/gguf_iq_grids.h holds for C++ / Metal)
    with sign bits (IQ2, IQ3) or an offset of +-1/8 (IQ1), times a scale per 16 or 32 weights:
    IQ2: d*(0.5 + l)*0.25, IQ3_XXS: d*(0.5 + l)*0.5, IQ3_S: d*(1 + 2l), IQ1: d*(2l + 1) (exact).
All are computed in float32 in the gguf package's order: d*sc_j is exact (an 11-bit significand
times an integer of at most 8 bits), and so is (d*sc_j)*q for Q2_K, Q4_K and Q5_K, (d*sc_j)*(q - 4)
for Q3_K and (d*sc_j)*(q - 32) for Q6_K (at most 11 + 7 + 5 significant bits); the one rounding is
the subtraction of Q2_K's, Q4_K's and Q5_K's min term.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import quants as gguf_quants

# ggml type id -> bytes per super-block of 256 weights (ids and sizes as in
# torch_qmm/interop/gguf_types.py, which reads them from the gguf package; the tests compare).
BLOCK_BYTES = {10: 84, 11: 110, 12: 144, 13: 176, 14: 210, 23: 136,  # Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
               16: 66, 17: 74, 22: 82, 18: 98, 21: 110, 19: 50, 29: 56}  # IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M
# ggml type id -> the bytes of its float16 super-block scales in a block (d, then dmin where it has one);
# IQ1_M has no such bytes (its d is spread over the top nibbles of its scales: iq1m_d_bits).
F16_SCALE_BYTES = {10: slice(80, 84), 11: slice(108, 110), 12: slice(0, 4), 13: slice(0, 4), 14: slice(208, 210),
                   23: slice(0, 2), 16: slice(0, 2), 17: slice(0, 2), 22: slice(0, 2), 18: slice(0, 2), 21: slice(0, 2),
                   19: slice(0, 2)}
IQ1_M = 29
# llama.cpp's kvalues_iq4nl: the values IQ4_XS's (and IQ4_NL's) 4-bit codes index (C++ / Metal:
# kIQ4Values in metal/gguf_format.h).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
WEIGHTS_PER_BLOCK = 256


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] of a little-endian float16 stored as uint8 [..., 2]."""
    return two_bytes.contiguous().view(torch.float16).float()


def _low_2_bits(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, sb, 16, 16] (sub-block 8h + 2j + s, weight l) of the 2-bit fields of Q2_K / Q3_K
    code bytes qs [rows, sb, 64]: weight 128h + 32j + 16s + l is bits 2j of qs[32h + 16s + l]."""
    rows, sb = qs.shape[:2]
    q = qs.reshape(rows, sb, 2, 1, 32)
    return torch.cat([(q >> (2 * j)) & 3 for j in range(4)], dim=3).reshape(rows, sb, 16, 16)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    rows, sb = b.shape[:2]
    sc = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])  # [rows, sb, 1]
    scale = (d * (sc & 0x0F).float()).unsqueeze(-1)
    offset = (dmin * (sc >> 4).float()).unsqueeze(-1)
    return (scale * _low_2_bits(b[..., 16:80]).float() - offset).reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    rows, sb = b.shape[:2]
    # 12 scale bytes (llama.cpp dequantize_row_q3_K): sub-block j's low 4 bits are the low (j < 8) or
    # high (j >= 8) nibble of byte j % 8, its top 2 bits bits 2 * (j // 4) of byte 8 + j % 4.
    packed = b[..., 96:108]
    low = torch.cat([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], dim=-1)
    high = torch.cat([(packed[..., 8:12] >> (2 * i)) & 3 for i in range(4)], dim=-1)
    sc = (low | (high << 4)).float() - 32  # [rows, sb, 16], -32..31
    scale = (_f16(b[..., 108:110]) * sc).unsqueeze(-1)
    # The third bit of weight 128h + 32j + 16s + l is bit 4h + j of hmask[16s + l].
    hmask = b[..., 0:32].reshape(rows, sb, 1, 32)
    high_bit = torch.cat([(hmask >> i) & 1 for i in range(8)], dim=2).reshape(rows, sb, 16, 16)
    q = (_low_2_bits(b[..., 32:96]) | (high_bit << 2)).float() - 4  # -4..3, exact
    return (scale * q).reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _q4_k_family(b, b[..., 16:144], None)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    return _q4_k_family(b, b[..., 48:176], b[..., 16:48])


def _q4_k_family(b: torch.Tensor, low: torch.Tensor, fifth: torch.Tensor | None) -> torch.Tensor:
    """Q4_K (fifth None) or Q5_K (fifth: its 32 bytes qh, bit j of byte l the fifth bit of weight
    l of sub-block j) from the blocks b and their 128 bytes of low 4 bits."""
    rows, sb = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [rows, sb, 1]
    # 12 scale bytes (llama.cpp get_scale_min_k4): sub-blocks 0-3 take the low 6 bits of bytes 0-3
    # (scale) and 4-7 (min); 4-7 take the nibbles of bytes 8-11 plus the top 2 bits of 0-3 / 4-7.
    lo, hi, mix = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # [rows, sb, 8]
    mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    # 128 code bytes as 4 chunks of 32: sub-block 2c is chunk c's low nibbles, 2c+1 its high ones.
    qs = low.reshape(rows, sb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, sb, 8, 32)
    if fifth is not None:
        qh = fifth.reshape(rows, sb, 1, 32)
        q = q | (torch.cat([(qh >> j) & 1 for j in range(8)], dim=2) << 4)
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    return (scale * q.float() - offset).reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    rows, sb = b.shape[:2]
    # Low 4 bits: 2 halves of 64 bytes, each giving 4 chunks of 32 codes (low nibbles of bytes
    # 0-31, of 32-63, then the high nibbles of each); high 2 bits: 2 halves of 32 bytes, bit
    # pairs 0-1, 2-3, 4-5, 6-7 for the same 4 chunks.
    ql = b[..., 0:128].reshape(rows, sb, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(rows, sb, 8, 32)
    qh = b[..., 128:192].reshape(rows, sb, 2, 1, 32)
    qh = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=3).reshape(rows, sb, 8, 32)
    q = (ql | (qh << 4)).float() - 32  # -32..31, exact
    sc = b[..., 192:208].view(torch.int8).float()  # [rows, sb, 16]
    d = _f16(b[..., 208:210])
    scale = (d * sc).unsqueeze(-1)
    return (scale * q.reshape(rows, sb, 16, 16)).reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    rows, sb = b.shape[:2]
    d = _f16(b[..., 0:2])  # [rows, sb, 1]
    high = b[..., 2].int() | (b[..., 3].int() << 8)  # scales_h, little-endian
    high = (high.unsqueeze(-1) >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 3  # [rows, sb, 8]
    low = b[..., 4:8].unsqueeze(-1)
    low = torch.cat([low & 0x0F, low >> 4], dim=-1).reshape(rows, sb, 8)  # sub-block j: nibble j % 2 of byte j / 2
    scale = d * ((low.int() | (high << 4)) - 32).float()  # [rows, sb, 8], exact
    qs = b[..., 8:136].reshape(rows, sb, 8, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [rows, sb, 8, 32]: low nibbles weights 0-15, high 16-31
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=b.device)[codes.long()]
    return (scale.unsqueeze(-1) * values).reshape(rows, sb * WEIGHTS_PER_BLOCK)


# ---- The lattice i-quants --------------------------------------------------------------------------
# Group r (0..31) of a super-block is weights 8r .. 8r + 8; each decoder below gives, per group, the
# codebook rows [rows, sb, 32, 8] (magnitudes, or IQ1's -1 / 0 / 1), and the per-group scale.

_GRIDS = {16: "IQ2_XXS", 17: "IQ2_XS", 22: "IQ2_S", 18: "IQ3_XXS", 21: "IQ3_S", 19: "IQ1_S", 29: "IQ1_S"}


@functools.lru_cache(maxsize=None)
def _grid_values(ggml_type: int) -> tuple:
    """The type's codebook as nested tuples of floats (a constant torch.compile can trace)."""
    cls = getattr(gguf_quants, _GRIDS[ggml_type])
    cls.init_grid()
    return tuple(map(tuple, np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape).tolist()))


def _grid(ggml_type: int, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (any shape, int64) of the type's codebook, float32 [..., entry width]."""
    return torch.tensor(_grid_values(ggml_type), dtype=torch.float32, device=index.device)[index]


def _u16(b: torch.Tensor, lo: int, count: int) -> torch.Tensor:
    """int64 [..., count] of the little-endian uint16 at bytes lo, lo + 2, ... of b."""
    w = b[..., lo:lo + 2 * count].long()
    return w[..., 0::2] | (w[..., 1::2] << 8)


def _u32(b: torch.Tensor, lo: int, count: int) -> torch.Tensor:
    w = _u16(b, lo, 2 * count)
    return w[..., 0::2] | (w[..., 1::2] << 16)


def _sign_bits(sign_bytes: torch.Tensor) -> torch.Tensor:
    """+1 / -1 float32 [..., 8]: bit i of each sign byte set -> weight i negative."""
    bits = (sign_bytes.long().unsqueeze(-1) >> torch.arange(8, device=sign_bytes.device)) & 1
    return 1.0 - 2.0 * bits.float()


def _even_sign_bytes(index7: torch.Tensor) -> torch.Tensor:
    """The sign byte of 7-bit sign indices: bit 7 makes the count of set bits even (llama.cpp's
    ksigns_iq2xs)."""
    p = index7 ^ (index7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return index7 | ((p & 1) << 7)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 2n] of the nibbles of bytes [..., n], the low nibble of each byte first."""
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def _signed_groups(ggml_type: int, index: torch.Tensor, sign_bytes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weights [rows, sb * 256] of IQ2 groups: codebook rows `index` [rows, sb, 32], sign bytes [rows, sb,
    32], scales [rows, sb, 32]."""
    rows, sb = index.shape[:2]
    w = scale.unsqueeze(-1) * _grid(ggml_type, index) * _sign_bits(sign_bytes)
    return w.reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])  # [rows, sb, 1]
    sub = b[..., 2:66].reshape(*b.shape[:2], 8, 8)  # sub-block j: 4 index bytes, then a uint32
    aux = _u32(sub, 4, 1)  # [rows, sb, 8, 1]
    scale = d.unsqueeze(-1) * (0.5 + (aux >> 28).float()) * 0.25
    signs = _even_sign_bytes((aux >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127)  # [rows, sb, 8, 4]
    index = sub[..., 0:4].long()
    return _signed_groups(16, index.flatten(2), signs.flatten(2), scale.expand(-1, -1, -1, 4).flatten(2))


def _iq2_scales(d: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S: d*(0.5 + l)*0.25 per group [rows, sb, 32] from 8 bytes of 4-bit scales (one per
    16 weights, low nibble first)."""
    return (d * (0.5 + _nibbles(scale_bytes).float()) * 0.25).repeat_interleave(2, dim=-1)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    qs = _u16(b, 2, 32)  # [rows, sb, 32]: 9-bit index | 7-bit sign index << 9
    scale = _iq2_scales(_f16(b[..., 0:2]), b[..., 66:74])
    return _signed_groups(17, qs & 511, _even_sign_bytes(qs >> 9), scale)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    high = (b[..., 66:74].long().unsqueeze(-1) >> torch.arange(0, 8, 2, device=b.device)) & 3  # [rows, sb, 8, 4]
    index = b[..., 2:34].long() | (high.flatten(2) << 8)
    scale = _iq2_scales(_f16(b[..., 0:2]), b[..., 74:82])
    return _signed_groups(22, index, b[..., 34:66], scale)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    rows, sb = b.shape[:2]
    d = _f16(b[..., 0:2])
    aux = _u32(b, 66, 8)  # [rows, sb, 8]: per sub-block 4 x 7-bit sign indices, the scale in bits 28-31
    scale = (d * (0.5 + (aux >> 28).float()) * 0.5).repeat_interleave(4, dim=-1)  # [rows, sb, 32]
    signs = _even_sign_bytes((aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127)
    values = _grid(18, b[..., 2:66].long()).reshape(rows, sb, 32, 8)  # group r: entries 2r, 2r + 1
    w = scale.unsqueeze(-1) * values * _sign_bits(signs.flatten(2))
    return w.reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    rows, sb = b.shape[:2]
    d = _f16(b[..., 0:2])
    ninth = (b[..., 66:74].long().unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1  # [rows, sb, 8, 8]
    index = b[..., 2:66].long() | (ninth.flatten(2) << 8)  # [rows, sb, 64]
    scale = (d * (1 + 2 * _nibbles(b[..., 106:110]).float())).repeat_interleave(4, dim=-1)  # [rows, sb, 32]
    values = _grid(21, index).reshape(rows, sb, 32, 8)
    w = scale.unsqueeze(-1) * values * _sign_bits(b[..., 74:106])
    return w.reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _offset_groups(index: torch.Tensor, negative: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weights [rows, sb * 256] of IQ1 groups: scale * (codebook row + offset), offset -1/8 where
    `negative`, else +1/8; all [rows, sb, 32]."""
    rows, sb = index.shape[:2]
    delta = torch.where(negative, -0.125, 0.125).unsqueeze(-1)
    w = scale.unsqueeze(-1) * (_grid(19, index) + delta)
    return w.reshape(rows, sb * WEIGHTS_PER_BLOCK)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    qh = _u16(b, 34, 8)  # [rows, sb, 8]: per sub-block 4 x 3 index bits, scale bits 12-14, offset sign bit 15
    top = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    index = b[..., 2:34].long() | (top.flatten(2) << 8)
    scale = (d * (2 * ((qh >> 12) & 7) + 1).float()).repeat_interleave(4, dim=-1)
    negative = ((qh & 0x8000) != 0).repeat_interleave(4, dim=-1)
    return _offset_groups(index, negative, scale)


def iq1m_d_bits(b: torch.Tensor) -> torch.Tensor:
    """int64 [...] of the f16 bits of IQ1_M's super-block scale: the top nibbles of the 4 uint16 of
    its scales (bytes 48-55), the first one lowest."""
    words = _u16(b, 48, 4)
    return ((words >> 12) << torch.tensor([0, 4, 8, 12], device=b.device)).sum(-1)


def _f16_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] of f16 bit patterns int64 [...]."""
    bits = bits.unsqueeze(-1)
    return _f16(torch.cat([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8))


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    d = _f16_of_bits(iq1m_d_bits(b))  # [rows, sb, 1]
    nib = _nibbles(b[..., 32:48]).long()  # [rows, sb, 32]: 3 index bits, the offset's sign
    index = b[..., 0:32].long() | ((nib & 7) << 8)
    ls = (_u16(b, 48, 4).unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7  # [rows, sb, 4, 4]
    scale = (d * (2 * ls.flatten(2) + 1).float()).repeat_interleave(2, dim=-1)
    return _offset_groups(index, (nib & 8) != 0, scale)


_DECODERS = {10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k, 14: _q6_k, 23: _iq4_xs, 16: _iq2_xxs, 17: _iq2_xs,
             22: _iq2_s, 18: _iq3_xxs, 21: _iq3_s, 19: _iq1_s, 29: _iq1_m}
_NAMES = {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
          19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M"}  # by id


def f16_scales(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [..., n] of the float16 super-block scales (d, and dmin where the type has one) of
    blocks uint8 [..., BLOCK_BYTES[ggml_type]]."""
    ggml_type = int(ggml_type)
    if ggml_type == IQ1_M:
        return _f16_of_bits(iq1m_d_bits(blocks))
    return _f16(blocks[..., F16_SCALE_BYTES[ggml_type]])


def set_f16_scales(blocks: torch.Tensor, ggml_type: int, values: torch.Tensor) -> None:
    """Writes float16 super-block scales values [..., n] (as f16_scales reads them) into blocks uint8
    [..., BLOCK_BYTES[ggml_type]], in place."""
    ggml_type = int(ggml_type)
    bits = values.to(torch.float16).contiguous().view(torch.int16).long() & 0xFFFF
    if ggml_type == IQ1_M:  # the top nibbles of the 4 scale uint16 (bytes 49, 51, 53, 55), lowest first
        for u in range(4):
            byte = blocks[..., 49 + 2 * u].long()
            blocks[..., 49 + 2 * u] = ((byte & 0x0F) | (((bits[..., 0] >> (4 * u)) & 0xF) << 4)).to(torch.uint8)
        return
    pairs = torch.stack([bits & 0xFF, bits >> 8], dim=-1).flatten(-2).to(torch.uint8)
    blocks[..., F16_SCALE_BYTES[ggml_type]] = pairs


def dequantize_rows(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Rows of W as float32 [rows, K] from their blocks uint8 [rows, K/256 * block_bytes] (a row
    slice of what gguf_qmm takes), on the blocks' device. ggml_type: a key of BLOCK_BYTES."""
    ggml_type = int(ggml_type)
    if ggml_type not in _DECODERS:
        types = ", ".join(f"{t} ({name})" for t, name in _NAMES.items())
        raise ValueError(f"dequantize_rows: ggml_type must be one of {types}, got {ggml_type}")
    block_bytes = BLOCK_BYTES[ggml_type]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block_bytes != 0:
        raise ValueError(f"dequantize_rows: blocks must be uint8 [rows, K/256 * {block_bytes}], got "
                         f"{blocks.dtype} of shape {list(blocks.shape)}")
    b = blocks.reshape(blocks.shape[0], blocks.shape[1] // block_bytes, block_bytes)
    return _DECODERS[ggml_type](b)
