"""Bad input: every case gets a clear error naming the argument, the expectation and what came."""

from __future__ import annotations

import pytest
import torch

import torch_qmm


def _packed(device, n=16, k=128, bits=4, gs=64, dtype=torch.float32):
    w = torch.randn(n, k, dtype=dtype, device="cpu")
    return tuple(t.to(device) for t in torch_qmm.quantize(w, group_size=gs, bits=bits))


@pytest.mark.parametrize("bits", [0, 1, 7, 9, 16, -4])
def test_quantize_rejects_unsupported_bits(bits):
    with pytest.raises(ValueError, match=rf"'bits' must be one of 2, 3, 4, 5, 6, 8, got {bits}"):
        torch_qmm.quantize(torch.randn(4, 128), group_size=64, bits=bits)


@pytest.mark.parametrize("name", ["bits", "group_size"])
@pytest.mark.parametrize("op", ["quantize", "dequantize", "quantized_matmul", "gather_qmm"])
def test_a_bool_for_bits_or_group_size_is_a_type_error_not_1(op, name):
    wq, scales, biases = _packed("cpu", bits=4, gs=64)
    args = {"quantize": (torch.randn(4, 128),), "dequantize": (wq, scales, biases),
            "quantized_matmul": (torch.randn(2, 128), wq, scales, biases),
            "gather_qmm": (torch.randn(2, 128), wq, scales, biases)}[op]
    kwargs = {"bits": 4, "group_size": 64, name: True}
    with pytest.raises(TypeError, match=rf"{op}: argument '{name}' must be an int or None, got the bool True"):
        getattr(torch_qmm, op)(*args, **kwargs)


@pytest.mark.parametrize("value", [None, 0, 1, torch.tensor(True)], ids=repr)
@pytest.mark.parametrize("op, name", [("quantized_matmul", "transpose"), ("gather_qmm", "transpose"),
                                      ("gather_qmm", "sorted_indices")])
def test_a_flag_that_is_not_a_bool_is_a_type_error(op, name, value):
    """transpose=None must not be read as False: with a square W that is x @ W, not the default
    x @ W.T (MLX refuses anything but a bool too)."""
    torch.manual_seed(0)
    wq, scales, biases = torch_qmm.quantize(torch.randn(64, 64), group_size=64, bits=4)
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match=rf"{op}: argument '{name}' must be a bool, got "):
        getattr(torch_qmm, op)(x, wq, scales, biases, **{name: value})


@pytest.mark.parametrize("group_size", [0, 16, 48, 256])
def test_quantize_rejects_unsupported_group_size(group_size):
    with pytest.raises(ValueError, match=rf"'group_size' must be one of 32, 64, 128, got {group_size}"):
        torch_qmm.quantize(torch.randn(4, 256), group_size=group_size, bits=4)


def test_quantize_rejects_k_not_multiple_of_group_size():
    with pytest.raises(ValueError, match=r"last dimension of 'w' \(K=100\) must be a multiple of group_size=64"):
        torch_qmm.quantize(torch.randn(4, 100), group_size=64, bits=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8])
def test_quantize_rejects_wrong_dtype(dtype):
    with pytest.raises(TypeError, match=r"'w' must be float32, float16 or bfloat16, got"):
        torch_qmm.quantize(torch.ones(4, 64, dtype=dtype), group_size=64, bits=4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_rejects_non_finite_weights(bad):
    w = torch.randn(4, 64)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=r"'w' contains NaN or Inf"):
        torch_qmm.quantize(w, group_size=64, bits=4)


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
@pytest.mark.parametrize("shape", [(), (64,)], ids=["scalar", "1-D"])
def test_quantize_rejects_fewer_than_two_dimensions(shape, mode):
    # mlx.core.quantize refuses a vector too: the weights are a matrix [..., rows, K].
    want = r"argument 'w' must have at least 2 dimensions \[\.\.\., rows, K\], got shape \[" + (
        "64" if shape else "") + r"\]"
    with pytest.raises(ValueError, match=want):
        torch_qmm.quantize(torch.randn(shape), mode=mode)
    with pytest.raises(ValueError, match=want):
        torch_qmm.quantize(torch.randn(shape, device="meta"), mode=mode)


def test_qmm_rejects_wrong_x_dtype(device):
    wq, s, b = _packed(device)
    with pytest.raises(TypeError, match=r"'x' must have the dtype of 'scales' and 'biases' \(Float\), got Half"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device).half(), wq, s, b, group_size=64, bits=4)


def test_qmm_rejects_float64_x(device):
    wq, s, b = _packed("cpu")
    with pytest.raises(TypeError, match=r"'x' must be float32, float16 or bfloat16, got Double"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, dtype=torch.float64), wq, s, b, group_size=64, bits=4)


def test_qmm_rejects_wrong_k(device):
    wq, s, b = _packed(device)
    with pytest.raises(ValueError, match=r"'x' must have last dimension K=128 .* got x of shape \[2, 64\]"):
        torch_qmm.quantized_matmul(torch.randn(2, 64, device=device), wq, s, b, group_size=64, bits=4)


def test_qmm_rejects_bits_inconsistent_with_packed_width(device):
    wq, s, b = _packed(device, bits=4)  # 16 words per row = 128 4-bit values
    # Read as 8-bit, the same words hold 64 values per row: K disagrees with x.
    with pytest.raises(ValueError, match=r"'scales' must have shape \[16, 1\]"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device), wq, s, b, group_size=64, bits=8)


def test_qmm_rejects_packed_width_not_whole_groups(device):
    wq, s, b = _packed(device)
    with pytest.raises(ValueError, match=r"'wq' has 15 words per row, which is not a whole number of groups"):
        torch_qmm.quantized_matmul(torch.randn(2, 120, device=device), wq[:, :15], s, b, group_size=64, bits=4)


def test_qmm_rejects_wrong_packed_dtype(device):
    wq, s, b = _packed(device)
    with pytest.raises(TypeError, match=r"'wq' must be uint32 .*got Int"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device), wq.view(torch.int32), s, b, group_size=64, bits=4)


def test_qmm_rejects_scales_of_wrong_shape(device):
    wq, s, b = _packed(device)
    with pytest.raises(ValueError, match=r"'scales' must have shape \[16, 2\] .* got \[16, 1\]"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device), wq, s[:, :1], b, group_size=64, bits=4)


def test_qmm_rejects_biases_of_wrong_shape(device):
    wq, s, b = _packed(device)
    with pytest.raises(ValueError, match=r"'biases' must have shape \[16, 2\] .* got \[8, 2\]"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device), wq, s, b[:8], group_size=64, bits=4)


def test_qmm_rejects_biases_of_other_dtype(device):
    wq, s, b = _packed(device)
    with pytest.raises(TypeError, match=r"'biases' must have the dtype of 'scales' \(Float\), got Half"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device), wq, s, b.half(), group_size=64, bits=4)


def test_qmm_rejects_wrong_group_size_for_scales(device):
    wq, s, b = _packed(device, gs=64)
    with pytest.raises(ValueError, match=r"'scales' must have shape \[16, 4\] for wq of shape \[16, 16\]"):
        torch_qmm.quantized_matmul(torch.randn(2, 128, device=device), wq, s, b, group_size=32, bits=4)


def test_qmm_rejects_one_dimensional_packed_weights():
    wq, s, b = _packed("cpu")
    with pytest.raises(ValueError, match=r"'wq' must be 2-D"):
        torch_qmm.quantized_matmul(torch.randn(2, 128), wq.reshape(-1), s, b, group_size=64, bits=4)


def test_qmm_rejects_tensors_on_different_devices():
    wq, s, b = _packed("cpu")
    meta = torch.empty(2, 128, device="meta")
    with pytest.raises(ValueError, match=r"argument 'x' is on meta but the packed weights are on cpu"):
        torch_qmm.quantized_matmul(meta, wq, s, b, group_size=64, bits=4)
    with pytest.raises(ValueError, match=r"'wq', 'scales' and 'biases' must be on one device"):
        torch_qmm.quantized_matmul(torch.randn(2, 128), wq, s.to("meta"), b, group_size=64, bits=4)


def test_dequantize_rejects_mismatched_shapes():
    wq, s, b = _packed("cpu")
    with pytest.raises(ValueError, match=r"'biases' must have shape \[16, 2\]"):
        torch_qmm.dequantize(wq, s, b[:, :1], group_size=64, bits=4)


def test_dequantize_rejects_leading_dimensions_that_differ():
    wq, s, b = torch_qmm.quantize(torch.randn(4, 16, 128), group_size=64, bits=4)
    with pytest.raises(ValueError, match=r"argument 'scales' must have the leading dimensions and rows of 'wq' "
                                         r"\[4, 16\] \(wq of shape \[4, 16, 16\]\), got shape \[16, 2\]"):
        torch_qmm.dequantize(wq, s[0], b, group_size=64, bits=4)
    with pytest.raises(ValueError, match=r"argument 'biases' must have the leading dimensions and rows of 'wq' "
                                         r"\[4, 16\] \(wq of shape \[4, 16, 16\]\), got shape \[2, 16, 2\]"):
        torch_qmm.dequantize(wq, s, b[:2], group_size=64, bits=4)
    with pytest.raises(ValueError, match=r"argument 'wq' must have at least 2 dimensions \[\.\.\., rows, "
                                         r"cols\*bits/32\], got shape \[1024\]"):
        torch_qmm.dequantize(wq.reshape(-1), s, b, group_size=64, bits=4)


def test_quant_linear_rejects_in_features_not_multiple_of_group_size():
    with pytest.raises(ValueError, match=r"'in_features' must be a multiple of group_size=64, got 100"):
        torch_qmm.nn.QuantLinear(100, 8, group_size=64)


def test_quant_linear_rejects_unsupported_dtype():
    with pytest.raises(TypeError, match=r"'dtype' must be one of"):
        torch_qmm.nn.QuantLinear(64, 8, group_size=64, dtype=torch.float64)
