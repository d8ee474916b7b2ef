"""Fidelity corpus: MLX's own Metal kernels, unmodified, on metalsim.

The headers come from the mlx-metal wheel (corpus.py); the only source written here is the
instantiation lines (MLX's `instantiate_kernel` macro, as its .metal files use it). Grids,
threadgroup sizes and buffer layouts follow MLX's host code (mlx/backend/metal/quantized.cpp:
qmv, qmm; matmul.cpp: gemv_axbpy, steel_matmul_regular_axpby). Every result is compared with float64 from the operands
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


# ---- gemv (gemv.h) and steel GEMM (steel_gemm_fused.h): the instantiation lines follow
# MLX's gemv.metal and steel_gemm_fused.metal; each file is its own library, as in MLX ----
GEMV_SRC = """
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/gemv.h"
instantiate_kernel("gemv_float32_bm4_bn1_sm1_sn32_tm4_tn4_nc0_axpby0", gemv, float, 4, 1, 1, 32, 4, 4, 0, 0)
instantiate_kernel("gemv_t_float16_bm1_bn2_sm8_sn4_tm4_tn4_nc0_axpby1", gemv_t, half, 1, 2, 8, 4, 4, 4, 0, 1)
"""
GEMM_SRC = """
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm.h"
#include "mlx/backend/metal/kernels/steel/gemm/kernels/steel_gemm_fused.h"
instantiate_kernel("steel_gemm_fused_nn_float32_float32_bm64_bn64_bk16_wm2_wn2", gemm, float, 64, 64, 16, 2, 2, false, false, float)
"""
# mlx/backend/metal/kernels/steel/gemm/params.h
GEMM_PARAMS = np.dtype([(n, np.int32) for n in ("M", "N", "K", "lda", "ldb", "ldd", "tiles_n", "tiles_m")]
                       + [(n, np.int64) for n in ("batch_stride_a", "batch_stride_b", "batch_stride_d")]
                       + [(n, np.int32) for n in ("swizzle_log", "gemm_k_iterations_aligned", "batch_ndim")],
                       align=True)
ADDMM_PARAMS = np.dtype([("ldc", np.int32), ("fdc", np.int32), ("batch_stride_c", np.int64),
                         ("alpha", np.float32), ("beta", np.float32)], align=True)


@pytest.fixture(scope="module")
def gemv_lib(metalsim):
    return metalsim.compile(GEMV_SRC, include_dirs=[corpus.mlx_include()], lazy=True)


@pytest.fixture(scope="module")
def gemm_lib(metalsim):
    return metalsim.compile(GEMM_SRC, include_dirs=[corpus.mlx_include()], lazy=True)


def _gemv_common(K, N, mat_ld, check):
    """The buffers MLX's gemv_axbpy sets for every gemv: sizes and the (unused, B == 1) batch layout."""
    return dict(bytes={4: np.int32(K), 5: np.int32(N), 6: np.int32(mat_ld), 9: np.int32(1),
                       10: np.array([1], np.int32), 11: np.array([K], np.int64), 12: np.array([K * N], np.int64)},
                check=check)


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
def test_mlx_gemv_matches_float64(gemv_lib, check):
    """y = x @ W.T with W (N, K) row-major: MLX's gemv() takes the non-transposed matrix kernel;
    K = 256, N = 40 < 4096 give bm 4, bn 1, sm 1, sn 32, tm 4, tn 4; N is not a multiple of
    the 16 rows a threadgroup computes."""
    rng = np.random.default_rng(11)
    N, K = 40, 256
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal(K).astype(np.float32)
    y = np.zeros(N, np.float32)
    kw = _gemv_common(K, N, K, check)
    # grid (ceil(N / (bm * sm * tm)), 1, B), threadgroup (32, bn, bm); buffers 2, 7, 8, 13, 14 (axpby) unbound
    gemv_lib.dispatch("gemv_float32_bm4_bn1_sm1_sn32_tm4_tn4_nc0_axpby0", buffers={0: w, 1: x, 3: y},
                      threadgroups=(-(-N // 16), 1, 1), threads_per_threadgroup=(32, 1, 4), **kw)
    _check(y.astype(np.float64), w.astype(np.float64) @ x.astype(np.float64), np.float32)


def _gemv_t_axpby(gemv_lib, N, check):
    rng = np.random.default_rng(12)
    K, alpha, beta = 128, 0.5, 2.0
    w = rng.standard_normal((K, N)).astype(np.float16)
    x = rng.standard_normal(K).astype(np.float16)
    c = rng.standard_normal(N).astype(np.float16)
    y = np.zeros(N, np.float16)
    kw = _gemv_common(K, N, N, check)
    kw["bytes"].update({7: np.float32(alpha), 8: np.float32(beta), 13: np.array([N], np.int64), 14: np.int32(1)})
    # grid (ceil(N / (bn * sn * tn)), 1, B), threadgroup (32, bn, bm)
    gemv_lib.dispatch("gemv_t_float16_bm1_bn2_sm8_sn4_tm4_tn4_nc0_axpby1", buffers={0: w, 1: x, 2: c, 3: y},
                      threadgroups=(-(-N // 32), 1, 1), threads_per_threadgroup=(32, 2, 1), **kw)
    ref = alpha * (x.astype(np.float64) @ w.astype(np.float64)) + beta * c.astype(np.float64)
    _check(y.astype(np.float64), ref, np.float16)


@pytest.mark.parametrize("N,check", [(40, False), (64, True)], ids=["N40-plain", "N64-checked"])
def test_mlx_gemv_t_axpby_matches_float64(gemv_lib, N, check):
    """y = alpha * (x @ W) + beta * c with W (K, N) row-major (MLX's addmm with a vector): the
    transposed-matrix kernel; K = 128 < 8192 and N < 512 give sm 8, sn 4, bn 2, tn 4, so a
    threadgroup computes 32 outputs."""
    _gemv_t_axpby(gemv_lib, N, check)


def test_mlx_gemv_t_partial_threadgroup_barrier_divergence(gemv_lib, metalsim):
    """N % 32 != 0: in the last threadgroup the threads whose columns lie past N skip the K
    loop, which holds a threadgroup_barrier, and exit; MSL requires every thread of the
    threadgroup to reach a barrier that any of them reaches, so checked mode reports it. The
    unchecked run above gives the right values because metalsim releases a barrier once every
    thread that has not exited waits at it; on a GPU the behaviour is undefined."""
    with pytest.raises(metalsim.KernelFault, match="barrier divergence"):
        _gemv_t_axpby(gemv_lib, 40, True)


GEMM_CASES = [  # M, N, K, alpha, beta (None: plain matmul, C unbound)
    (40, 72, 48, None, None),  # M, N not multiples of the 64x64 tile: align_M = align_N = false
    (64, 64, 40, 0.5, 2.0),    # tiles aligned, K % 16 != 0; D = alpha * A @ B + beta * C
]


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
@pytest.mark.parametrize("M,N,K,alpha,beta", GEMM_CASES, ids=["unaligned", "axpby"])
def test_mlx_steel_gemm_matches_float64(gemm_lib, M, N, K, alpha, beta, check):
    """MLX's steel_matmul_regular_axpby for float32 nn: bm = bn = 64, bk = 16, wm = wn = 2;
    the function constants as its host code sets them (a specialised build each)."""
    rng = np.random.default_rng(M * N + K)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    d = np.zeros((M, N), np.float32)
    bm = bn = 64
    tn, tm = -(-N // bn), -(-M // bm)
    params = np.zeros((), GEMM_PARAMS)
    for f, v in dict(M=M, N=N, K=K, lda=K, ldb=N, ldd=N, tiles_n=tn, tiles_m=tm, batch_stride_a=M * K,
                     batch_stride_b=K * N, batch_stride_d=M * N, swizzle_log=0,
                     gemm_k_iterations_aligned=K // 16, batch_ndim=1).items():
        params[f] = v
    use_out_source = alpha is not None
    fcs = {10: False, 100: use_out_source, 110: use_out_source and (alpha != 1 or beta != 1),
           200: M % bm == 0, 201: N % bn == 0, 202: K % 16 == 0}
    buffers, bytes_ = {0: a, 1: b, 3: d}, {4: params}
    ref = a.astype(np.float64) @ b.astype(np.float64)
    if use_out_source:
        c = rng.standard_normal((M, N)).astype(np.float32)
        addmm = np.zeros((), ADDMM_PARAMS)
        addmm["ldc"], addmm["fdc"], addmm["batch_stride_c"], addmm["alpha"], addmm["beta"] = N, 1, M * N, alpha, beta
        buffers[2], bytes_[5] = c, addmm
        ref = alpha * ref + beta * c.astype(np.float64)
    # grid (tiles_n, tiles_m, B), threadgroup (32, wn, wm); batch buffers 6, 7 unbound (has_batch false)
    gemm_lib.dispatch("steel_gemm_fused_nn_float32_float32_bm64_bn64_bk16_wm2_wn2", buffers=buffers, bytes=bytes_,
                      function_constants=fcs, threadgroups=(tn, tm, 1), threads_per_threadgroup=(32, 2, 2),
                      check=check)
    _check(d.astype(np.float64), ref, np.float32)
