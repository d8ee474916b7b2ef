"""Fidelity corpus: MLX's own Metal kernels, unmodified, on metalsim.

The headers come from the mlx-metal wheel (corpus.py); the only source written here is the
instantiation lines (MLX's `instantiate_kernel` macro, as its .metal files use it). Grids,
threadgroup sizes and buffer layouts follow MLX's host code (mlx/backend/metal/quantized.cpp:
qmv, qmm; matmul.cpp: steel GEMM). Every result is compared with float64 from the operands
(mx.quantize / mx.dequantize from mlx[cpu] define the quantized weights).

Tolerances: the kernels accumulate in float and round the output to the activation dtype, so
float32 outputs are held to 1e-5 relative (K <= 512 float sums), float16 to 2e-3 and bfloat16
to 1.6e-2 (a few ulps of the output type plus the rounding of x to that type).
"""
import numpy as np
import pytest

import metalsim_corpus as corpus

mx = pytest.importorskip("mlx.core")

# MLX compiles quantized.h and fp_quantized.h as separate libraries (they share names)
COMMON = """
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm.h"
#include "mlx/backend/metal/kernels/quantized_utils.h"
"""
HEADERS = {"affine": '#include "mlx/backend/metal/kernels/quantized.h"\n',
           "fp": '#include "mlx/backend/metal/kernels/fp_quantized.h"\n'}
# library, name, function, template arguments: the instantiation lines this test writes
INSTANCES = [
    ("affine", "affine_qmv_fast_float_gs_64_b_4_batch_0", "affine_qmv_fast", "float, 64, 4, 0"),
    ("affine", "affine_qmv_fast_bfloat16_t_gs_32_b_8_batch_0", "affine_qmv_fast", "bfloat16_t, 32, 8, 0"),
    ("affine", "affine_qmv_half_gs_64_b_3_batch_0", "affine_qmv", "half, 64, 3, 0"),
    ("affine", "affine_qmm_t_float_gs_64_b_4_alN_false_batch_0", "affine_qmm_t", "float, 64, 4, false, false"),
    ("fp", "mxfp4_qmv_fast_float_gs_32_b_4_r_4_batch_0", "fp_qmv_fast", "float, 32, 4, 0"),
]
TOL = {np.float32: 1e-5, np.float16: 2e-3, "bfloat16": 1.6e-2}


class _Libs:
    """Dispatches each kernel in the library that instantiates it."""

    def __init__(self, libs, where):
        self.libs, self.where = libs, where

    def dispatch(self, name, **kw):
        return self.libs[self.where[name]].dispatch(name, **kw)


@pytest.fixture(scope="module")
def lib(metalsim):
    inc = corpus.mlx_include()
    libs = {}
    for which, header in HEADERS.items():
        src = COMMON + header + "".join(f'instantiate_kernel("{n}", {f}, {a})\n'
                                        for w, n, f, a in INSTANCES if w == which)
        libs[which] = metalsim.compile(src, include_dirs=[inc], lazy=True)
    return _Libs(libs, {n: w for w, n, _, _ in INSTANCES})


def _np(a):
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def _as_dtype(x32, dtype):
    """(array to bind, float64 of what the kernel sees)."""
    if dtype == "bfloat16":
        xb = mx.array(x32).astype(mx.bfloat16)
        raw = np.array(xb.view(mx.uint16))
        return raw, np.array(xb.astype(mx.float32)).astype(np.float64)
    x = x32.astype(dtype)
    return x, x.astype(np.float64)


def _quantized(rng, N, K, gs, bits, dtype, mode="affine"):
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    mxd = {np.float32: mx.float32, np.float16: mx.float16, "bfloat16": mx.bfloat16}[dtype]
    if mode == "affine":
        wq, s, b = mx.quantize(w.astype(mxd), group_size=gs, bits=bits)
        wd = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
        bufs = {0: np.array(wq), 1: _as_dtype(_np(s), dtype)[0], 2: _as_dtype(_np(b), dtype)[0]}
    else:
        wq, s = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
        wd = mx.dequantize(wq, s, group_size=gs, bits=bits, mode=mode)
        bufs = {0: np.array(wq), 1: np.array(s)}  # buffer 2 (global scale) stays unbound, as MLX leaves it
    return bufs, _np(wd.astype(mx.float32)).astype(np.float64)


def _out(y, dtype):
    if dtype == "bfloat16":
        return np.array(mx.array(y).view(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    return y.astype(np.float64)


def _check(y, ref, dtype):
    tol = TOL[dtype]
    err = np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


QMV_CASES = [  # name, dtype, group size, bits, mode, M, N, K
    ("affine_qmv_fast_float_gs_64_b_4_batch_0", np.float32, 64, 4, "affine", 2, 16, 512),
    ("affine_qmv_fast_bfloat16_t_gs_32_b_8_batch_0", "bfloat16", 32, 8, "affine", 1, 8, 256),
    ("affine_qmv_half_gs_64_b_3_batch_0", np.float16, 64, 3, "affine", 1, 13, 192),
    ("mxfp4_qmv_fast_float_gs_32_b_4_r_4_batch_0", np.float32, 32, 4, "mxfp4", 1, 16, 512),
]


@pytest.mark.parametrize("name,dtype,gs,bits,mode,M,N,K", QMV_CASES, ids=[c[0] for c in QMV_CASES])
def test_mlx_qmv_matches_float64(lib, name, dtype, gs, bits, mode, M, N, K):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    bufs, wd = _quantized(rng, N, K, gs, bits, dtype, mode)
    x, x64 = _as_dtype(rng.standard_normal((M, K)).astype(np.float32), dtype)
    y = np.zeros((M, N), x.dtype)
    bufs.update({3: x, 4: y})
    # MLX's qmv(): grid (M, ceil(N / 8), B), threadgroup (32, 2); batch buffers 7.. unbound when B == 1
    lib.dispatch(name, buffers=bufs, bytes={5: np.int32(K), 6: np.int32(N)},
                 threadgroups=(M, -(-N // 8), 1), threads_per_threadgroup=(32, 2, 1))
    _check(_out(y, dtype), x64 @ wd.T, dtype)


def _qmm_t(lib, metalsim, M, N, K, check):
    rng = np.random.default_rng(7)
    bufs, wd = _quantized(rng, N, K, 64, 4, np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    y = np.zeros((M, N), np.float32)
    bufs.update({3: x, 4: y})
    # MLX's qmm(): BM = BN = 32, grid (ceil(N / 32), ceil(M / 32), B), threadgroup (32, WN=2, WM=2)
    lib.dispatch("affine_qmm_t_float_gs_64_b_4_alN_false_batch_0", buffers=bufs,
                 bytes={5: np.int32(K), 6: np.int32(N), 7: np.int32(M)},
                 threadgroups=(-(-N // 32), -(-M // 32), 1), threads_per_threadgroup=(32, 2, 2), check=check)
    return y.astype(np.float64), x.astype(np.float64) @ wd.T


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
def test_mlx_qmm_t_unaligned_n_matches_float64(lib, metalsim, check):
    """N % 32 != 0: the last tile is partial. This MLX version's QuantizedBlockLoader::load_safe
    bounds the rows it reads by the rows left (src_tile_dim.y), so checked mode finds no
    out-of-bounds read of the weights, scales or biases."""
    y, ref = _qmm_t(lib, metalsim, M=5, N=40, K=128, check=check)
    _check(y, ref, np.float32)
