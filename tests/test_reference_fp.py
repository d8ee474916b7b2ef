"""torch_qmm.reference_fp against mlx[cpu]: quantize word for word and scale byte for byte,
dequantize value for value (NaN equal to NaN, the sign of zero compared), for mxfp4, nvfp4, mxfp8.

MLX is the oracle here; nothing in torch_qmm/ imports it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from torch_qmm.reference_fp import MODES, dequantize_fp, quantize_fp, qmm_fp, qmm_fp_magnitude

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
MODE_NAMES = tuple(MODES)
BITS_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def to_mx(t: torch.Tensor):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    if t.dtype == torch.uint32:
        return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
    return mx.array(t.numpy())


def from_mx(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a.view(mx.int32))).view(torch.uint32)
    return torch.from_numpy(np.array(a))


def mlx_quantize(w: torch.Tensor, mode: str, global_scale=None):
    kwargs = {} if global_scale is None else {"global_scale": to_mx(global_scale)}
    wq, scales = mx.quantize(to_mx(w), mode=mode, **kwargs)
    return from_mx(wq), from_mx(scales)


def mlx_dequantize(wq, scales, mode: str, dtype, global_scale=None):
    kwargs = {} if global_scale is None else {"global_scale": to_mx(global_scale)}
    return from_mx(mx.dequantize(to_mx(wq), to_mx(scales), mode=mode, dtype=MX_DTYPE[dtype], **kwargs))


def assert_same_values(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Equal values, NaN matching NaN, and the same sign bit wherever the value is not NaN."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
        f"{what}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"
    )
    a, b = ours.to(torch.float64), theirs.to(torch.float64)
    same = (a == b) | (a.isnan() & b.isnan())
    same &= a.isnan() | (torch.signbit(a) == torch.signbit(b))
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int((~same).sum())} values differ, first at {i}: {a[tuple(i)].item()} vs {b[tuple(i)].item()}"
        )


def assert_matches_mlx(w: torch.Tensor, mode: str, what: str = "", global_scale=None) -> None:
    """quantize equals MLX's bit for bit; dequantize of the result equals MLX's in w's dtype."""
    wq, scales = quantize_fp(w, mode, global_scale=global_scale)
    mwq, mscales = mlx_quantize(w, mode, global_scale)
    assert scales.dtype == torch.uint8 and mscales.dtype == torch.uint8
    assert wq.dtype == torch.uint32 and wq.shape == mwq.shape, f"{what}: wq {tuple(wq.shape)} vs {tuple(mwq.shape)}"
    bad_s = scales != mscales
    assert not bool(bad_s.any()), f"{what}: {int(bad_s.sum())} scale bytes differ, first {bad_s.nonzero()[0].tolist()}"
    bad_w = wq.view(torch.int32) != mwq.view(torch.int32)
    assert not bool(bad_w.any()), f"{what}: {int(bad_w.sum())} words differ, first {bad_w.nonzero()[0].tolist()}"
    ours = dequantize_fp(wq, scales, mode, dtype=w.dtype, global_scale=global_scale)
    assert_same_values(ours, mlx_dequantize(wq, scales, mode, w.dtype, global_scale), f"{what} dequantize")


def finite_values(dtype) -> torch.Tensor:
    """Every finite value of a 16-bit dtype, in bit-pattern order."""
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return v[torch.isfinite(v)]


def groups_of(values: torch.Tensor, group_size: int, fill: float = 0.0) -> torch.Tensor:
    """values laid out in rows of 4 groups (padded with `fill`), the shape MLX needs for every mode."""
    row = 4 * group_size
    pad = (-values.numel()) % row
    padded = torch.cat([values, torch.full((pad,), fill, dtype=values.dtype)])
    return padded.reshape(-1, row)


# ---- random and crafted weights ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_random_normal_matches_mlx(mode, dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 512, generator=gen) * torch.logspace(-4, 3, 512)  # magnitudes vary by column
    assert_matches_mlx(w.to(dtype), mode, f"{mode} {dtype} 2-D")
    w3 = torch.randn(3, 4, 256, generator=gen).to(dtype)  # leading dimensions kept
    assert_matches_mlx(w3, mode, f"{mode} {dtype} 3-D")


def special_weights(dtype, group_size: int, element_max: float) -> torch.Tensor:
    """Rows of zeros, zero groups next to full ones, subnormals, values at/near element and dtype
    max, and groups mixing the dtype's extremes."""
    info = torch.finfo(dtype)
    one = torch.ones(group_size, dtype=torch.float64)
    ramp = torch.linspace(-1, 1, group_size, dtype=torch.float64)
    sub = info.smallest_normal * torch.tensor([2.0**-k for k in range(1, group_size + 1)], dtype=torch.float64)
    groups = [
        0 * one,
        -0.0 * one,
        ramp,
        sub,  # subnormals of the dtype (those below its smallest subnormal round to 0)
        sub * ramp.sign(),
        info.smallest_normal * ramp,
        element_max * one,
        element_max * ramp,
        element_max * (1 + 2.0**-8) * ramp,
        element_max * (1 - 2.0**-8) * ramp,
        element_max * 1.0625 * ramp,  # e4m3: 476 (rounds to the 0x7F pattern), e2m1: 6.375
        torch.full((group_size,), info.max, dtype=torch.float64) * ramp,
        info.max * one,
        -info.max * one,
        torch.cat([torch.tensor([info.max, info.smallest_normal, -info.max]), sub[3:]]),
    ]
    big, small = (1e30, 1e-30) if dtype != torch.float16 else (6e4, 6e-8)
    mixed = torch.tensor([big, small, -small, 1.0, -big / 3, small * 7] * group_size, dtype=torch.float64)[:group_size]
    groups.append(mixed)
    w = torch.stack(groups)  # [G, group_size]
    pad = (-w.shape[0]) % 4
    w = torch.cat([w, torch.zeros(pad, group_size, dtype=torch.float64)])
    return w.reshape(-1, 4 * group_size).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_special_values_match_mlx(mode, dtype):
    spec = MODES[mode]
    assert_matches_mlx(special_weights(dtype, spec.group_size, spec.element_max), mode, f"{mode} {dtype}")
    assert_matches_mlx(torch.zeros(4, 4 * spec.group_size, dtype=dtype), mode, f"{mode} {dtype} all zeros")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_every_16bit_value_matches_mlx(mode, dtype):
    """Every finite value of the dtype: sorted (neighbours share a group), shuffled (mixed
    magnitudes), and next to an anchor of element_max that fixes the scale to 1 (every element
    rounding and tie of the codec), and each value alone as its group's maximum (every scale)."""
    spec = MODES[mode]
    values = finite_values(dtype)
    assert_matches_mlx(groups_of(values, spec.group_size), mode, "sorted")
    perm = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))
    assert_matches_mlx(groups_of(values[perm], spec.group_size), mode, "shuffled")

    anchor = spec.element_max  # an e8m0 scale of 2^0, an e4m3 scale of 1.0 (nvfp4)
    inside = values[values.abs() <= anchor]
    body = groups_of(inside, spec.group_size - 1).reshape(-1, spec.group_size - 1)
    anchored = torch.cat([torch.full((body.shape[0], 1), anchor, dtype=dtype), body], 1).reshape(-1)
    assert_matches_mlx(groups_of(anchored, spec.group_size), mode, "anchored")

    # Every 8th value as a group maximum (all of them would cost seconds): 16 (bfloat16) or 128
    # (float16) maxima per binade; the exact scale boundaries are tested in float32 below.
    maxima = values[::8]
    alone = torch.zeros(maxima.numel(), spec.group_size, dtype=dtype)
    alone[:, 0] = maxima
    alone[:, 1] = maxima * 0.375  # a second element so the element rounding is not only at the max
    assert_matches_mlx(groups_of(alone.reshape(-1), spec.group_size), mode, "alone")


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_float32_scale_boundaries_match_mlx(mode):
    """Group maxima at element_max * 2^n and one ulp either side for every float32 exponent
    (subnormals included), where a ceil / round / exactness difference in the scale shows."""
    spec = MODES[mode]
    n = torch.arange(-149, 128, dtype=torch.float64)
    base = (spec.element_max * torch.exp2(n)).to(torch.float32)
    base = base[torch.isfinite(base)]
    inf = torch.tensor(float("inf"))
    powers = torch.exp2(n).to(torch.float32)
    candidates = torch.cat([base, torch.nextafter(base, inf), torch.nextafter(base, -inf), powers])
    candidates = candidates[torch.isfinite(candidates) & (candidates > 0)]
    w = torch.zeros(candidates.numel(), spec.group_size)
    w[:, 0] = candidates
    w[:, 1] = -candidates * 0.3
    w[:, 2] = candidates * 0.49
    assert_matches_mlx(groups_of(w.reshape(-1), spec.group_size), mode, "float32 boundaries")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_global_scale_matches_mlx(dtype):
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(16, 256, generator=gen) * torch.logspace(-5, 2, 256)).to(dtype)
    for g in (w.float().abs().max(), torch.tensor(1.0), torch.tensor(1e-3), torch.tensor(3e4)):
        assert_matches_mlx(w, "nvfp4", f"global scale {g.item()}", global_scale=g.reshape(1).to(torch.float32))


def test_documented_rounding_rules_are_mlx_s():
    """The rules the module docstring and docs/formats.md state, on the values that show them."""
    # e2m1 midpoints under scale 2^0 (the group max 6): ties go to the smaller magnitude; negative
    # values that round to zero give code 0.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = torch.tensor([6.0] + mids + [-m for m in mids] + [-0.1, -0.0] + [0.0] * 15).reshape(1, 32)
    wq, scales = quantize_fp(row, "mxfp4")
    codes = [(int(wq[0, i // 8]) >> (4 * (i % 8))) & 0xF for i in range(17)]
    assert scales.tolist() == [[127]]
    assert codes == [7, 0, 1, 2, 3, 4, 5, 6, 0, 9, 10, 11, 12, 13, 14, 0, 0]
    assert_matches_mlx(row.repeat(2, 1), "mxfp4", "midpoints")
    # e8m0: the smallest power of two not below amax / 6; an all-zero group gets byte 127.
    amax = torch.tensor([6.0, 6.0 * (1 + 2**-23), 11.99, 12.0, 0.0])
    w = torch.zeros(5, 32)
    w[:, 0] = amax
    _, scales = quantize_fp(w.reshape(-1, 32), "mxfp4")
    assert scales.flatten().tolist() == [127, 128, 128, 128, 127]
    assert_matches_mlx(torch.cat([w, torch.zeros(3, 32)]).reshape(-1, 64), "mxfp4", "e8m0 ceil")
    # e4m3 (nvfp4 scale): amax / 6 of 440 rounds to 448, 449..1e30 saturate to 448 (0x7E), 2^-10
    # ties to 0 (a zero scale), just above it rounds to 2^-9 (byte 1).
    amax = torch.tensor([440.0, 449.0, 470.0, 479.0, 480.0, 1e30, 2.0**-10, 2.0**-10 * 1.01]) * 6
    w = torch.zeros(8, 16)
    w[:, 0] = amax
    _, scales = quantize_fp(w.reshape(-1, 32), "nvfp4")
    assert scales.flatten().tolist() == [0x7E] * 6 + [0, 1]
    assert_matches_mlx(w.reshape(-1, 32), "nvfp4", "e4m3 saturation")


# ---- decode tables -------------------------------------------------------------------------------


def words_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, 4 * words] -> uint32 [rows, words], byte 0 lowest."""
    return b.contiguous().view(torch.int32).view(torch.uint32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_e2m1_code_and_e8m0_byte_decodes_as_mlx(dtype):
    """mxfp4: all 16 nibbles at every position under every e8m0 byte 0..255."""
    codes = torch.arange(16, dtype=torch.int64).repeat(2)  # 32 elements, each code twice
    codes = torch.stack([codes, codes.roll(1)]).repeat(256, 1)  # [512, 32]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    wq = words_from_bytes(packed)
    scales = torch.arange(256, dtype=torch.int64).repeat_interleave(2).to(torch.uint8).reshape(-1, 1)
    ours = dequantize_fp(wq, scales, "mxfp4", dtype=dtype)
    assert_same_values(ours, mlx_dequantize(wq, scales, "mxfp4", dtype), "mxfp4")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_e4m3_byte_decodes_as_mlx(dtype):
    """mxfp8: every byte as an element under scale bytes 127 (2^0), 100 and 140; nvfp4: every
    byte as a scale with every e2m1 code."""
    elements = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(8, 32)
    wq = words_from_bytes(elements).repeat(3, 1)
    scales = torch.tensor([127, 100, 140], dtype=torch.uint8).repeat_interleave(8).reshape(-1, 1)
    ours = dequantize_fp(wq, scales, "mxfp8", dtype=dtype)
    assert_same_values(ours, mlx_dequantize(wq, scales, "mxfp8", dtype), "mxfp8")

    codes = torch.arange(16, dtype=torch.int64).repeat(256, 1)  # [256, 16]: one group per scale byte
    wq4 = words_from_bytes((codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).reshape(128, 16))
    scales4 = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(128, 2)
    ours4 = dequantize_fp(wq4, scales4, "nvfp4", dtype=dtype)
    assert_same_values(ours4, mlx_dequantize(wq4, scales4, "nvfp4", dtype), "nvfp4")


def test_nvfp4_single_group_rows():
    """MLX packs the whole tensor in blocks of 32 codes and rejects an odd number of nvfp4 groups;
    the reference packs rows and agrees with MLX's rows of a doubled tensor."""
    w = torch.randn(1, 16, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError):
        mlx_quantize(w, "nvfp4")
    wq, scales = quantize_fp(w, "nvfp4")
    mwq, mscales = mlx_quantize(w.repeat(2, 1), "nvfp4")
    assert wq.shape == (1, 2) and scales.shape == (1, 1)
    assert torch.equal(wq.view(torch.int32), mwq[:1].view(torch.int32)) and torch.equal(scales, mscales[:1])


def test_default_dequantize_dtype_is_bfloat16_as_mlx():
    wq, scales = quantize_fp(torch.randn(2, 64), "mxfp4")
    ours = dequantize_fp(wq, scales, "mxfp4")
    theirs = from_mx(mx.dequantize(to_mx(wq), to_mx(scales), mode="mxfp4"))
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert_same_values(ours, theirs, "default dtype")


# ---- policy and argument checks ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_non_finite_refused_while_mlx_loses_it(mode, bad):
    spec = MODES[mode]
    w = torch.ones(2, 4 * spec.group_size)
    w[0, 3] = bad
    with pytest.raises(ValueError, match="'w' must be finite"):
        quantize_fp(w, mode)
    # MLX accepts it and returns finite codes: the non-finite value does not survive a round trip.
    back = mlx_dequantize(*mlx_quantize(w, mode), mode, torch.float32)
    assert bool(torch.isfinite(back).all())


def test_accepted_group_sizes_and_bits_are_mlx_s():
    w = torch.randn(2, 128)
    for mode, spec in MODES.items():
        for group_size in (16, 32, 64, 128):
            for bits in (2, 3, 4, 5, 6, 8):
                try:
                    mx.quantize(to_mx(w), group_size=group_size, bits=bits, mode=mode)
                    mlx_accepts = True
                except ValueError:
                    mlx_accepts = False
                try:
                    quantize_fp(w, mode, group_size, bits)
                    we_accept = True
                except ValueError:
                    we_accept = False
                assert mlx_accepts == we_accept, (mode, group_size, bits)
                assert we_accept == ((group_size, bits) == (spec.group_size, spec.bits)), (mode, group_size, bits)


WQ = torch.zeros(2, 4, dtype=torch.uint32)
S1 = torch.zeros(2, 1, dtype=torch.uint8)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_fp(torch.ones(2, 64), "fp4"), "'mode'"),
        (lambda: quantize_fp(torch.ones(2, 64, dtype=torch.float64), "mxfp4"), "'w' must be a float32"),
        (lambda: quantize_fp(torch.ones(64), "mxfp4"), "at least 2 dimensions"),
        (lambda: quantize_fp(torch.ones(2, 48), "mxfp4"), "divisible by group_size=32"),
        (lambda: quantize_fp(torch.ones(2, 64), "mxfp4", global_scale=torch.ones(1)), "only supported for mode"),
        (lambda: quantize_fp(torch.ones(2, 64), "nvfp4", global_scale=torch.ones(2)), "one element"),
        (lambda: dequantize_fp(WQ.view(torch.int32), S1, "mxfp4"), "'wq'"),
        (lambda: dequantize_fp(WQ, torch.zeros(2, 2, dtype=torch.uint8), "mxfp4"), "'scales' must have shape"),
        (lambda: dequantize_fp(WQ, torch.zeros(2, 1), "mxfp4"), "'scales' must be a uint8"),
        (lambda: dequantize_fp(WQ, S1, "mxfp4", dtype=torch.int8), "'dtype'"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the float64 product -------------------------------------------------------------------------


@pytest.mark.parametrize("transpose", (True, False))
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_qmm_fp_matches_mlx_quantized_matmul(mode, transpose):
    """MLX multiplies in float32; per output its error is at most (K + 2) * 2^-24 of |x| @ |W| (K
    accumulations, the rounded x * w products and the scale multiplication)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 64, 256
    w = torch.randn(n, k, generator=gen) if transpose else torch.randn(k, n, generator=gen)
    x = torch.randn(5, k, generator=gen)
    wq, scales = quantize_fp(w, mode)
    y = qmm_fp(x, wq, scales, mode, transpose=transpose)
    magnitude = qmm_fp_magnitude(x, wq, scales, mode, transpose=transpose)
    theirs = from_mx(mx.quantized_matmul(to_mx(x), to_mx(wq), to_mx(scales), transpose=transpose, mode=mode))
    assert y.dtype == torch.float64 and y.shape == theirs.shape == (5, n)
    ratio = (theirs.to(torch.float64) - y).abs() / ((k + 2) * 2.0**-24 * magnitude)
    assert float(ratio.max()) <= 1.0, f"worst error ratio {float(ratio.max()):.2f}"
