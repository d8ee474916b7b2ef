"""Regression tests for bugs found by trying to break the library (one test per bug)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from torch import nn

import torch_qmm
from torch_qmm import reference
from torch_qmm.interop.safetensors_io import Checkpoint
from tolerance import assert_matches_reference


# ---- autograd: backward used to return no gradient silently (PyTorch's fallback + a warning) ----


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("m", [1, 5, 20])
def test_affine_qmm_gradient_wrt_x_matches_reference(device, transpose, m):
    g = torch.Generator().manual_seed(m)
    bits, gs = 4, 32
    rows, cols = (24, 64) if transpose else (40, 64)  # W [N, K] (transpose) or [K, N]
    wq, scales, biases = torch_qmm.quantize(torch.randn(rows, cols, generator=g), gs, bits)
    k = cols if transpose else rows
    x = torch.randn(2, m, k, generator=g).requires_grad_()
    y = torch.ops.torch_qmm.affine_qmm(x, wq, scales, biases, bits, gs, transpose)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    assert x.grad is not None
    # dx = dy @ W (transpose) or dy @ W.T: the float64 reference with the other transpose.
    dy2 = dy.reshape(-1, y.shape[-1])
    ref = reference.qmm(dy2, wq, scales, biases, bits, gs, not transpose).reshape(x.shape)
    mag = reference.qmm_magnitude(dy2, wq, scales, biases, bits, gs, not transpose).reshape(x.shape)
    assert_matches_reference(x.grad, ref, mag, torch.float32, "dx")


def test_quant_linear_passes_gradient_to_earlier_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    torch_qmm.quantize_model(model, bits=4, group_size=64, filter_fn=lambda name, _: name == "1")
    model(torch.randn(3, 64)).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("operand", ["scales", "biases"])
def test_backward_into_quantized_weights_is_a_clear_error(device, operand):
    wq, scales, biases = torch_qmm.quantize(torch.randn(8, 64), 32, 4)
    {"scales": scales, "biases": biases}[operand].requires_grad_()
    y = torch.ops.torch_qmm.affine_qmm(torch.randn(2, 64), wq, scales, biases, 4, 32, True)
    with pytest.raises(RuntimeError, match="no gradient with respect to 'wq', 'scales' or 'biases'"):
        y.sum().backward()


def test_backward_through_gguf_qmm_int8_activations_is_a_clear_error():
    # gguf_qmm itself is differentiable in x (tests/test_gguf_qmm_backward.py); its int8-activation
    # twin, which GGUFLinear takes under activation_quantization("int8"), rounds x and refuses, as
    # qmm_int8_activations does.
    blocks = torch.zeros(4, 144, dtype=torch.uint8)  # Q4_K, all-zero blocks (d = 0)
    x = torch.randn(2, 256, requires_grad=True)
    with torch_qmm.activation_quantization("int8"):
        y = torch_qmm.ops.gguf_matmul(x, blocks, 12, 4, 256)
    with pytest.raises(RuntimeError, match="gguf_qmm_int8_activations: no gradient"):
        y.sum().backward()


def test_backward_through_dequantize_is_a_clear_error(device):
    wq, scales, biases = torch_qmm.quantize(torch.randn(8, 64), 32, 4)
    w = torch_qmm.dequantize(wq, scales.requires_grad_(), biases, 32, 4)
    with pytest.raises(RuntimeError, match="torch_qmm.dequantize: no gradient"):
        w.sum().backward()


# ---- quantize_model: a layer shared by two parents was replaced at its first name only ----------


def test_quantize_model_replaces_a_shared_layer_everywhere():
    torch.manual_seed(0)
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 64)
    summary = torch_qmm.quantize_model(model, bits=8, group_size=64)
    assert type(model[0]) is torch_qmm.nn.QuantLinear and model[2] is model[0]
    assert summary.converted == ["0", "2"]
    # Counted once: the shared weight is stored once before and after.
    stored = list(model.parameters()) + list(model.buffers())  # deduplicated by PyTorch
    assert summary.bytes_after == sum(t.numel() * t.element_size() for t in stored)
    q = model[0]
    w = reference.dequantize(q.qweight, q.scales, q.biases, 8, 64)
    ref = torch.relu(x.double() @ w.T + q.bias.double()) @ w.T + q.bias.double()
    torch.testing.assert_close(model(x).double(), ref, rtol=1e-5, atol=1e-5)


# ---- safetensors headers that lie: every one must be a ValueError naming file and tensor --------


def _write_safetensors(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}, "bad shape"),
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "bad shape"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 3]}, "bad data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}, "bad data_offsets"),
        ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "unsupported dtype"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, r"leaves bytes \[0, 8\) unused"),
    ],
)
def test_safetensors_header_with_bad_fields_is_a_clear_error(tmp_path, entry, match):
    path = _write_safetensors(tmp_path / "w.safetensors", {"w": entry}, b"\0" * 16)
    with pytest.raises(ValueError, match=match) as info:
        Checkpoint(path)
    assert str(path) in str(info.value) and "'w'" in str(info.value)


def test_safetensors_header_with_overlapping_tensors_is_a_clear_error(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    path = _write_safetensors(tmp_path / "w.safetensors", header, b"\0" * 24)
    with pytest.raises(ValueError, match="'b'.*overlaps"):
        Checkpoint(path)


# ---- planner: 32-bit kernel indices used to wrap silently for > 2^32 - 1 elements ---------------


@pytest.mark.parametrize(
    "op, m, n, k",
    [("dequantize", 0, 2**17, 2**15), ("quantize", 0, 2**16, 2**16), ("qmm", 1, 2**17, 2**15),
     ("qmm", 2**20, 4096, 4096), ("qmm", 2**20, 2**13, 64)],
)
def test_plan_refuses_operands_beyond_32_bit_indices(op, m, n, k):
    with pytest.raises(ValueError, match="32-bit indices"):
        torch.ops.torch_qmm._plan(op, m, n, k, 4, 64, torch.float16, True)
    with pytest.raises(ValueError, match="32-bit indices"):
        torch.ops.torch_qmm._plan_gguf(m or 1, n, k - k % 256 or 256 * 2**8, 12, torch.float16)


@pytest.mark.parametrize(
    "op, m, n, k, product",
    [("qmm", 2**20, 4096, 4096, "qmm's x has M * K = 1048576 * 4096 = 4294967296 elements"),
     ("qmm", 2**20, 2**13, 64, "qmm's y has M * N = 1048576 * 8192 = 8589934592 elements"),
     ("qmm", 1, 2**17, 2**15, "qmm's W has N * K = 131072 * 32768 = 4294967296 elements"),
     ("quantize", 0, 2**16, 2**16, "quantize's W has N * K = 65536 * 65536 = 4294967296 elements")],
)
def test_plan_too_large_names_the_product_it_checked(op, m, n, k, product):
    with pytest.raises(ValueError) as e:
        torch.ops.torch_qmm._plan(op, m, n, k, 4, 64, torch.float16, True)
    assert product in str(e.value) and "2^32 - 1 = 4294967295" in str(e.value), str(e.value)


def test_plan_accepts_the_largest_seed_shape():
    plan = json.loads(torch.ops.torch_qmm._plan("qmm", 512, 27648, 5120, 4, 64, torch.float16, True))
    assert [launch["route"] for launch in plan] == ["qmm_t_mma32"]
