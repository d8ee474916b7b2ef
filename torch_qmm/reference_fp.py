"""Exact reference of MLX's floating-point quantization modes (mxfp4, nvfp4, mxfp8): pure torch.

MLX's quantize needs w.numel() to be a multiple of 32 (it packs the whole tensor in blocks of
32 codes), so it rejects e.g. a [1, 16] nvfp4 weight; this reference packs row by row and accepts
it.

Every value is carried in float64 and rounded to a narrower dtype exactly where MLX's CPU path
rounds, so the results equal ``mlx.core.quantize`` / ``mlx.core.dequantize`` (mlx 0.32.4, CPU)
bit for bit. Correctly rounded float64 results of + - * / rounded once more to float32, float16
or bfloat16 equal the correctly rounded narrow result (float64 carries more than twice the bits),
so the narrow arithmetic is reproduced without relying on torch's half-precision kernels.

Modes (one group of ``group_size`` consecutive values along the last axis shares one scale byte;
there are no biases; MLX accepts only these group sizes and bit widths):

    mode    element  scale  group  bits  element max
    mxfp4   e2m1     e8m0   32     4     6
    nvfp4   e2m1     e4m3   16     4     6
    mxfp8   e4m3     e8m0   32     8     448

Element and scale codecs:
    e2m1  sign | 2 exponent bits | 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.
    e4m3  the OCP/NVIDIA "fn" byte: sign | 4 exponent bits (bias 7) | 3 mantissa bits, subnormals
          m * 2^-9, no infinities, 0x7F / 0xFF NaN, largest finite value 448 (0x7E).
    e8m0  an unsigned exponent byte b meaning 2^(b - 127); MLX decodes b = 255 as 2^128 (inf in
          float32/bfloat16), not NaN.

Quantization, as MLX's CPU build does it (all arithmetic in w's dtype unless said otherwise):
    amax = max |w| over the group.
    mxfp4/mxfp8: s = amax / element_max (rounded to w's dtype); n = ceil(log2(s)) computed
        exactly (s an exact power of two gives its own exponent), n = 0 when s == 0; the scale
        byte is (n + 127) mod 256 (MLX does not clamp: a group whose s is below 2^-127, i.e.
        float32/bfloat16 weights below about 3.5e-38, wraps to a byte from 233 to 255 that
        dequantizes to a huge scale); each element is q = w / 2^n rounded to w's dtype.
    nvfp4: s = amax / 6 in w's dtype; the scale byte is e4m3(s); each element is
        q = w / e4m3_value(byte) in w's dtype, then carried in float32. With a global scale g
        (float32), s and q are multiplied (in float32) by enc = 448 * 6 / g and dequantize
        multiplies by g / (448 * 6). A scale byte of 0 (amax / 6 at most 2^-10) gives q = +-inf or
        NaN, which encodes as code 0: the group dequantizes to zeros.
    e2m1 element: the nearest of the 16 table values, distances |q - v| computed in w's dtype
        (float32 for nvfp4); ties go to the first table entry, i.e. to the smaller magnitude
        (0.25 -> 0, 0.75 -> 0.5, 1.25 -> 1, 5 -> 4) and -0 / small negative values to code 0
        (+0); beyond +-6 saturates to +-6; inf / NaN quotients give code 0.
    e4m3 element (and the nvfp4 scale): round to nearest even on the 3 mantissa bits, subnormals
        on the 2^-9 grid; |x| >= 448, inf and NaN saturate to 0x7E / 0xFE (+-448, x's sign bit), so
        the encoder never emits the NaN pattern.

Dequantization: the element value (exact in every output dtype) times the group scale, where the
e8m0 scale 2^(b - 127) and the product are each rounded to the output dtype (bfloat16 unless
asked otherwise): in float16 scales of 2^-25 and below become 0 and 2^16 and above inf.

MLX's Metal kernels (its fp quantized kernels and fp4 / fp8 types; no Apple GPU here to check
them) differ from the CPU path above, which is the one this module matches and CI checks:
    - all arithmetic is float32 whatever w's dtype, and elements are w * (1 / scale) rather than
      w / scale (the same for e8m0 scales, not always for nvfp4's e4m3 scales);
    - the e8m0 exponent is also the smallest power of two >= s, but computed as round(log2(s))
      clamped to [-127, 127] and then raised by one where 2^n < s and the byte is below 254: a
      zero group gets byte 0 (CPU: 127), s <= 2^-127 gives byte 0 (CPU: a wrapped byte), and
      s > 2^127 gives byte 254 (CPU: 255);
    - e2m1 rounds to nearest even at the midpoints (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
      2.5 -> 2, 3.5 -> 4, 5 -> 4; the CPU's ties-to-smaller differ at 0.75, 1.75 and 3.5), keeps
      the sign of -0 and small negatives (code 8) and maps NaN to code 7 (6.0);
    - the e4m3 encoder in the source read saturates only from |x| >= 480, so 464 < |x| < 480
      encodes 0x7F (NaN): an nvfp4 group whose amax / 6 falls there gets a NaN scale (the CPU
      build gives 448). That source's CPU encoder saturates from 480 too, unlike the mlx 0.32.4
      CPU build tested here, so the 0.32.4 Metal encoder may already saturate from 448. MX
      elements never get there since their scale is rounded up;
    - dequantization multiplies scale * value in float32 and rounds once to the output dtype
      (the CPU rounds the e8m0 scale to the output dtype first: float16 differs at tiny scales).

Non-finite weights: MLX quantizes them without complaint into codes that do not reproduce them
(the NaN / inf is lost and its group's other values are garbled); this reference refuses them with
ValueError, as torch_qmm's affine quantize does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import pack, unpack

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FpMode:
    """One fp quantization mode: its element and scale codecs, group size and bits per element."""

    name: str
    element: str  # "e2m1" or "e4m3"
    scale: str  # "e8m0" or "e4m3"
    group_size: int
    bits: int
    element_max: float


MODES = {
    "mxfp4": FpMode("mxfp4", "e2m1", "e8m0", 32, 4, 6.0),
    "nvfp4": FpMode("nvfp4", "e2m1", "e4m3", 16, 4, 6.0),
    "mxfp8": FpMode("mxfp8", "e4m3", "e8m0", 32, 8, 448.0),
}

# nvfp4's global-scale encoding constant: the largest e4m3 value times the largest e2m1 value.
NVFP4_GLOBAL_SCALE_RANGE = 448.0 * 6.0

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp_mode(mode: str, group_size: int | None = None, bits: int | None = None) -> FpMode:
    """The mode's parameters; group_size / bits default to the mode's and must equal them (as in MLX)."""
    if mode not in MODES:
        raise ValueError(f"argument 'mode' must be one of {tuple(MODES)}, got {mode!r}")
    spec = MODES[mode]
    if group_size is not None and group_size != spec.group_size:
        raise ValueError(f"argument 'group_size' must be {spec.group_size} for mode {mode!r}, got {group_size}")
    if bits is not None and bits != spec.bits:
        raise ValueError(f"argument 'bits' must be {spec.bits} for mode {mode!r}, got {bits}")
    return spec


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values rounded (to nearest even) to `dtype`, carried on as float64."""
    return t.to(dtype).to(torch.float64)


# ---- element and scale codecs -------------------------------------------------------------------


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (any integer tensor, values 0..15) -> float64 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=codes.device)
    return table[codes.to(torch.int64)]


def e2m1_encode(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 q -> int64 e2m1 codes: nearest table value, distances rounded to `dtype`, first on ties."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=q.device)
    distance = _round(q.unsqueeze(-1) - table, dtype).abs()
    # Where q is inf or NaN every distance is inf or NaN: code 0 (torch.argmin also returns the
    # first index then, but this states it).
    codes = distance.argmin(-1)
    return torch.where(q.isfinite(), codes, torch.zeros_like(codes))


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (values 0..255) -> float64 values; 0x7F and 0xFF are NaN."""
    c = codes.to(torch.int64)
    exponent = (c >> 3) & 0xF
    mantissa = (c & 7).to(torch.float64)
    normal = (8 + mantissa) * torch.exp2((exponent - 10).to(torch.float64))
    subnormal = mantissa * 2.0**-9
    magnitude = torch.where(exponent == 0, subnormal, normal)
    magnitude = torch.where((c & 0x7F) == 0x7F, torch.full_like(magnitude, float("nan")), magnitude)
    return torch.where((c & 0x80) != 0, -magnitude, magnitude)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float64 x (values of a float32/float16/bfloat16 tensor) -> int64 e4m3 bytes, MLX's rounding.

    Round to nearest even; |x| >= 448, inf and NaN saturate to 0x7E (448) with x's sign bit.
    """
    a = x.abs()
    sign = torch.signbit(x).to(torch.int64) << 7
    # Below 2^-6 (subnormals): the 2^-9 grid; a value rounding up to 2^-6 gives code 8, the first normal.
    low = torch.round(a * 2.0**9)
    mantissa, exponent = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))  # a = m * 2^e, m in [0.5, 1)
    # Rounding the mantissa up to 8 carries into the exponent field: (E * 8 + 8) == (E + 1) * 8.
    high = (exponent.to(torch.float64) - 1 + 7) * 8 + torch.round((2 * mantissa - 1) * 8)
    code = torch.where(a < 2.0**-6, low, high)
    saturate = ~(a < 448.0)  # also NaN
    code = torch.where(saturate, torch.full_like(code, 0x7E), code)
    return code.to(torch.int64) | sign


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (values 0..255) -> float64 2^(b - 127)."""
    return torch.exp2(codes.to(torch.float64) - 127)


def e8m0_exponent(s: torch.Tensor) -> torch.Tensor:
    """float64 s >= 0 -> int64 n = ceil(log2(s)) exactly, and n = 0 where s == 0."""
    mantissa, exponent = torch.frexp(torch.where(s > 0, s, torch.ones_like(s)))  # s = m * 2^e
    n = torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int64)
    return torch.where(s > 0, n, torch.zeros_like(n))


def e8m0_encode(n: torch.Tensor) -> torch.Tensor:
    """int64 exponents -> e8m0 bytes (n + 127) mod 256, wrapping as MLX does when out of range."""
    return (n + 127) & 0xFF


# ---- quantize / dequantize / qmm ----------------------------------------------------------------


def _check_global_scale(spec: FpMode, global_scale) -> torch.Tensor | None:
    if global_scale is None:
        return None
    if spec.name != "nvfp4":
        raise ValueError(f"argument 'global_scale' is only supported for mode 'nvfp4', got mode {spec.name!r}")
    if not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError("argument 'global_scale' must be a float32 tensor with one element")
    return global_scale.reshape(()).to(torch.float64)


def quantize_fp(
    w: torch.Tensor,
    mode: str,
    group_size: int | None = None,
    bits: int | None = None,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``mlx.core.quantize(w, group_size, bits, mode=mode)`` for the fp modes (CPU path).

    Args:
        w: float32/float16/bfloat16 [..., K], at least 2-D, K a multiple of the group size; finite.
        global_scale: nvfp4 only, a float32 tensor of one element (MLX's ``global_scale``).

    Returns:
        (wq uint32 [..., K * bits / 32], scales uint8 [..., K / group_size]); within each uint32
        word element k sits at bits [k * bits, (k + 1) * bits), as in the affine format.
    """
    spec = fp_mode(mode, group_size, bits)
    gs = _check_global_scale(spec, global_scale)
    if not isinstance(w, torch.Tensor) or w.dtype not in INPUT_DTYPES:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"argument 'w' must be a float32, float16 or bfloat16 tensor, got {got}")
    if w.dim() < 2:
        raise ValueError(f"argument 'w' must have at least 2 dimensions, got shape {tuple(w.shape)}")
    if w.shape[-1] % spec.group_size != 0:
        raise ValueError(
            f"argument 'w' must have a last dimension divisible by group_size={spec.group_size}, got {w.shape[-1]}"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError("argument 'w' must be finite (NaN or Inf found)")

    dtype = w.dtype
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    g = w.reshape(-1, k // spec.group_size, spec.group_size).to(torch.float64)
    s = _round(g.abs().amax(-1, keepdim=True) / spec.element_max, dtype)
    if spec.scale == "e8m0":
        n = e8m0_exponent(s)
        scale_codes = e8m0_encode(n)
        q = _round(g / torch.exp2(n.to(torch.float64)), dtype)
        distance_dtype = dtype
    else:
        # nvfp4: the scale is multiplied by a float32 encoding factor (1 without a global scale),
        # which also carries the elements in float32.
        enc = 1.0 if gs is None else _round(NVFP4_GLOBAL_SCALE_RANGE / gs, torch.float32)
        s = _round(s * enc, torch.float32)
        scale_codes = e4m3_encode(s)
        q = _round(_round(g / e4m3_decode(scale_codes), dtype) * enc, torch.float32)
        distance_dtype = torch.float32
    if spec.element == "e2m1":
        codes = e2m1_encode(q, distance_dtype)
    else:
        codes = e4m3_encode(q)
    wq = pack(codes.reshape(-1, k), spec.bits).reshape(lead + (k * spec.bits // 32,))
    scales = scale_codes.reshape(lead + (k // spec.group_size,)).to(torch.uint8)
    return wq, scales


def _check_packed(wq: torch.Tensor, scales: torch.Tensor, spec: FpMode) -> None:
    if not isinstance(wq, torch.Tensor) or wq.dtype != torch.uint32 or wq.dim() < 2:
        raise ValueError("argument 'wq' must be a uint32 tensor with at least 2 dimensions")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        raise ValueError("argument 'scales' must be a uint8 tensor")
    cols = wq.shape[-1] * 32 // spec.bits
    expected = tuple(wq.shape[:-1]) + (cols // spec.group_size,)
    if cols % spec.group_size != 0 or tuple(scales.shape) != expected:
        raise ValueError(
            f"argument 'scales' must have shape {expected} for wq of shape {tuple(wq.shape)} in mode "
            f"{spec.name!r}, got {tuple(scales.shape)}"
        )


def dequantize_fp(
    wq: torch.Tensor,
    scales: torch.Tensor,
    mode: str,
    group_size: int | None = None,
    bits: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``mlx.core.dequantize(wq, scales, mode=mode, dtype=dtype)`` (CPU path).

    dtype: float32/float16/bfloat16 (MLX's default bfloat16), or float64 for the exact values
    (scale times element without any rounding). With a global scale MLX's product is float32
    whatever dtype says; so is this one's.
    """
    spec = fp_mode(mode, group_size, bits)
    gs = _check_global_scale(spec, global_scale)
    _check_packed(wq, scales, spec)
    if dtype not in INPUT_DTYPES + (torch.float64,):
        raise ValueError(f"argument 'dtype' must be float32, float16, bfloat16 or float64, got {dtype}")

    lead, words = tuple(wq.shape[:-1]), wq.shape[-1]
    cols = words * 32 // spec.bits
    codes = unpack(wq.reshape(-1, words), spec.bits)
    values = e2m1_decode(codes) if spec.element == "e2m1" else e4m3_decode(codes)
    values = values.reshape(-1, cols // spec.group_size, spec.group_size)
    s = scales.reshape(-1, cols // spec.group_size, 1)
    if spec.scale == "e8m0":
        scale = _round(e8m0_decode(s), dtype)
    else:
        scale = e4m3_decode(s)
    if gs is not None:
        # MLX divides the float32 global scale by 2688 and multiplies in float32.
        out_dtype = torch.float32 if dtype != torch.float64 else dtype
        scale = _round(scale * _round(gs / NVFP4_GLOBAL_SCALE_RANGE, out_dtype), out_dtype)
    else:
        out_dtype = dtype
    w = _round(values * scale, out_dtype)
    return w.reshape(lead + (cols,)).to(out_dtype)


def qmm_fp(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    mode: str,
    group_size: int | None = None,
    bits: int | None = None,
    transpose: bool = True,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 y[..., N] = x[..., K] @ W.T (transpose=True, W [N, K]) or x @ W (W [K, N]).

    W is the exact float64 dequantization (no output-dtype rounding), wq/scales 2-D.
    """
    w = dequantize_fp(wq, scales, mode, group_size, bits, dtype=torch.float64, global_scale=global_scale)
    xd = x.to(torch.float64)
    return xd @ (w.T if transpose else w)


def qmm_fp_magnitude(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    mode: str,
    group_size: int | None = None,
    bits: int | None = None,
    transpose: bool = True,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 |x| @ |W|: the size of the terms of the product, for error bounds (no biases here)."""
    w = dequantize_fp(wq, scales, mode, group_size, bits, dtype=torch.float64, global_scale=global_scale).abs()
    return x.to(torch.float64).abs() @ (w.T if transpose else w)
