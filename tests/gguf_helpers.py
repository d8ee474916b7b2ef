"""Test data for GGUF: valid random K-quant (and i-quant) blocks and GGUF files written with gguf.GGUFWriter.

gguf-py cannot quantize to Q2_K / Q3_K / Q4_K / Q5_K / Q6_K or the i-quants, so their blocks are random bytes
with realistic f16 super-block scales: every byte pattern is a valid block, and gguf.quants.dequantize decodes
it.
"""

from __future__ import annotations


import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
Q2_K, Q3_K = GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K
IQ4_XS = GGMLQuantizationType.IQ4_XS
IQ1_S, IQ1_M = GGMLQuantizationType.IQ1_S, GGMLQuantizationType.IQ1_M
IQ2_XXS, IQ2_XS, IQ2_S = GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ2_XS, GGMLQuantizationType.IQ2_S
IQ3_XXS, IQ3_S = GGMLQuantizationType.IQ3_XXS, GGMLQuantizationType.IQ3_S
# The i-quants whose groups of 8 weights are codebook entries.
LATTICE_TYPES = (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)
# The types gguf_qmm multiplies natively (torch_qmm.interop.gguf_types.NATIVE_TYPES, listed here
# independently; tests/test_gguf_qmm.py compares).
NATIVE_K_TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) + LATTICE_TYPES
# Those with a zero weight in every sub-block (one_hot_k_blocks): IQ4_XS's 16 values and the
# lattice codebooks (IQ2 / IQ3 magnitudes >= 1, IQ1's values +-1/8 off -1, 0, 1) have no 0.
ONE_HOT_TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)


def random_k_blocks(ggml_type, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, k/256 * block_bytes] of valid blocks with small finite f16 scales."""
    ggml_type = GGMLQuantizationType(ggml_type)
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n, k // 256, block_bytes), dtype=np.uint8)
    if ggml_type in (Q4_K, Q5_K):  # d, dmin at bytes 0..3
        blocks[..., 0:2] = rng.uniform(2e-4, 4e-3, (n, k // 256, 1)).astype("<f2").view(np.uint8)
        blocks[..., 2:4] = rng.uniform(1e-4, 2e-3, (n, k // 256, 1)).astype("<f2").view(np.uint8)
    elif ggml_type == Q6_K:  # d at bytes 208..209
        blocks[..., 208:210] = rng.uniform(1e-4, 2e-3, (n, k // 256, 1)).astype("<f2").view(np.uint8)
    elif ggml_type == Q2_K:  # d, dmin at bytes 80..83
        blocks[..., 80:82] = rng.uniform(2e-3, 4e-2, (n, k // 256, 1)).astype("<f2").view(np.uint8)
        blocks[..., 82:84] = rng.uniform(1e-3, 2e-2, (n, k // 256, 1)).astype("<f2").view(np.uint8)
    elif ggml_type == Q3_K:  # d at bytes 108..109
        blocks[..., 108:110] = rng.uniform(1e-3, 2e-2, (n, k // 256, 1)).astype("<f2").view(np.uint8)
    elif ggml_type == IQ4_XS:  # d at bytes 0..1, normal float16 (times (l - 32) * value: up to 32 * 127)
        blocks[..., 0:2] = rng.uniform(6.2e-5, 1.5e-4, (n, k // 256, 1)).astype("<f2").view(np.uint8)
    elif ggml_type in LATTICE_TYPES:  # d times a scale up to 31 times a codebook value up to 62
        set_lattice_d(blocks, ggml_type, rng.uniform(6.2e-5, 4e-4, (n, k // 256)))
    else:
        raise ValueError(f"no random generator for {ggml_type.name}")
    return blocks.reshape(n, -1)



def set_lattice_d(blocks: np.ndarray, ggml_type, d) -> None:
    """Writes the f16 super-block scales d [n, sb] into lattice i-quant blocks uint8 [n, sb, bytes]:
    bytes 0..1, or for IQ1_M the top nibbles of its 4 scale uint16 (bytes 49, 51, 53, 55), lowest
    nibble first."""
    bits = np.asarray(d, dtype="<f2")
    if GGMLQuantizationType(ggml_type) != IQ1_M:
        blocks[..., 0:2] = bits[..., None].view(np.uint8)
        return
    bits = bits.view(np.uint16).astype(np.int64)
    for u in range(4):
        byte = blocks[..., 49 + 2 * u]
        blocks[..., 49 + 2 * u] = (byte & 0x0F) | (((bits >> (4 * u)) & 0xF) << 4)


def random_iq4_blocks(ggml_type, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, k / weights per block * block_bytes] of valid IQ4_NL / IQ4_XS blocks (gguf-py
    cannot quantize them): random codes and sub-block scales, a small finite f16 d at bytes 0..1,
    for weights of magnitude ~0.05."""
    ggml_type = GGMLQuantizationType(ggml_type)
    per_block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)
    high = 1e-3 if ggml_type == GGMLQuantizationType.IQ4_NL else 4e-5  # IQ4_XS: times l - 32, up to 32
    blocks[..., 0:2] = rng.uniform(high / 4, high, (n, k // per_block, 1)).astype("<f2").view(np.uint8)
    return blocks.reshape(n, -1)


def exact_k_blocks(ggml_type, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks whose weights are small multiples of a power of two, so that x @ W.T
    for x of exact_x is exact in float32 (every product and partial sum a float32 integer multiple
    of one unit below 2^24): a kernel's result must be that sum rounded once to the output dtype.

    Q4_K: d = 2^-4, dmin = 2^-6, the 6-bit scales and mins kept to 0..15 (the bytes holding their
    low bits masked to 4 bits; the high bits of sub-blocks 4-7 come from the same bytes' bits 6-7,
    now 0): w = (4 sc q - m) / 64, |w| <= 900 / 64. Q6_K: d = 2^-4, the int8 sub-block scales in
    -8..7: w = sc (q - 32) / 16, |w| <= 256 / 16. Q2_K: d = 2^-4, dmin = 2^-6, any 4-bit scales and
    mins: w = (4 sc q - m) / 64, |w| <= 180 / 64. Q3_K: d = 2^-4, any 6-bit scales: w = sc (q - 4) / 16,
    |w| <= 128 / 16. Q5_K: as Q4_K (scales and mins 0..15), any fifth bits: |w| <= 1860 / 64.
    IQ4_XS: d = 2^-4, sub-block scales l - 32 in -4..3 (l = 28..35, both values of the high bits
    scales_h that give them): w = (l - 32) value / 16, |w| <= 508 / 16. The lattice i-quants: d = 2^-4,
    random codebook indices and signs; IQ2: 4-bit scales l in 0..3, w = (2l + 1) g / 128, |w| <= 7 * 43
    / 128; IQ3_XXS: l in 0..1, w = (2l + 1) g / 64, |w| <= 3 * 62 / 64; IQ3_S: l in 0..3, w = (2l + 1) g
    / 16, |w| <= 7 * 15 / 16; IQ1_S / IQ1_M: any 3-bit l, w = (2l + 1)(g +- 1/8) / 16, |w| <= 15 * 9 / 128.
    With exact_x and K <= 768 every partial sum stays below 2^24 units."""
    ggml_type = GGMLQuantizationType(ggml_type)
    blocks = random_k_blocks(ggml_type, n, k, rng).reshape(n, k // 256, -1)
    if ggml_type in (Q4_K, Q5_K):
        blocks[..., 0:2] = np.array([2.0**-4], "<f2").view(np.uint8)
        blocks[..., 2:4] = np.array([2.0**-6], "<f2").view(np.uint8)
        blocks[..., 4:12] &= 0x0F  # q[0..7]: scales / mins of sub-blocks 0-3, no high bits for 4-7
    elif ggml_type == Q2_K:
        blocks[..., 80:82] = np.array([2.0**-4], "<f2").view(np.uint8)
        blocks[..., 82:84] = np.array([2.0**-6], "<f2").view(np.uint8)
    elif ggml_type == Q3_K:
        blocks[..., 108:110] = np.array([2.0**-4], "<f2").view(np.uint8)
    elif ggml_type in LATTICE_TYPES:
        set_lattice_d(blocks, ggml_type, np.full(blocks.shape[:2], 2.0**-4))
        if ggml_type == IQ2_XXS:  # the scale: the top nibble of each sub-block's second uint32
            blocks[..., 9::8] &= 0x3F
        elif ggml_type == IQ2_XS:
            blocks[..., 66:74] &= 0x33
        elif ggml_type == IQ2_S:
            blocks[..., 74:82] &= 0x33
        elif ggml_type == IQ3_XXS:  # the top nibble of the uint32 at 66 + 4j
            blocks[..., 69::4] &= 0x1F
        elif ggml_type == IQ3_S:
            blocks[..., 106:110] &= 0x33
    elif ggml_type == IQ4_XS:
        blocks[..., 0:2] = np.array([2.0**-4], "<f2").view(np.uint8)
        ls = rng.integers(28, 36, size=(n, k // 256, 8))
        blocks[..., 4:8] = (ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)
        high = sum(((ls[..., j] >> 4) & 3).astype(np.uint16) << (2 * j) for j in range(8))
        blocks[..., 2:4] = high.astype("<u2")[..., None].view(np.uint8)
    else:
        blocks[..., 192:208] = (rng.integers(-8, 8, size=blocks[..., 192:208].shape).astype(np.int8)).view(np.uint8)
        blocks[..., 208:210] = np.array([2.0**-4], "<f2").view(np.uint8)
    return blocks.reshape(n, -1)


def q4k_every_scale_byte(blocks: np.ndarray, n: int) -> np.ndarray:
    """Q4_K blocks of n rows (one super-block each) whose 12 packed scale / min bytes sweep 0..255
    over the rows: every 6-bit scale and min, high bits included."""
    raw = blocks.reshape(n, 144).copy()
    raw[:, 4:16] = (np.arange(n)[:, None] * 7 + np.arange(12)[None, :] * 31) % 256
    return raw.reshape(n, -1)


def q6k_signed_scales_and_full_high_fields(blocks: np.ndarray, n: int) -> np.ndarray:
    """Q6_K blocks of n rows (two super-blocks each) with int8 sub-block scales of both signs
    (-128 included) and all four qh fields at their maximum in every third super-block."""
    raw = blocks.reshape(n * 2, 210).copy()
    raw[:, 192:208] = (np.arange(n * 2)[:, None] * 11 + np.arange(16)[None, :] * 17) % 256
    raw[::3, 128:192] = 0xFF
    return raw.reshape(n, -1)


def exact_x(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """float32 [m, k] of multiples of 1/8 in [-8, 8] (exact in float16 and bfloat16 too)."""
    return (rng.integers(-64, 65, size=(m, k)) / 8.0).astype(np.float32)



def one_hot_k_blocks(ggml_type, cols: list[int], k: int) -> np.ndarray:
    """Blocks of W [len(cols), k] with W[n, cols[n]] = 1 and every other weight 0, so that
    x @ W.T selects x[:, cols[n]]. Q4_K: d = 1, dmin = 0, every scale 1, codes 0 but one 1 (no
    offset: a kernel must carry x unrounded to the sum). Q5_K: as Q4_K, every fifth bit 0. Q6_K:
    d = 1, every scale 1, codes 32 (weight 0) but one 33 (kernels that hoist the -32 cancel sums of
    32 x here). Q2_K: d = 1, dmin = 0, every scale 1, codes 0 but one 1. Q3_K: d = 1, every scale 1
    (6-bit 33), codes 4 (weight 0: every high bit set) but one 5. Not IQ4_XS (ONE_HOT_TYPES): none
    of its values is 0."""
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in ONE_HOT_TYPES:
        raise ValueError(f"{ggml_type.name} has no zero weight: no one-hot blocks")
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = np.zeros((len(cols), k // 256, block_bytes), dtype=np.uint8)
    one = np.array([1.0], "<f2").view(np.uint8)
    for n, col in enumerate(cols):
        b, j = divmod(col, 256)
        if ggml_type in (Q4_K, Q5_K):
            blocks[n, :, 0:2] = one
            blocks[n, :, 4:8] = 1  # scales of sub-blocks 0-3 (mins 0)
            blocks[n, :, 12:16] = 1  # low bits of the scales of sub-blocks 4-7 (their mins 0)
            s, i = divmod(j, 32)
            qs = 16 if ggml_type == Q4_K else 48  # Q5_K: qh (bytes 16..47) 0
            blocks[n, b, qs + 32 * (s // 2) + i] |= 1 << (4 * (s % 2))
        elif ggml_type in (Q2_K, Q3_K):
            if ggml_type == Q2_K:
                blocks[n, :, 0:16] = 1  # scale 1, min 0
                blocks[n, :, 80:82] = one
                qs = 16
            else:
                blocks[n, :, 0:32] = 0xFF  # every code's high bit: q = 4
                blocks[n, :, 96:104] = 0x11  # low 4 bits 1 of every scale
                blocks[n, :, 104:108] = 0xAA  # top 2 bits 2: 6-bit 33, scale 1
                blocks[n, :, 108:110] = one
                qs = 32
            h, rest = divmod(j, 128)
            shift, i = divmod(rest, 32)
            blocks[n, b, qs + 32 * h + i] |= 1 << (2 * shift)
        else:
            blocks[n, :, 128:192] = 0xAA  # every code's high bits 2: q = 32
            blocks[n, :, 192:208] = 1
            blocks[n, :, 208:210] = one
            h, rest = divmod(j, 128)
            f, i = divmod(rest, 32)
            blocks[n, b, 64 * h + 32 * (f % 2) + i] |= 1 << (4 * (f // 2))
    return blocks.reshape(len(cols), -1)


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]], arch: str = "llama",
               metadata: dict | None = None, fields=()) -> None:
    """tensors: name -> (array, raw type or None for a float array stored as is); fields: more
    metadata as (key, value, GGUFValueType, array item type or None), e.g. a real file's tokenizer."""
    writer = GGUFWriter(str(path), arch)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, (array, raw_type) in tensors.items():
        if raw_type is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


from tolerance import assert_matches_reference  # noqa: E402,F401  (re-exported for the GGUF tests)
from cpu_features import HAS_AVX2, HAS_AVX512, HAS_BF16, HAS_VL, env_on, fma_first, subnormal_fields_on  # noqa: E402


def k_quant_terms(blocks: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray]:
    """The two terms of every weight of K-quant blocks [n, k/256 * block_bytes], each decoded by
    gguf.quants.dequantize from a copy of the blocks with the other term zeroed: Q4_K w = d*sc*q
    - dmin*m (terms d*sc*q and dmin*m), Q6_K w = d*sc*(q - 32) (terms d*sc*q and d*sc*32); Q2_K and
    Q5_K as Q4_K, Q3_K as Q6_K (w = d*sc*(q - 4)); IQ4_XS w = d*(l - 32)*value, as the byte code
    value + 128 less an offset 128: terms d*(l - 32)*(value + 128) and d*(l - 32)*128.
    Returns float64 (scaled, offset) [n, k] with w = scaled - offset."""
    from gguf import quants

    ggml_type = GGMLQuantizationType(ggml_type)
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    raw = blocks.reshape(blocks.shape[0], -1, block_bytes)
    w = quants.dequantize(blocks, ggml_type).astype(np.float64)
    cut = raw.copy()
    if ggml_type in (Q4_K, Q5_K, Q2_K):
        dmin = slice(82, 84) if ggml_type == Q2_K else slice(2, 4)
        cut[..., dmin] = 0  # dmin = 0: d*sc*q alone
        scaled = quants.dequantize(cut.reshape(blocks.shape), ggml_type).astype(np.float64)
        return scaled, scaled - w
    if ggml_type in (Q6_K, Q3_K):
        cut[..., 0:192 if ggml_type == Q6_K else 96] = 0  # every code 0: w = -32*d*sc (Q3_K: -4*d*sc)
        offset = -quants.dequantize(cut.reshape(blocks.shape), ggml_type).astype(np.float64)
        return w + offset, offset
    if ggml_type in LATTICE_TYPES:  # w = scale * q: no offset
        return w, np.zeros_like(w)
    if ggml_type == IQ4_XS:
        cut[..., 8:] = 0  # every code 0, value -127: w = -127*d*(l - 32)
        offset = -quants.dequantize(cut.reshape(blocks.shape), ggml_type).astype(np.float64) * 128 / 127
        return w + offset, offset
    raise ValueError(f"no terms for {ggml_type.name}")


def k_quant_magnitude(x: torch.Tensor, blocks, ggml_type) -> torch.Tensor:
    """float64 |x| @ (|scaled| + |offset|).T (k_quant_terms): the size of the terms a kernel adds.
    Kernels hoist the offset out of the dot product (d*sc*sum(q*x) - dmin*m*sum(x), and for Q6_K
    the sum of 32*x), so where the terms cancel (a Q6_K code near 32, a Q4_K min near the scaled
    code) the accumulation error is relative to this sum, not to |x| @ |w|.T (as
    torch_qmm.reference.qmm_magnitude for the affine format)."""
    raw = blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks
    scaled, offset = k_quant_terms(raw, ggml_type)
    terms = torch.from_numpy(np.abs(scaled) + np.abs(offset))
    return x.detach().cpu().double().abs() @ terms.T


# ---- gguf_qmm's CPU routes for Q4_K / Q6_K (csrc/cpu/gguf_chunked.h, gguf_qmm.cpp) ------------------
# For x in range (every |x| in [2^-98, 2^100], finite), three chunk families: the AVX-512 float32
# kernels up to GGUF_F32_MAX_ROWS rows (unless TORCH_QMM_CPU_NO_F32_CHUNKS=1), the AVX512_BF16
# ones up to GGUF_BF16_MAX_ROWS[type, bfloat16 terms of x] rows (unless TORCH_QMM_CPU_NO_BF16=1),
# the AVX2 ones up to GGUF_AVX2_MAX_ROWS rows (unless TORCH_QMM_CPU_NO_AVX2_CHUNKS=1); then the
# fused decode below 16 rows (cpu::kGemmMinRows), the GEMM from there. x out of range skips all
# three. The AVX-512 float32 kernels go first for float32 x (three terms), for Q6_K, for 16-bit x
# where cpu_features.fma_first(), and for float16 x where the float32 panel kernels take rows; else
# after the bfloat16 ones. The bfloat16 kernels yield to the
# AVX2 ones, where those serve, for float32 x and Q6_K, and where fma_first() serve no M unless
# the AVX-512 float32 kernels are stepped aside. The panel kernels (below) take groups of 16 rows
# from 14 rows on: inside the float32 family, and for bfloat16 x ahead of every family.
GGUF_BF16_MAX_ROWS = {(Q4_K, 3): 16, (Q4_K, 2): 32, (Q4_K, 1): 128, (Q6_K, 3): 2, (Q6_K, 2): 4, (Q6_K, 1): 32}
GGUF_F32_MAX_ROWS = 32  # cpu::kGgufF32MaxRows
GGUF_PANEL_MAX_ROWS = 128  # cpu::kGgufPanelMaxRows: the float32 family takes up to this many rows where
                           # the panel kernels take rows (all but the last 13 or fewer)
GGUF_AVX2_MAX_ROWS = 15  # cpu::kGgufAvx2MaxRows
GGUF_AVX2_NAMES = {Q2_K: "chunked/avx2-q2k", Q3_K: "chunked/avx2-q3k", Q4_K: "chunked/avx2-q4k", Q5_K: "chunked/avx2-q5k",
                   Q6_K: "chunked/avx2-q6k", IQ4_XS: "chunked/avx2-iq4xs"}
# The lattice i-quants' AVX2 kernel (LatticeGroups): one name per type, no subnormal-field variant.
LATTICE_AVX2_NAMES = {IQ2_XXS: "chunked/avx2-iq2xxs", IQ2_XS: "chunked/avx2-iq2xs", IQ2_S: "chunked/avx2-iq2s",
                      IQ3_XXS: "chunked/avx2-iq3xxs", IQ3_S: "chunked/avx2-iq3s", IQ1_S: "chunked/avx2-iq1s",
                      IQ1_M: "chunked/avx2-iq1m"}
# The same kernels with the code fields taken as the bits of subnormal floats (gguf_avx2.cpp,
# Fields<true>): where subnormal_fields_on(), for x with every nonzero |x| in [2^-57, 2^48), and for
# Q4_K only where the rows of x go in blocks of 4 and 1 (M % 4 < 2: its 2-row block is slower so).
GGUF_AVX2_SUBNORMAL_NAMES = {t: name + "-subnormal" for t, name in GGUF_AVX2_NAMES.items()}
SUBNORMAL_X_RANGE = (2.0**-57, 2.0**48)


def gguf_avx2_name(ggml_type, m: int, x_in_subnormal_range: bool = True) -> str:
    if subnormal_fields_on() and x_in_subnormal_range and (ggml_type != Q4_K or m % 4 < 2):
        return GGUF_AVX2_SUBNORMAL_NAMES[ggml_type]
    return GGUF_AVX2_NAMES[ggml_type]
GGUF_F32_NAMES = {Q4_K: "chunked/f32-q4k", Q6_K: "chunked/f32-q6k"}
# Within the AVX-512 float32 family, the panel kernels (csrc/cpu/gguf_panel.cpp; AVX-512 VL) take
# the whole groups of 16 rows of x and a last group of at least GGUF_PANEL_MIN_GROUP_ROWS rows
# (unless TORCH_QMM_CPU_NO_PANEL=1); the route is named after them where they take any row.
GGUF_PANEL_NAMES = {Q4_K: "chunked/f32-panel-q4k", Q6_K: "chunked/f32-panel-q6k"}
GGUF_PANEL_MIN_GROUP_ROWS = 14  # kPanelMinGroupRows, csrc/cpu/gguf_f32.cpp


def gguf_panel_rows(m: int) -> int:
    """The rows of a call of m rows (in the float32 family) that the panel kernels take."""
    if not HAS_VL or env_on("TORCH_QMM_CPU_NO_PANEL"):
        return 0
    last = m % 16
    return m - last + (last if last >= GGUF_PANEL_MIN_GROUP_ROWS else 0)


# bfloat16 x (one term) of 14+ rows: the bfloat16 panel kernels take gguf_panel_rows(m) rows ahead
# of every family where AVX512_BF16 serves and the bfloat16 products go first (not fma_first()).
GGUF_BF16_PANEL_NAMES = {Q4_K: "chunked/bf16x1-panel-q4k", Q6_K: "chunked/bf16x1-panel-q6k"}


def gguf_bf16_panel_serves(terms: int, m: int, x_in_range: bool = True) -> bool:
    return (terms == 1 and x_in_range and HAS_BF16 and m <= GGUF_PANEL_MAX_ROWS and gguf_panel_rows(m) > 0
            and not env_on("TORCH_QMM_CPU_NO_BF16") and not fma_first())


def gguf_f32_name(ggml_type, m: int) -> str:
    return GGUF_PANEL_NAMES[ggml_type] if gguf_panel_rows(m) > 0 else GGUF_F32_NAMES[ggml_type]


def expected_gguf_route(dtype, m: int, ggml_type, x_in_range: bool = True, x_in_subnormal_range: bool | None = None) -> str:
    """The route _gguf_cpu_route names for x [m, K] of `dtype` (float32 under precision "highest"),
    under the current environment. x_in_subnormal_range: None, as x_in_range."""
    terms = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)
    avx2 = x_in_range and 1 <= m <= GGUF_AVX2_MAX_ROWS and HAS_AVX2 and not env_on("TORCH_QMM_CPU_NO_AVX2_CHUNKS")
    sub_range = x_in_range if x_in_subnormal_range is None else x_in_subnormal_range
    if ggml_type in LATTICE_TYPES:  # the AVX2 kernel only, for x of any range (x is used as it is)
        lattice = 1 <= m <= GGUF_AVX2_MAX_ROWS and HAS_AVX2 and not env_on("TORCH_QMM_CPU_NO_AVX2_CHUNKS")
        return LATTICE_AVX2_NAMES[ggml_type] if lattice else "fused" if m < 16 else "gemm"
    if ggml_type in (Q2_K, Q3_K, Q5_K, IQ4_XS):  # AVX2 chunk kernels only
        return gguf_avx2_name(ggml_type, m, sub_range) if avx2 else "fused" if m < 16 else "gemm"
    if gguf_bf16_panel_serves(terms, m, x_in_range):
        return GGUF_BF16_PANEL_NAMES[ggml_type]
    f32_family = HAS_AVX512 and not env_on("TORCH_QMM_CPU_NO_F32_CHUNKS")
    f32 = x_in_range and f32_family and (1 <= m <= GGUF_F32_MAX_ROWS
                                         or (m <= GGUF_PANEL_MAX_ROWS and gguf_panel_rows(m) > 0))
    if f32 and (terms == 3 or ggml_type == Q6_K or fma_first() or (terms == 2 and gguf_panel_rows(m) > 0)):
        return gguf_f32_name(ggml_type, m)
    yields = (avx2 and (terms == 3 or ggml_type == Q6_K)) or (fma_first() and f32_family)
    if (x_in_range and HAS_BF16 and not env_on("TORCH_QMM_CPU_NO_BF16") and not yields
            and m <= GGUF_BF16_MAX_ROWS[ggml_type, terms]):
        return f"chunked/bf16x{terms}"
    if f32:
        return gguf_f32_name(ggml_type, m)
    if avx2:
        return gguf_avx2_name(ggml_type, m, sub_range)
    return "fused" if m < 16 else "gemm"
