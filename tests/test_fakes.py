"""The fake (meta) kernels: opcheck for every op x bits x transpose, and shape-only runs that
refuse exactly what the real kernels refuse (csrc/meta.cpp runs the validators of
csrc/validate.h and csrc/gguf_validate.h).

Every bad-argument case below runs twice, once on real CPU tensors and once on meta tensors of
the same shapes and dtypes, and must raise the same exception type with the same message; a
good case must give the real output's shape and dtype."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_qmm
from gguf_helpers import Q4_K, Q6_K, random_k_blocks

ops = torch.ops.torch_qmm
BITS = (2, 3, 4, 5, 6, 8)


def _packed(rows, cols, bits, gs=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch_qmm.quantize(torch.randn(rows, cols, generator=g).to(dtype), group_size=gs, bits=bits)


@pytest.mark.parametrize("bits", BITS)
def test_opcheck_quantize_and_dequantize(bits):
    w = torch.randn(6, 96)
    torch.library.opcheck(ops.affine_quantize.default, (w, bits, 32))
    wq, s, b = _packed(6, 96, bits, dtype=torch.bfloat16)
    torch.library.opcheck(ops.affine_dequantize.default, (wq, s, b, bits, 32))


@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
@pytest.mark.parametrize("bits", BITS)
def test_opcheck_affine_qmm(bits, transpose):
    # N != K, so a fake that confuses rows, columns or bits is caught: W [N, K] = [40, 96]
    # (transpose=True) or W [K, N] = [96, 64] (quantized along N).
    K, N = 96, 40 if transpose else 64
    wq, s, b = _packed(N, K, bits) if transpose else _packed(K, N, bits)
    x = torch.randn(3, K)
    torch.library.opcheck(ops.affine_qmm.default, (x, wq, s, b, bits, 32, transpose))
    y = ops.affine_qmm(*_meta((x, wq, s, b)), bits, 32, transpose)
    assert y.shape == (3, N) and y.dtype == x.dtype and y.device.type == "meta"


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_opcheck_gguf_qmm(ggml_type):
    blocks = torch.from_numpy(random_k_blocks(ggml_type, 5, 512, np.random.default_rng(0)))
    torch.library.opcheck(ops.gguf_qmm.default, (torch.randn(2, 512), blocks, int(ggml_type), 5, 512))


def _meta(args):
    return tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)


def _error(op, args):
    try:
        op(*args)
    except Exception as e:  # noqa: BLE001  (the type is what is compared)
        return type(e), str(e).split("\n")[0]
    return None


def _assert_same_refusal(op, args):
    real = _error(op, args)
    assert real is not None, "the real kernel accepted a bad case"
    meta = _error(op, _meta(args))
    assert meta == real, f"meta: {meta}\nreal: {real}"
    return real


U32 = torch.uint32


def _qmm_bad_cases():
    wq, s, b = _packed(8, 128, 4)
    x = torch.randn(2, 128)
    return {
        "K=127": (x[:, :127], wq, s, b, 4, 32, True),
        "bits=7": (x, wq, s, b, 7, 32, True),
        "bits=0": (x, wq, s, b, 0, 32, True),
        "group_size=48": (x, wq, s, b, 4, 48, True),
        "int32 x": (x.to(torch.int32), wq, s, b, 4, 32, True),
        "float16 x, float32 scales": (x.half(), wq, s, b, 4, 32, True),
        "float32 wq": (x, wq.view(torch.int32).float(), s, b, 4, 32, True),
        "1-D wq": (x, wq.reshape(-1), s, b, 4, 32, True),
        "scales [8, 3]": (x, wq, s[:, :3], b, 4, 32, True),
        "biases [8, 3]": (x, wq, s, b[:, :3], 4, 32, True),
        "biases float16": (x, wq, s, b.half(), 4, 32, True),
        "scales int32": (x, wq, s.to(torch.int32), b.to(torch.int32), 4, 32, True),
        "bits 3 width": (x, wq, s, b, 3, 32, True),
        "x K for transpose=False": (x, wq, s, b, 4, 32, False),
        "scalar x": (torch.tensor(1.0), wq, s, b, 4, 32, True),
        "expanded wq [1, 2^59]": (torch.randn(1, 4), torch.zeros(1, 1, dtype=U32).expand(1, 2**59),
                                  torch.zeros(1, 0), torch.zeros(1, 0), 4, 32, True),
    }


@pytest.mark.parametrize("case", sorted(_qmm_bad_cases()), ids=lambda c: re.sub(r"\W+", "-", c))
def test_meta_affine_qmm_refuses_what_the_kernel_refuses(case):
    _assert_same_refusal(ops.affine_qmm, _qmm_bad_cases()[case])


def test_int64_overflow_of_the_packed_width_is_refused():
    wq = torch.zeros(1, 1, dtype=U32).expand(1, 2**59)
    kind, message = _assert_same_refusal(ops.affine_dequantize, (wq, torch.zeros(1, 0), torch.zeros(1, 0), 4, 32))
    assert kind is ValueError and "'wq'" in message and "int64" in message


def _other_bad_cases():
    wq, s, b = _packed(8, 128, 4)
    blocks = torch.from_numpy(random_k_blocks(Q4_K, 3, 256, np.random.default_rng(1)))
    x = torch.randn(2, 256)
    return {
        "quantize bits=7": (ops.affine_quantize, (torch.randn(4, 64), 7, 32)),
        "quantize bits=0": (ops.affine_quantize, (torch.randn(4, 64), 0, 32)),
        "quantize K=48": (ops.affine_quantize, (torch.randn(4, 48), 4, 32)),
        "quantize int32 w": (ops.affine_quantize, (torch.ones(4, 64, dtype=torch.int32), 4, 32)),
        "quantize scalar": (ops.affine_quantize, (torch.tensor(1.0), 4, 32)),
        "dequantize bits=5": (ops.affine_dequantize, (wq, s, b, 5, 32)),
        "dequantize scales shape": (ops.affine_dequantize, (wq, s[:4], b[:4], 4, 32)),
        "dequantize float32 wq": (ops.affine_dequantize, (wq.view(torch.int32).float(), s, b, 4, 32)),
        "gguf K=0": (ops.gguf_qmm, (x[:, :0], blocks[:, :0], int(Q4_K), 3, 0)),
        "gguf K=255": (ops.gguf_qmm, (x[:, :255], blocks, int(Q4_K), 3, 255)),
        "gguf N=-1": (ops.gguf_qmm, (x, blocks, int(Q4_K), -1, 256)),
        "gguf type Q8_0": (ops.gguf_qmm, (x, blocks, 8, 3, 256)),
        "gguf blocks for Q6_K": (ops.gguf_qmm, (x, blocks, int(Q6_K), 3, 256)),
        "gguf blocks int8": (ops.gguf_qmm, (x, blocks.view(torch.int8), int(Q4_K), 3, 256)),
        "gguf x K=512": (ops.gguf_qmm, (torch.randn(2, 512), blocks, int(Q4_K), 3, 256)),
        "gguf x int32": (ops.gguf_qmm, (x.to(torch.int32), blocks, int(Q4_K), 3, 256)),
    }


@pytest.mark.parametrize("case", sorted(_other_bad_cases()), ids=lambda c: re.sub(r"\W+", "-", c))
def test_meta_quantize_dequantize_gguf_refuse_what_the_kernels_refuse(case):
    op, args = _other_bad_cases()[case]
    _assert_same_refusal(op, args)


def test_gguf_k_zero_is_a_value_error_not_a_crash():
    # In a child process: without the check the kernel divides by K = 0 and the process dies.
    code = (
        "import torch, torch_qmm\n"
        "try:\n"
        "    torch.ops.torch_qmm.gguf_qmm(torch.zeros(2, 0), torch.zeros(3, 0, dtype=torch.uint8), 12, 3, 0)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, f"gguf_qmm with K=0 killed the process (status {r.returncode}): {r.stderr[-500:]}"
    assert "argument 'K' must be a positive multiple of 256" in r.stdout, r.stdout + r.stderr


def test_meta_outputs_have_the_real_shapes_and_dtypes():
    for bits in BITS:
        for transpose in (True, False):
            wq, s, b = _packed(24, 64, bits, dtype=torch.float16)
            x = torch.randn(2, 5, 64 if transpose else 24).half()
            real = ops.affine_qmm(x, wq, s, b, bits, 32, transpose)
            meta = ops.affine_qmm(*_meta((x, wq, s, b)), bits, 32, transpose)
            assert (meta.shape, meta.dtype) == (real.shape, real.dtype), (bits, transpose)
        w = torch.randn(3, 2, 64).bfloat16()
        for r, m in zip(ops.affine_quantize(w, bits, 32), ops.affine_quantize(w.to("meta"), bits, 32)):
            assert (m.shape, m.dtype) == (r.shape, r.dtype), bits
        wq, s, b = _packed(24, 64, bits)
        r, m = ops.affine_dequantize(wq, s, b, bits, 32), ops.affine_dequantize(*_meta((wq, s, b)), bits, 32)
        assert (m.shape, m.dtype) == (r.shape, r.dtype), bits


# ---- every mode, and the ops the cases above leave out ---------------------------------------------

from torch_qmm.formats import FORMATS  # noqa: E402


def _packed_mode(mode, rows, cols, dtype=torch.float32, seed=0):
    f = FORMATS[mode]
    g = torch.Generator().manual_seed(seed)
    out = ops.quantize(torch.randn(rows, cols, generator=g).to(dtype), mode, f.default_bits, f.default_group_size)
    return out[0], out[1], (out[2] if len(out) == 3 else None), f.default_bits, f.default_group_size


def _mode_bad_cases(mode):
    """Per mode: qmm / dequantize / quantize calls the real kernels refuse (each a different check)."""
    wq, s, b, bits, gs = _packed_mode(mode, 8, 128)
    x = torch.randn(2, 128)
    other_bits = next(v for v in (7, 2, 3, 5) if v not in FORMATS[mode].bits)
    other_gs = next(v for v in (48, 16, 32, 64) if v not in FORMATS[mode].group_sizes)
    wrong_scales = s.float() if s.dtype == torch.uint8 else s.to(torch.uint8)
    wrong_biases = torch.zeros_like(s, dtype=torch.float32) if b is None else None
    w = torch.randn(4, 128)
    return {
        "qmm bits": (ops.qmm, (x, wq, s, b, mode, other_bits, gs, True)),
        "qmm group_size": (ops.qmm, (x, wq, s, b, mode, bits, other_gs, True)),
        "qmm scales dtype": (ops.qmm, (x, wq, wrong_scales, b, mode, bits, gs, True)),
        "qmm biases presence": (ops.qmm, (x, wq, s, wrong_biases, mode, bits, gs, True)),
        "qmm scales shape": (ops.qmm, (x, wq, s[:, :-1], None if b is None else b[:, :-1], mode, bits, gs, True)),
        "qmm x K transpose=False": (ops.qmm, (x, wq, s, b, mode, bits, gs, False)),
        "qmm x float64": (ops.qmm, (x.double(), wq, s, b, mode, bits, gs, True)),
        "qmm wq int32": (ops.qmm, (x, wq.view(torch.int32), s, b, mode, bits, gs, True)),
        "qmm mode": (ops.qmm, (x, wq, s, b, mode + "x", bits, gs, True)),
        "dequantize scales dtype": (ops.dequantize, (wq, wrong_scales, b, mode, bits, gs, None)),
        "dequantize biases presence": (ops.dequantize, (wq, s, wrong_biases, mode, bits, gs, None)),
        "dequantize dtype float64": (ops.dequantize, (wq, s, b, mode, bits, gs, torch.float64)),
        "dequantize wq 3-D": (ops.dequantize, (wq[None], s[None], None if b is None else b[None], mode, bits, gs, None)),
        "dequantize bits": (ops.dequantize, (wq, s, b, mode, other_bits, gs, None)),
        "quantize bits": (ops.quantize, (w, mode, other_bits, gs)),
        "quantize group_size": (ops.quantize, (w, mode, bits, other_gs)),
        "quantize K": (ops.quantize, (w[:, : 128 - gs // 2], mode, bits, gs)),
        "quantize 1-D": (ops.quantize, (w[0], mode, bits, gs)),
        "quantize float64": (ops.quantize, (w.double(), mode, bits, gs)),
        "quantize int32": (ops.quantize, (w.to(torch.int32), mode, bits, gs)),
        "int8 x mode": (ops.qmm_int8_activations, (x, wq, s, b, mode if mode != "affine" else "mxfp4", bits, gs)),
        "int8 x K": (ops.qmm_int8_activations, (x[:, :96], wq, s, b, mode, bits, gs)),
    }


_MODE_CASES = [(m, c) for m in FORMATS for c in sorted(_mode_bad_cases("affine"))]


@pytest.mark.parametrize("mode, case", _MODE_CASES, ids=[f"{m}-{re.sub(r'[^A-Za-z0-9=]+', '-', c)}" for m, c in _MODE_CASES])
def test_meta_refuses_what_the_kernels_refuse_in_every_mode(mode, case):
    op, args = _mode_bad_cases(mode)[case]
    kind, message = _assert_same_refusal(op, args)
    assert kind in (ValueError, TypeError), message
    assert re.search(r"'(\w+)'", message), f"the message names no argument: {message}"


def test_gguf_int8_activations_meta_refuses_what_the_kernel_refuses():
    blocks = torch.from_numpy(random_k_blocks(Q4_K, 3, 256, np.random.default_rng(2)))
    x = torch.randn(2, 256)
    for args in [(x[:, :255], blocks, int(Q4_K), 3, 255), (x, blocks, 8, 3, 256), (x, blocks, int(Q6_K), 3, 256),
                 (torch.randn(2, 512), blocks, int(Q4_K), 3, 256), (x.double(), blocks, int(Q4_K), 3, 256),
                 (x, blocks, int(Q4_K), 0, 256), (x, blocks[:2], int(Q4_K), 3, 256)]:
        _assert_same_refusal(ops.gguf_qmm_int8_activations, args)


def _gather_good_cases():
    cases = []
    for mode in FORMATS:
        wq, s, b, bits, gs = _packed_mode(mode, 3 * 24, 64)
        wq, s = wq.reshape(3, 24, -1), s.reshape(3, 24, -1)
        b = None if b is None else b.reshape(3, 24, -1)
        # (x shape, lhs, rhs): no indices, rhs broadcasting against x's batch, both given.
        for xs, lhs, rhs in [((3, 5, 64), None, None), ((4, 1, 2, 64), None, torch.tensor([[0, 2]])),
                             ((2, 7, 64), torch.tensor([1, 0, 1]), torch.tensor([2, 2, 0]))]:
            cases.append((mode, (torch.randn(xs), wq, s, b, lhs, rhs, mode, bits, gs, True, False)))
        wqn, sn, bn, _, _ = _packed_mode(mode, 2 * 64, 192)  # transpose=False: W [K=64, N=192] per expert
        cases.append((mode, (torch.randn(2, 3, 64), wqn.reshape(2, 64, -1), sn.reshape(2, 64, -1),
                             None if bn is None else bn.reshape(2, 64, -1), None, torch.tensor([1, 1]), mode, bits,
                             gs, False, False)))
    return cases


@pytest.mark.parametrize("i", range(len(_gather_good_cases())))
def test_meta_gather_qmm_gives_the_real_shape_and_dtype(i):
    mode, args = _gather_good_cases()[i]
    real = ops.gather_qmm(*args)
    meta = ops.gather_qmm(*_meta(args))
    assert meta.device.type == "meta"
    assert (tuple(meta.shape), meta.dtype) == (tuple(real.shape), real.dtype), mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_meta_int8_activation_ops_give_the_real_shapes_and_dtypes(dtype):
    wq, s, b = _packed(40, 96, 4, dtype=dtype)
    x = torch.randn(2, 3, 96).to(dtype)
    real = ops.qmm_int8_activations(x, wq, s, b, "affine", 4, 32)
    meta = ops.qmm_int8_activations(*_meta((x, wq, s, b)), "affine", 4, 32)
    assert (tuple(meta.shape), meta.dtype) == (tuple(real.shape), real.dtype) == ((2, 3, 40), dtype)
    blocks = torch.from_numpy(random_k_blocks(Q6_K, 5, 512, np.random.default_rng(3)))
    xg = torch.randn(4, 512).to(dtype)
    for op in (ops.gguf_qmm, ops.gguf_qmm_int8_activations):
        real, meta = op(xg, blocks, int(Q6_K), 5, 512), op(*_meta((xg, blocks)), int(Q6_K), 5, 512)
        assert (tuple(meta.shape), meta.dtype) == (tuple(real.shape), real.dtype) == ((4, 5), dtype)
