"""quantize / dequantize / qmm for every mode of the format table: opcheck (schema, fake kernel,
autograd registration, AOT dispatch), shape-only (meta) runs equal to real ones, and
torch.compile(fullgraph=True, dynamic=True) tracing them whole."""

from __future__ import annotations

import pytest
import torch

import torch_qmm
from torch_qmm.formats import FORMATS

ops = torch.ops.torch_qmm


def _cases():
    """(mode, bits, group_size) for every allowed combination of every mode."""
    return [(m, b, g) for m, f in FORMATS.items() for b in f.bits for g in f.group_sizes[:2]]


def _ids(c):
    return f"{c[0]}-b{c[1]}-g{c[2]}"


def _meta(args):
    return tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)


def _packed(mode, bits, gs, rows, cols, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = ops.quantize(torch.randn(rows, cols, generator=g).to(dtype), mode, bits, gs)
    return out[0], out[1], (out[2] if len(out) == 3 else None)


@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_opcheck_quantize_and_dequantize(case):
    mode, bits, gs = case
    w = torch.randn(6, 256, dtype=torch.bfloat16)
    torch.library.opcheck(ops.quantize.default, (w, mode, bits, gs))
    wq, s, b = _packed(mode, bits, gs, 6, 256, torch.float16)
    torch.library.opcheck(ops.dequantize.default, (wq, s, b, mode, bits, gs))
    torch.library.opcheck(ops.dequantize.default, (wq, s, b, mode, bits, gs, torch.float32))
    real = ops.dequantize(wq, s, b, mode, bits, gs)
    meta = ops.dequantize(*_meta((wq, s, b)), mode, bits, gs)
    assert meta.shape == real.shape and meta.dtype == real.dtype
    for r, m in zip(ops.quantize(w, mode, bits, gs), ops.quantize(w.to("meta"), mode, bits, gs)):
        assert m.shape == r.shape and m.dtype == r.dtype and m.device.type == "meta"


@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_opcheck_qmm(case, transpose):
    mode, bits, gs = case
    # N != K, so a fake that confuses rows and columns is caught.
    K, N = 128, 48 if transpose else 64
    wq, s, b = _packed(mode, bits, gs, N, K) if transpose else _packed(mode, bits, gs, K, N)
    x = torch.randn(3, K, requires_grad=True)
    torch.library.opcheck(ops.qmm.default, (x, wq, s, b, mode, bits, gs, transpose))
    y = ops.qmm(*_meta((x.detach(), wq, s, b)), mode, bits, gs, transpose)
    assert y.shape == (3, N) and y.dtype == x.dtype and y.device.type == "meta"


@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
@pytest.mark.parametrize("mode", list(FORMATS))
def test_compiled_qmm_has_no_graph_breaks_and_one_graph_for_every_m(mode, transpose):
    f = FORMATS[mode]
    K, N = 128, 64
    wq, s, b = _packed(mode, f.default_bits, f.default_group_size, N, K) if transpose else _packed(
        mode, f.default_bits, f.default_group_size, K, N)
    frames = {"n": 0}

    def counting_backend(gm, example_inputs):
        frames["n"] += 1
        return gm.forward

    def fn(x):
        y = torch_qmm.quantized_matmul(x, wq, s, b, transpose=transpose, mode=mode)
        return torch.relu(y) + 1

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counting_backend)
    # M values unlike every weight dimension (duck sizing would tie M to an equal one and recompile).
    for m in (5, 11, 37):
        x = torch.randn(m, K)
        assert torch.equal(compiled(x), fn(x))
    assert frames["n"] == 1, f"compiled {frames['n']} graphs for 3 values of M"


@pytest.mark.parametrize("mode", list(FORMATS))
def test_compiled_quantize_dequantize_trace_whole(mode):
    f = FORMATS[mode]

    def fn(w):
        out = torch_qmm.quantize(w, mode=mode)
        return torch_qmm.dequantize(*out[:2], out[2] if len(out) == 3 else None, mode=mode, dtype=torch.float32)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
    for shape in ((4,), (9,), (3, 4), (2, 9)):  # leading dimensions too (a stack of experts)
        w = torch.randn(*shape, 4 * f.default_group_size)
        assert torch.equal(compiled(w), fn(w))


@pytest.mark.parametrize("mode", list(FORMATS))
def test_gradients_other_than_x_are_refused(mode):
    f = FORMATS[mode]
    wq, s, b = _packed(mode, f.default_bits, f.default_group_size, 16, 64)
    x = torch.randn(2, 64)
    scales = s.float().requires_grad_() if s.dtype != torch.uint8 else s
    if s.dtype != torch.uint8:
        y = ops.qmm(x, wq, scales, b, mode, f.default_bits, f.default_group_size, True)
        with pytest.raises(RuntimeError, match="torch_qmm.qmm: no gradient with respect to 'wq', 'scales' or 'biases'"):
            y.sum().backward()
    w = torch.randn(8, 64, requires_grad=True)
    out = ops.quantize(w, mode, f.default_bits, f.default_group_size)
    assert not any(t.requires_grad for t in out if not t.dtype.is_floating_point)
