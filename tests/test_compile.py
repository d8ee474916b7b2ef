"""The ops are well-formed custom ops: opcheck passes and torch.compile traces them whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_qmm
from torch_qmm.nn import QuantLinear


def _packed(n=48, k=128, bits=4, gs=64, dtype=torch.float32):
    return torch_qmm.quantize(torch.randn(n, k).to(dtype), group_size=gs, bits=bits)


@pytest.mark.parametrize("bits", [3, 4])
def test_opcheck_affine_quantize(bits):
    torch.library.opcheck(torch.ops.torch_qmm.affine_quantize.default, (torch.randn(24, 128), bits, 64))


def test_opcheck_affine_dequantize():
    wq, s, b = _packed(dtype=torch.float16)
    torch.library.opcheck(torch.ops.torch_qmm.affine_dequantize.default, (wq, s, b, 4, 64))


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_opcheck_affine_qmm(transpose, m):
    wq, s, b = _packed()
    k = 128 if transpose else 48
    x = torch.randn(m, k)
    torch.library.opcheck(torch.ops.torch_qmm.affine_qmm.default, (x, wq, s, b, 4, 64, transpose))


def test_compiled_quant_linear_stack_has_no_graph_breaks_or_recompiles():
    torch.manual_seed(0)
    model = nn.Sequential(
        QuantLinear.from_linear(nn.Linear(128, 256), bits=4, group_size=64),
        nn.GELU(),
        QuantLinear.from_linear(nn.Linear(256, 128), bits=3, group_size=32),
    )
    counts = {"frames": 0}

    def counting_backend(gm, example_inputs):
        counts["frames"] += 1
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counting_backend)
    with torch.no_grad():
        for m in (2, 7, 16, 33, 64):
            x = torch.randn(m, 128)
            assert torch.equal(compiled(x), model(x))
        assert counts["frames"] == 1, f"compiled {counts['frames']} graphs for 5 values of M >= 2"
        # Dynamo specializes sizes 0 and 1 by design (its own rule, not ours): M=1 may add one graph.
        x = torch.randn(1, 128)
        assert torch.equal(compiled(x), model(x))
        assert counts["frames"] <= 2


def test_compiled_with_inductor_matches_eager():
    torch.manual_seed(1)
    model = nn.Sequential(QuantLinear.from_linear(nn.Linear(64, 96), bits=4, group_size=32), nn.ReLU())
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (3, 9):
            x = torch.randn(m, 64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)


def test_quant_linear_under_autocast_traces_whole():
    # QuantLinear follows torch.autocast (torch_qmm.nn.follows_autocast): the region's state is
    # read while tracing, so layers of two compute dtypes under autocast trace as one graph that
    # computes eager's result (the graph run as traced, so bit for bit), and the same compiled
    # module outside autocast still refuses float32 x for the bfloat16 layer.
    torch.manual_seed(2)
    model = nn.Sequential(QuantLinear.from_linear(nn.Linear(128, 64).to(torch.bfloat16), bits=4, group_size=64),
                          nn.GELU(), QuantLinear.from_linear(nn.Linear(64, 32), bits=4, group_size=32))
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counting_backend)
    x = torch.randn(6, 128)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        got = compiled(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want) and len(graphs) == 1
    with torch.no_grad(), pytest.raises(Exception, match="must have the dtype of 'scales'"):
        compiled(x)
