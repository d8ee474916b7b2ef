"""The opt-in int8-activation qmm (csrc/cpu/actq_qmm.cpp, torch_qmm/activations.py).

Oracles (float64, independent of the kernels): torch_qmm.reference.dequantize for W, and x's int8
quantization written here from its definition (d = max|x| / 127 per block of 32, q = x / d rounded
half to even, both in float32).

Bounds checked:
- against the exact product W x: |y - W x| <= sum over blocks b of (d_b / 2) * sum_{i in b} |w_i|
  (the int8 step), plus float32 slack 2^-20 * sum |w| (|x| + d) (rounding of x / d, of the
  float32 scale products and of the accumulation over at most K / 32 blocks: far below the step);
- against W times the dequantized x (the same codes as the kernel's): float32 accumulation only,
  2^-20 * sum |w| |x_deq|.
"""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm import reference
from torch_qmm.nn import QuantLinear

from cpu_features import HAS_INT8_512, int8_affine_route

ops = torch.ops.torch_qmm
SLACK = 2.0**-20


def quantize_x(x: torch.Tensor, block: int = 32):
    """(x_deq float64, d per element float64): x [M, K] float32 in blocks of `block` along K (32
    for the affine formats, 256 for the GGUF ones)."""
    M, K = x.shape
    xb = x.to(torch.float32).reshape(M, K // block, block)
    d = xb.abs().amax(-1, keepdim=True) / 127.0  # float32, as the definition
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1.0)), 0.0).clamp(-127, 127)
    x_deq = (q.double() * d.double()).reshape(M, K)
    return x_deq, d.double().expand(M, K // block, block).reshape(M, K)


def make(N, K, bits, group_size, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).to(dtype)
    wq, s, b = torch_qmm.quantize(w, group_size=group_size, bits=bits)
    return wq, s, b, reference.dequantize(wq, s, b, bits, group_size)


CASES = [  # (bits, group_size, K): K tails past the last whole chunk of 4-bit codes (64 codes at
    # 256 bits, 128 at 512: K = 96 has a 32-code tail at 256 bits and is below one 512-bit chunk;
    # 160 leaves 32 codes at 512 bits; 192 / 224, an odd number of 256-bit chunks, take those)
    # and of 8-bit (32 / 64: K = 96 takes three 256-bit chunks)
    (4, 32, 256), (4, 64, 512), (4, 128, 512), (4, 32, 96), (4, 32, 160), (4, 64, 192), (4, 32, 224),
    (8, 32, 256), (8, 64, 256), (8, 128, 512), (8, 32, 96),
    (2, 64, 256), (3, 32, 256), (5, 128, 256), (6, 64, 256),
]


@pytest.fixture(params=["512", "256"])
def width(request, monkeypatch):
    """The vector kernels' width: the 512-bit ones where the CPU has them, or the 256-bit ones
    (TORCH_QMM_CPU_NO_INT8_512=1). Returns whether the 512-bit ones are stepped aside."""
    if request.param == "512" and not HAS_INT8_512:
        pytest.skip("no AVX512_VNNI + AVX512BW here")
    no_512 = request.param == "256"
    if no_512:
        monkeypatch.setenv("TORCH_QMM_CPU_NO_INT8_512", "1")
    else:
        monkeypatch.delenv("TORCH_QMM_CPU_NO_INT8_512", raising=False)
    return no_512


def test_the_setting_without_an_argument_is_int8():
    # First in the file: activation_quantization() means "int8" (its default), not an exact block.
    wq, s, b, _ = make(16, 128, 4, 32)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    int8 = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 32)
    assert not torch.equal(int8, ops.qmm(x, wq, s, b, "affine", 4, 32, True))
    wn, sn, bn, _ = make(128, 32, 4, 32, seed=1)  # W [K=128, N=32] for transpose=False
    with torch_qmm.activation_quantization():
        assert torch_qmm.activations.current_activations() == "int8"
        assert torch.equal(torch_qmm.quantized_matmul(x, wq, s, b, group_size=32, bits=4), int8)
        # transpose=False calls are not quantized by the setting (int8 runs transpose=True only)
        assert torch.equal(torch_qmm.quantized_matmul(x, wn, sn, bn, transpose=False, group_size=32, bits=4),
                           ops.qmm(x, wn, sn, bn, "affine", 4, 32, False))
    assert torch_qmm.activations.current_activations() is None


@pytest.mark.parametrize("bits, group_size, K", CASES)
@pytest.mark.parametrize("M", [1, 3, 7])
def test_error_within_the_int8_step(bits, group_size, K, M, width):
    N = 37
    wq, s, b, w = make(N, K, bits, group_size)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3.0, K)
    route = ops._cpu_route_int8_activations(x, wq, s, b, "affine", bits, group_size)
    assert route == int8_affine_route(bits, K, no_512=width)
    y = ops.qmm_int8_activations(x, wq, s, b, "affine", bits, group_size).double()
    exact = x.double() @ w.T
    x_deq, d = quantize_x(x)
    step = (d / 2) @ w.abs().T
    slack = SLACK * ((x.double().abs() + d) @ w.abs().T)
    err = (y - exact).abs()
    assert (err <= step + slack).all(), f"worst excess {(err - step - slack).max().item():.3g}"
    # The same codes as the definition: only float32 accumulation apart from W x_deq.
    tight = (y - x_deq @ w.T).abs()
    assert (tight <= SLACK * (x_deq.abs() @ w.abs().T)).all(), f"max {tight.max().item():.3g}"
    # Not the exact product: the int8 rounding shows.
    assert (err > 0).any()


@pytest.mark.parametrize("bits, group_size", [(4, 64), (4, 32), (8, 32), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_round_once(dtype, bits, group_size, width):
    # Scales and biases in dtype, y rounded once to dtype: the bound plus half an ulp of y. K has
    # whole 512-bit chunks and a 16-group remainder past the offsets' vectors (K / 32 = 41 groups).
    K = 1312 if group_size == 32 else 1280
    wq, s, b, w = make(29, K, bits, group_size, dtype=dtype)
    x = torch.randn(2, K).to(dtype)
    assert ops._cpu_route_int8_activations(x, wq, s, b, "affine", bits, group_size) == int8_affine_route(bits, K, width)
    y = ops.qmm_int8_activations(x, wq, s, b, "affine", bits, group_size)
    assert y.dtype == dtype
    x_deq, d = quantize_x(x.float())
    ref = x_deq @ w.T
    eps = torch.finfo(dtype).eps
    tol = 2 * SLACK * (x_deq.abs() @ w.abs().T) + eps / 2 * ref.abs()  # float32 slack, then one rounding
    assert ((y.double() - ref).abs() <= tol).all()


def test_routes_differ_from_the_exact_path(monkeypatch):
    for bits in (4, 8, 3):
        wq, s, b, _ = make(64, 256, bits, 64)
        x = torch.randn(1, 256)
        exact = ops._cpu_route(x, wq, s, b, bits, 64, True, "affine")
        route = ops._cpu_route_int8_activations(x, wq, s, b, "affine", bits, 64)
        assert not exact.startswith("int8x")
        assert route == int8_affine_route(bits, 256), (bits, route)
        if bits == 3:
            assert route == "int8x/scalar"
        elif HAS_INT8_512:
            assert "-512-" in route
            monkeypatch.setenv("TORCH_QMM_CPU_NO_INT8_512", "1")
            narrow = ops._cpu_route_int8_activations(x, wq, s, b, "affine", bits, 64)
            monkeypatch.delenv("TORCH_QMM_CPU_NO_INT8_512")
            assert narrow == int8_affine_route(bits, 256, no_512=True) and "-512-" not in narrow
    monkeypatch.setenv("TORCH_QMM_CPU_NO_AVX2_CHUNKS", "1")
    wq, s, b, w = make(16, 256, 4, 64)
    x = torch.randn(2, 256)
    assert ops._cpu_route_int8_activations(x, wq, s, b, "affine", 4, 64) == "int8x/scalar"
    y_scalar = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64).double()
    x_deq, _ = quantize_x(x)
    assert ((y_scalar - x_deq @ w.T).abs() <= SLACK * (x_deq.abs() @ w.abs().T)).all()


def test_nonfinite_x_takes_the_exact_kernels():
    wq, s, b, _ = make(8, 128, 4, 64)
    x = torch.randn(2, 128)
    x[1, 5] = float("inf")
    assert ops._cpu_route_int8_activations(x, wq, s, b, "affine", 4, 64) == "exact"
    torch.testing.assert_close(ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64),
                               ops.qmm(x, wq, s, b, "affine", 4, 64, True), rtol=0, atol=0, equal_nan=True)


def test_block_sums_past_float32_take_the_exact_kernels():
    # x = 1e37: every product |w x| stays finite, but a block's d_b * sum(q) reaches ~1e39 and
    # overflows float32; the call must give qmm's exact (finite) result, not Inf/NaN.
    wq, s, b, _ = make(8, 128, 4, 64)
    x = torch.full((1, 128), 1e37)
    exact = ops.qmm(x, wq, s, b, "affine", 4, 64, True)
    assert torch.isfinite(exact).all()
    torch.testing.assert_close(ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64), exact, rtol=0, atol=0)


def test_context_manager_and_quantlinear():
    wq, s, b, _ = make(32, 256, 4, 64)
    x = torch.randn(3, 256)
    exact = torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4)
    int8 = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64)
    assert not torch.equal(exact, int8)
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4), int8)
        with torch_qmm.activation_quantization(None):
            assert torch.equal(torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4), exact)
        # Calls it does not apply to stay exact: fp modes, transpose=False.
        wf, sf = torch_qmm.quantize(torch.randn(32, 256), mode="mxfp4")
        assert torch.equal(torch_qmm.quantized_matmul(x, wf, sf, mode="mxfp4"),
                           ops.qmm(x, wf, sf, None, "mxfp4", 4, 32, True))
    assert torch.equal(torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4), exact)
    lin = torch.nn.Linear(256, 32)
    q8 = QuantLinear.from_linear(lin, bits=4, group_size=64, activations="int8")
    qe = QuantLinear.from_linear(lin, bits=4, group_size=64)
    assert torch.equal(q8(x), ops.qmm_int8_activations(x, q8.qweight, q8.scales, q8.biases, "affine", 4, 64) + q8.bias)
    assert not torch.equal(q8(x), qe(x))
    assert "activations=int8" in repr(q8)


def test_bad_arguments_are_named():
    wq, s, b, _ = make(8, 128, 4, 64)
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="argument 'activations'.*'int4'"):
        torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4, activations="int4")
    with pytest.raises(ValueError, match="argument 'kind'"):
        with torch_qmm.activation_quantization("fp8"):
            pass
    with pytest.raises(ValueError, match="argument 'transpose'"):
        torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4, transpose=False, activations="int8")
    with pytest.raises(ValueError, match="argument 'activations' must be None for mode 'mxfp4'"):
        QuantLinear(128, 8, mode="mxfp4", activations="int8")
    wf, sf = torch_qmm.quantize(torch.randn(8, 128), mode="mxfp4")
    with pytest.raises(ValueError, match="argument 'mode' must be 'affine'"):
        ops.qmm_int8_activations(x, wf, sf, None, "mxfp4", 4, 32)
    with pytest.raises(ValueError, match="argument 'mode' must be 'affine'"):
        ops.qmm_int8_activations(x.to("meta"), wf.to("meta"), sf.to("meta"), None, "mxfp4", 4, 32)
    with pytest.raises(ValueError, match="argument 'activations': 'int8' runs on CPU tensors only, got x on meta"):
        torch_qmm.quantized_matmul(x.to("meta"), wq.to("meta"), s.to("meta"), b.to("meta"), group_size=64, bits=4,
                                   activations="int8")
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no gradient"):
        ops.qmm_int8_activations(xg, wq, s, b, "affine", 4, 64).sum().backward()


def test_opcheck():
    wq, s, b, _ = make(16, 128, 4, 64)
    torch.library.opcheck(ops.qmm_int8_activations.default, (torch.randn(2, 128), wq, s, b, "affine", 4, 64),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiles_fullgraph_and_follows_the_setting():
    torch._dynamo.reset()
    wq, s, b, _ = make(32, 256, 4, 64)
    x = torch.randn(2, 256)

    def f(x):
        return torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4) * 2

    cf = torch.compile(f, fullgraph=True)
    exact = ops.qmm(x, wq, s, b, "affine", 4, 64, True) * 2
    int8 = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64) * 2
    assert torch.equal(cf(x), exact)
    with torch_qmm.activation_quantization("int8"):
        assert torch.equal(cf(x), int8)
    assert torch.equal(cf(x), exact)
    layer = QuantLinear.from_linear(torch.nn.Linear(256, 32), bits=4, group_size=64, activations="int8")
    cl = torch.compile(layer, fullgraph=True)
    assert torch.equal(cl(x), layer(x))


def test_the_setting_is_per_thread():
    """A block in one thread leaves another thread's calls exact, and a new thread starts exact,
    as torch.no_grad (both threads call while the block is open: barriers order the calls)."""
    import threading

    wq, s, b, _ = make(32, 256, 4, 64)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    exact = ops.qmm(x, wq, s, b, "affine", 4, 64, True)
    int8 = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64)
    assert not torch.equal(exact, int8)  # the check below could not tell them apart otherwise
    inside, outside = threading.Barrier(2), threading.Barrier(2)
    seen = {}

    def call():
        return torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4)

    def quantizing():
        with torch_qmm.activation_quantization("int8"):
            inside.wait()
            seen["quantizing"] = call()
            outside.wait()
        seen["quantizing, after"] = call()

    def other():
        inside.wait()
        seen["other"] = call()
        seen["other, current"] = torch_qmm.activations.current_activations()
        outside.wait()

    threads = [threading.Thread(target=quantizing), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.equal(seen["quantizing"], int8)
    assert torch.equal(seen["other"], exact)
    assert seen["other, current"] is None
    assert torch.equal(seen["quantizing, after"], exact)


def test_the_setting_nests_and_skips_what_it_does_not_apply_to():
    """An inner block ends back in the outer setting (also when it raises); inside a block,
    transpose=False and tensors off the CPU stay exact instead of raising."""
    from torch_qmm.activations import current_activations
    from torch_qmm.ops import gguf_matmul

    from gguf_helpers import Q4_K, random_k_blocks

    wq, s, b, _ = make(32, 256, 4, 64)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    int8 = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 64)
    wn, sn, bn, _ = make(256, 64, 4, 32)  # transpose=False: W [K=256, N=64], quantized along N
    exact_n = ops.qmm(x, wn, sn, bn, "affine", 4, 32, False)
    import numpy as np

    blocks = torch.from_numpy(random_k_blocks(Q4_K, 8, 256, np.random.default_rng(0)))
    meta = [t.to("meta") for t in (x, wq, s, b)]
    with torch_qmm.activation_quantization("int8"):
        with torch_qmm.activation_quantization(None):
            assert current_activations() is None
        assert current_activations() == "int8"
        assert torch.equal(torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4), int8)
        with pytest.raises(KeyError):
            with torch_qmm.activation_quantization(None):
                raise KeyError("inside")
        assert current_activations() == "int8"
        assert torch.equal(torch_qmm.quantized_matmul(x, wn, sn, bn, transpose=False, group_size=32, bits=4), exact_n)
        assert torch_qmm.quantized_matmul(*meta, group_size=64, bits=4).shape == (3, 32)
        assert gguf_matmul(x.to("meta"), blocks.to("meta"), int(Q4_K), 8, 256).shape == (3, 8)
    assert current_activations() is None


def _tie_x(K: int) -> torch.Tensor:
    """x [2, K] whose every block of 32 has max 127 (d = 1, exact) and ties elsewhere: 0.5, 1.5,
    ..., and their negatives (round half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.5 -> 4)."""
    x = torch.zeros(2, K)
    x[:, ::32] = 127.0
    ties = torch.arange(K) % 32 != 0
    x[0, ties] = (torch.arange(K)[ties] % 8 - 4).float() + 0.5  # -3.5 .. 3.5
    x[1] = -x[0]
    return x


@pytest.mark.parametrize("bits", [4, 8, 3])  # the vector 4-bit and 8-bit kernels, the portable one
def test_ties_round_half_to_even(bits, width):
    # x / d lands exactly on .5: the codes must be rounded half to even (the definition); any
    # other rounding moves y by whole weights, far beyond the float32 slack.
    K = 256
    wq, s, b, w = make(24, K, bits, 64)
    x = _tie_x(K)
    x_deq, _ = quantize_x(x)
    assert torch.equal(x_deq[0, 1:8], torch.tensor([-2.0, -2.0, -0.0, 0.0, 2.0, 2.0, 4.0]).double())
    y = ops.qmm_int8_activations(x, wq, s, b, "affine", bits, 64).double()
    assert ((y - x_deq @ w.T).abs() <= SLACK * (x_deq.abs() @ w.abs().T)).all()
