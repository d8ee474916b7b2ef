"""Fidelity corpus: llama.cpp's Metal matrix-vector kernels (kernels/mul_mv.metal from the
llama-cpp-python sdist, unmodified, with its own instantiations) on metalsim.

Dispatch as llama.cpp's host code does (ggml-metal-ops.cpp ggml_metal_op_mul_mat, and
ggml-metal-device.cpp ggml_metal_library_get_pipeline_mul_mv): the ggml_metal_kargs_mul_mv
struct at buffer 0, src0 (the quantized rows) at 1, src1 (float32 activations) at 2, dst at 3,
threadgroup memory `smem` at threadgroup(0), function constants FC_MUL_MV + 0/2/3/4/5 (nsg,
ne12, r2, r3, split), threadgroups (ceil(ne01 / (nr0 * nsg)), ne11, 1) of (32, nsg, 1)
threads (Q8_0: ceil(ne01 / nr0)). Blocks come from the gguf package (quantize for Q4_0/Q8_0,
random K-quant blocks for Q4_K, which gguf cannot quantize); its dequantize gives the weights
whose float64 product is the reference. The kernels sum in float32: 1e-5 relative.
"""
import ctypes

import numpy as np
import pytest

import metalsim_corpus as corpus

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf_helpers import random_k_blocks  # noqa: E402

FC_MUL_MV = 600
# type: (kernel, nr0, nsg, smem bytes, grid divides rows by nr0 only)
KERNELS = {
    Q.Q4_0: ("kernel_mul_mv_q4_0_f32", 4, 2, 0, False),
    Q.Q8_0: ("kernel_mul_mv_q8_0_f32", 2, 4, 32 * 4 * 2, True),
    Q.Q4_K: ("kernel_mul_mv_q4_K_f32", 2, 2, 0, False),
}


class KargsMulMv(ctypes.Structure):
    """ggml_metal_kargs_mul_mv (ggml-metal-impl.h), natural C alignment like Metal's."""
    _fields_ = [("ne00", ctypes.c_int32), ("ne01", ctypes.c_int32), ("ne02", ctypes.c_int32),
                ("nb00", ctypes.c_uint64), ("nb01", ctypes.c_uint64), ("nb02", ctypes.c_uint64),
                ("nb03", ctypes.c_uint64), ("ne10", ctypes.c_int32), ("ne11", ctypes.c_int32),
                ("ne12", ctypes.c_int32), ("nb10", ctypes.c_uint64), ("nb11", ctypes.c_uint64),
                ("nb12", ctypes.c_uint64), ("nb13", ctypes.c_uint64), ("ne0", ctypes.c_int32),
                ("ne1", ctypes.c_int32), ("nr0", ctypes.c_int32), ("r2", ctypes.c_int16), ("r3", ctypes.c_int16)]


@pytest.fixture(scope="module")
def lib(metalsim):
    root = corpus.llama_metal()
    return metalsim.compile(root / "ggml-metal" / "kernels" / "mul_mv.metal",
                            include_dirs=[root / "ggml-metal", root], lazy=True)


def _mul_mv(lib, qtype, N, check=False, follow=0):
    """dst = x @ W.T for N rows of type qtype; src0 is bound as the start of a buffer that holds
    `follow` more bytes after the tensor."""
    name, nr0, nsg, smem, rows_by_nr0 = KERNELS[qtype]
    rng = np.random.default_rng(int(qtype))
    K, M = 512, 2  # ne00 = K, ne11 = M activation rows
    if qtype == Q.Q4_K:
        src0 = random_k_blocks(qtype, N, K, rng)
    else:
        src0 = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    w = gguf.quants.dequantize(src0, qtype).astype(np.float64).reshape(N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    dst = np.zeros((M, N), np.float32)
    src0 = np.ascontiguousarray(src0).reshape(-1)
    row = src0.nbytes // N
    buf = np.concatenate([src0.view(np.uint8), rng.integers(0, 256, follow, dtype=np.uint8)])
    a = KargsMulMv(ne00=K, ne01=N, ne02=1, nb00=0, nb01=row, nb02=row * N, nb03=row * N, ne10=K, ne11=M, ne12=1,
                   nb10=4, nb11=4 * K, nb12=4 * K * M, nb13=4 * K * M, ne0=N, ne1=M, nr0=nr0, r2=1, r3=1)
    gx = -(-N // nr0) if rows_by_nr0 else -(-N // (nr0 * nsg))
    lib.dispatch(name, buffers={1: buf, 2: x, 3: dst}, bytes={0: a},
                 function_constants={FC_MUL_MV + 0: np.int16(nsg), FC_MUL_MV + 2: np.int16(1),
                                     FC_MUL_MV + 3: np.int16(1), FC_MUL_MV + 4: np.int16(1),
                                     FC_MUL_MV + 5: np.bool_(False)},
                 threadgroup_memory={0: smem}, threadgroups=(gx, M, 1), threads_per_threadgroup=(32, nsg, 1),
                 check=check)
    ref = x.astype(np.float64) @ w.T
    err = np.abs(dst - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, f"max relative error {err:.3g}"
    return row


@pytest.mark.parametrize("qtype", list(KERNELS), ids=[t.name for t in KERNELS])
def test_llamacpp_mul_mv_matches_float64(lib, qtype):
    # ne01 = 16 rows: a multiple of the rows a threadgroup computes (nr0 * nsg, or nr0)
    _mul_mv(lib, qtype, 16)


def test_llamacpp_q4_0_partial_row_tile_reads_what_follows_the_tensor(lib, metalsim):
    """ne01 = 12 rows, not a multiple of the 8 a Q4_0 threadgroup computes: the last simdgroup
    reads rows 12..15 (their results are not written). ggml does not pad a weight tensor (its
    Metal buffer type's get_alloc_size is ggml_nbytes); tensors lie one after another in one
    MTLBuffer (32-byte alignment; a model's weights are its mmap'd GGUF file), rounded up to the
    page size. So the read stays inside the MTLBuffer when other tensor bytes follow, as bound
    here (checked mode finds no fault), and leaves it when the tensor ends the buffer exactly."""
    row = _mul_mv(lib, Q.Q4_0, 12, check=True, follow=4 * 288)  # 4 more rows' worth of bytes
    assert row == 288  # 16 blocks of 18 bytes
    with pytest.raises(metalsim.KernelFault, match=r"out-of-bounds device read .*buffer\(1\)"):
        _mul_mv(lib, Q.Q4_0, 12, check=True)
