"""Calls through which no gradient can flow (torch.no_grad, or no argument requiring grad) go from
the Python functions straight to the ops' kernels (torch_qmm/ops.py `_run`), without the Python
autograd kernel torch.library registers (torch/_library/autograd.py), which otherwise runs on every
call and only redispatches. Calls that need a gradient still take it. Results are compared bit
for bit with the same op run under torch.inference_mode (where no autograd kernel runs at all)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import torch_qmm
from gguf_helpers import Q4_K, random_k_blocks
from torch_qmm.nn import QuantLinear

AUTOGRAD_KERNEL = "torch/_library/autograd.py"


def autograd_kernel_calls(f):
    """(f(), how many Python functions of torch.library's autograd kernel ran during f)."""
    calls = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith(AUTOGRAD_KERNEL):
            calls.append(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        out = f()
    finally:
        sys.setprofile(None)
    return out, len(calls)


def _affine(n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch_qmm.quantize(torch.randn(n, k, generator=g), group_size=64, bits=4)


def _cases():
    wq, s, b = _affine()
    experts = [_affine(seed=e) for e in range(3)]
    ew, es, eb = (torch.stack(t) for t in zip(*experts))
    rhs = torch.tensor([2, 0], dtype=torch.int32)
    blocks = torch.from_numpy(random_k_blocks(Q4_K, 16, 256, np.random.default_rng(1)).reshape(16, -1))
    return {
        "quantized_matmul": (lambda x: torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4), 256),
        "quantized_matmul int8": (lambda x: torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4,
                                                                       activations="int8"), 256),
        "gather_qmm": (lambda x: torch_qmm.gather_qmm(x, ew, es, eb, rhs_indices=rhs, group_size=64, bits=4), 256),
        "gguf_matmul": (lambda x: torch_qmm.ops.gguf_matmul(x, blocks, int(Q4_K), 16, 256), 256),
    }


CASES = ["quantized_matmul", "quantized_matmul int8", "gather_qmm", "gguf_matmul"]


@pytest.mark.parametrize("name", CASES)
def test_no_grad_calls_skip_the_python_autograd_kernel(name):
    f, k = _cases()[name]
    x = torch.randn(2, 1, k, requires_grad=True) if name == "gather_qmm" else torch.randn(3, k, requires_grad=True)
    with torch.inference_mode():
        expected = f(x.detach())
    with torch.no_grad():
        y, calls = autograd_kernel_calls(lambda: f(x))
    assert calls == 0
    assert not y.requires_grad
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # Grad mode on, but nothing requires grad: the same.
    y, calls = autograd_kernel_calls(lambda: f(x.detach()))
    assert calls == 0 and y.grad_fn is None
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in CASES if "int8" not in n])
def test_calls_that_need_a_gradient_take_the_autograd_kernel(name):
    f, k = _cases()[name]
    x = torch.randn(2, 1, k, requires_grad=True) if name == "gather_qmm" else torch.randn(3, k, requires_grad=True)
    y, calls = autograd_kernel_calls(lambda: f(x))
    assert calls > 0 and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_quant_linear_under_no_grad():
    layer = QuantLinear.from_linear(torch.nn.Linear(256, 64), bits=4, group_size=64)
    x = torch.randn(5, 256)
    with torch.inference_mode():
        expected = layer(x)
    with torch.no_grad():
        y, calls = autograd_kernel_calls(lambda: layer(x))
    assert calls == 0
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # Parameters that require grad (a bias, trained with the codes frozen) take the autograd kernel.
    layer.bias.requires_grad_(True)
    y, calls = autograd_kernel_calls(lambda: layer(x.requires_grad_(True)))
    assert calls > 0
    y.sum().backward()
    assert layer.bias.grad is not None


def test_vmap_keeps_the_graph_of_x():
    # Under torch.func.vmap x is a batched wrapper that does not show the requires_grad of the
    # tensor it wraps: the call must still take the autograd kernel (gradients as without vmap).
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(128, 64), bits=8, group_size=32)
    x = torch.randn(4, 128, requires_grad=True)
    y = torch.func.vmap(layer)(x)
    assert y.requires_grad
    (g_vmap,) = torch.autograd.grad(y.sum() + x.sum(), x)
    (g_eager,) = torch.autograd.grad(layer(x).sum() + x.sum(), x)
    torch.testing.assert_close(g_vmap, g_eager, rtol=0, atol=0)
    for name in CASES:
        f, k = _cases()[name]
        if "int8" in name:
            continue
        x = torch.randn(2, 2, 1, k, requires_grad=True) if name == "gather_qmm" else torch.randn(2, 3, k, requires_grad=True)
        assert torch.func.vmap(f)(x).requires_grad, name


def test_a_torch_function_mode_or_subclass_keeps_autograd():
    # A mode or subclass may compute the product itself from tensors that require grad (a shadow
    # float weight, say) while x does not: the call stays an ordinary op call, and the graph theirs.
    from torch.overrides import TorchFunctionMode

    wq, s, b = _affine()
    shadow = torch_qmm.dequantize(wq, s, b, group_size=64, bits=4).clone().requires_grad_()
    qmm_ops = (torch.ops.torch_qmm.qmm.default, torch.ops.torch_qmm.qmm)

    class Shadow(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return args[0] @ shadow.T if func in qmm_ops else func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in qmm_ops:
                return args[0].as_subclass(torch.Tensor) @ shadow.T
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.randn(3, 256)
    with Shadow():
        y = torch_qmm.quantized_matmul(x, wq, s, b, group_size=64, bits=4)
    assert y.grad_fn is not None
    y = torch_qmm.quantized_matmul(x.as_subclass(Sub), wq, s, b, group_size=64, bits=4)
    assert y.requires_grad
