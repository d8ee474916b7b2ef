"""The fp modes (mxfp4, nvfp4 and every other non-affine row of torch_qmm.formats.FORMATS) on CPU:
quantize word for word and scale byte for byte against mlx[cpu] AND against the float64 reference
(torch_qmm/reference_fp.py), dequantize value for value, the NaN/Inf policy, and qmm against the
float64 reference with the error bound of tests/tolerance.py.

MLX and reference_fp are the oracles: neither is the code under test (csrc/cpu/quantize.cpp,
csrc/cpu/qmm.cpp).
"""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm.formats import FORMATS
from torch_qmm.reference_fp import dequantize_fp, qmm_fp, qmm_fp_magnitude, quantize_fp

from test_reference_fp import (  # noqa: F401  (helpers only: no tests imported)
    assert_same_values,
    finite_values,
    groups_of,
    mlx_dequantize,
    mlx_quantize,
    special_weights,
)
from tolerance import assert_matches_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP_MODES = tuple(m for m, f in FORMATS.items() if not f.has_biases)


def assert_bits_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
        f"{what}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"
    )
    view = torch.int32 if ours.dtype == torch.uint32 else ours.dtype
    bad = ours.view(view) != theirs.view(view)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} differ, first at {bad.nonzero()[0].tolist()}"


def assert_quantize_exact(w: torch.Tensor, mode: str, what: str) -> None:
    """torch_qmm.quantize == mx.quantize == reference_fp.quantize_fp, and dequantize == mx.dequantize
    in every output dtype."""
    out = torch_qmm.quantize(w, mode=mode)
    assert len(out) == 2, f"{what}: {mode} quantize returns (wq, scales), got {len(out)} tensors"
    wq, scales = out
    mwq, mscales = mlx_quantize(w, mode)
    rwq, rscales = quantize_fp(w, mode)
    assert_bits_equal(scales, mscales, f"{what}: scales vs mlx")
    assert_bits_equal(wq, mwq, f"{what}: wq vs mlx")
    assert_bits_equal(scales, rscales, f"{what}: scales vs reference")
    assert_bits_equal(wq, rwq, f"{what}: wq vs reference")
    for dtype in DTYPES:  # wq as quantize returned it (leading dimensions too), as MLX takes it
        ours = torch_qmm.dequantize(wq, scales, mode=mode, dtype=dtype)
        assert_same_values(ours, mlx_dequantize(wq, scales, mode, dtype), f"{what}: dequantize {dtype} vs mlx")
        assert_same_values(ours, dequantize_fp(wq, scales, mode, dtype=dtype), f"{what}: dequantize {dtype} vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", FP_MODES)
def test_random_weights_match_mlx(mode, dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 512, generator=gen) * torch.logspace(-4, 3, 512)  # magnitudes vary by column
    assert_quantize_exact(w.to(dtype), mode, f"{mode} {dtype} 2-D")
    assert_quantize_exact(torch.randn(3, 4, 256, generator=gen).to(dtype), mode, f"{mode} {dtype} 3-D")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", FP_MODES)
def test_zeros_subnormals_near_max_and_mixed_groups_match_mlx(mode, dtype):
    f = FORMATS[mode]
    assert_quantize_exact(special_weights(dtype, f.default_group_size, f.element_max), mode, f"{mode} {dtype}")
    assert_quantize_exact(torch.zeros(4, 4 * f.default_group_size, dtype=dtype), mode, f"{mode} {dtype} zeros")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mode", FP_MODES)
def test_every_16bit_value_matches_mlx(mode, dtype):
    """Every finite value of the dtype, sorted (neighbours share a group) and next to an anchor of
    element_max that fixes the scale to 1 (every element rounding and tie of the codec)."""
    f = FORMATS[mode]
    values = finite_values(dtype)
    assert_quantize_exact(groups_of(values, f.default_group_size), mode, "sorted")
    inside = values[values.abs() <= f.element_max]
    body = groups_of(inside, f.default_group_size - 1).reshape(-1, f.default_group_size - 1)
    anchored = torch.cat([torch.full((body.shape[0], 1), f.element_max, dtype=dtype), body], 1).reshape(-1)
    assert_quantize_exact(groups_of(anchored, f.default_group_size), mode, "anchored")


@pytest.mark.parametrize("mode", FP_MODES)
def test_float32_scale_boundaries_match_mlx(mode):
    """Group maxima at element_max * 2^n and one ulp either side for every float32 exponent
    (subnormals included): a ceil / round difference of the e8m0 scale, or a wrong e4m3 rounding
    of nvfp4's scale, shows here."""
    f = FORMATS[mode]
    n = torch.arange(-149, 128, dtype=torch.float64)
    base = (f.element_max * torch.exp2(n)).to(torch.float32)
    base = base[torch.isfinite(base)]
    inf = torch.tensor(float("inf"))
    c = torch.cat([base, torch.nextafter(base, inf), torch.nextafter(base, -inf), torch.exp2(n).to(torch.float32)])
    c = c[torch.isfinite(c) & (c > 0)]
    w = torch.zeros(c.numel(), f.default_group_size)
    w[:, 0], w[:, 1], w[:, 2] = c, -c * 0.3, c * 0.49
    assert_quantize_exact(groups_of(w.reshape(-1), f.default_group_size), mode, "float32 boundaries")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", FP_MODES)
def test_non_finite_weights_are_refused(mode, bad):
    """MLX quantizes NaN / Inf silently into codes that do not represent them (its group is
    garbled); torch_qmm refuses them, as for affine (docs/formats.md)."""
    w = torch.randn(4, 64)
    w[2, 5] = bad
    mwq, mscales = mlx_quantize(w, mode)  # MLX: no error
    assert mwq.shape == (4, 64 * FORMATS[mode].default_bits // 32)
    with pytest.raises(ValueError, match=r"quantize: argument 'w' contains NaN or Inf"):
        torch_qmm.quantize(w, mode=mode)


@pytest.mark.parametrize("mode", FP_MODES)
def test_defaults_are_mlx_defaults(mode):
    """group_size / bits None -> the mode's defaults, which are MLX's (mx.quantize without them)."""
    import mlx.core as mx

    from test_reference_fp import to_mx

    w = torch.randn(8, 128)
    mwq, mscales = mx.quantize(to_mx(w), mode=mode)
    f = FORMATS[mode]
    assert mscales.shape[-1] == 128 // f.default_group_size and mwq.shape[-1] == 128 * f.default_bits // 32
    wq, scales = torch_qmm.quantize(w, mode=mode)
    assert tuple(wq.shape) == tuple(mwq.shape) and tuple(scales.shape) == tuple(mscales.shape)
    assert torch_qmm.dequantize(wq, scales, mode=mode).dtype == torch.bfloat16  # as mx.dequantize


# ---- qmm ------------------------------------------------------------------------------------------


def _weights(mode: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 1, cols)
    return torch_qmm.quantize(w, mode=mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transpose", [True, False], ids=["t", "n"])
@pytest.mark.parametrize("m", [1, 3, 4, 17, 64])
@pytest.mark.parametrize("mode", FP_MODES)
def test_qmm_matches_float64_reference(mode, m, transpose, dtype):
    """y within the tolerance rule (tests/tolerance.py: float32 accumulation, one rounding to the
    output dtype) of the float64 product of x and the exact dequantization of W."""
    N, K = 96, 256
    wq, scales = _weights(mode, N if transpose else K, K if transpose else N)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(2, m, K, generator=gen).to(dtype)
    y = torch_qmm.quantized_matmul(x, wq, scales, transpose=transpose, mode=mode)
    ref = qmm_fp(x, wq, scales, mode, transpose=transpose)
    mag = qmm_fp_magnitude(x, wq, scales, mode, transpose=transpose)
    assert y.shape == (2, m, N)
    assert_matches_reference(y, ref, mag, dtype, f"{mode} m={m} transpose={transpose}")


@pytest.mark.parametrize("mode", FP_MODES)
def test_qmm_gradient_wrt_x_is_the_other_transpose(mode):
    """dx of y = x @ W.T is dy @ W: checked against the float64 product with the reference W."""
    wq, scales = _weights(mode, 64, 128)
    x = torch.randn(5, 128, requires_grad=True)
    y = torch_qmm.quantized_matmul(x, wq, scales, mode=mode)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = dequantize_fp(wq, scales, mode, dtype=torch.float64)
    ref = dy.double() @ w
    mag = dy.double().abs() @ w.abs()
    assert_matches_reference(x.grad, ref, mag, torch.float32, f"{mode} dx")


@pytest.mark.parametrize("mode", FP_MODES)
def test_qmm_cpu_route_is_gemm_without_chunk_kernels(mode):
    wq, scales = _weights(mode, 64, 128)
    x = torch.randn(1, 128)
    route = torch.ops.torch_qmm._cpu_route(x, wq, scales, None, FORMATS[mode].default_bits,
                                          FORMATS[mode].default_group_size, True, mode)
    assert route.split("/")[0] in ("gemm", "chunked")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("transpose", [True, False], ids=["t", "n"])
@pytest.mark.parametrize("mode", FP_MODES)
def test_qmm_sums_sparse_x_within_a_few_roundings(mode, transpose, dtype):
    """Four nonzero x values per row with every bit of x's dtype: each output sums four products,
    so every CPU route (M across the chunk, fused and GEMM limits) is within a few roundings of
    the terms (tests/tolerance.py), far below ACC_RTOL: x, a decoded weight or a scale kept
    in a narrower type fails."""
    from tolerance import assert_within_few_roundings, sparse_x

    N, K = 96, 256
    wq, scales = _weights(mode, N if transpose else K, K if transpose else N)
    for m in (1, 2, 3, 5, 16, 33):
        x = sparse_x(m, K, 4, 32, dtype, seed=m)
        y = torch_qmm.quantized_matmul(x, wq, scales, transpose=transpose, mode=mode)
        assert_within_few_roundings(y, qmm_fp(x, wq, scales, mode, transpose=transpose),
                                    qmm_fp_magnitude(x, wq, scales, mode, transpose=transpose), dtype, 4,
                                    f"{mode} m={m} transpose={transpose}")
