"""Typed Python wrappers of the torch_qmm ops and their autograd rules.

The schemas are defined once in csrc/ops.cpp. The fake (meta) kernels are C++ (csrc/meta.cpp):
they give output shapes and dtypes without computing anything, so the ops trace under
torch.compile(fullgraph=True, dynamic=True) and pass torch.library.opcheck, and they run the
same argument checks as the real kernels (csrc/validate.h), so meta and fake tensors are refused
exactly as real ones.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines and implements the ops)

_ops = torch.ops.torch_qmm


def quantize(w: torch.Tensor, group_size: int = 64, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes W exactly as ``mlx.core.quantize`` (affine mode) does.

    Args:
        w: float32/float16/bfloat16 [..., K], K a multiple of group_size; finite values only
            (NaN or Inf raise ValueError).
        group_size: 32, 64 or 128 weights share one scale and bias.
        bits: 2, 3, 4, 5, 6 or 8.

    Returns:
        (wq uint32 [..., K*bits/32], scales [..., K/group_size], biases [..., K/group_size]),
        scales and biases in w's dtype.
    """
    return _ops.affine_quantize(w, bits, group_size)


def dequantize(
    wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int = 64, bits: int = 4
) -> torch.Tensor:
    """Unpacks W [rows, cols] = scales * q + biases in the dtype of scales.

    Args:
        wq: uint32 [rows, cols*bits/32].
        scales, biases: [rows, cols/group_size], float32/float16/bfloat16.
    """
    return _ops.affine_dequantize(wq, scales, biases, bits, group_size)


def quantized_matmul(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
) -> torch.Tensor:
    """y = x @ W.T (transpose=True, W [N, K]) or x @ W (transpose=False, W [K, N] quantized along N).

    Args:
        x: [..., K] in the dtype of scales (float32/float16/bfloat16); any strides.
        wq: uint32 [N, K*bits/32] (transpose) or [K, N*bits/32].
        scales, biases: [N, K/group_size] (transpose) or [K, N/group_size].

    Returns:
        y [..., N] in x's dtype, accumulated in float32.
    """
    return _ops.affine_qmm(x, wq, scales, biases, bits, group_size, transpose)


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, N: int, K: int) -> torch.Tensor:
    """y = x @ W.T with W [N, K] stored as GGUF blocks (Q4_K = 12, Q6_K = 14), decoded in-kernel.

    Args:
        x: float32/float16/bfloat16 [..., K], K a multiple of 256.
        blocks: uint8 [N, K/256 * block_bytes] (144 bytes per Q4_K super-block, 210 per Q6_K),
            each row the super-blocks of one row of W as llama.cpp writes them.

    Returns:
        y [..., N] in x's dtype, accumulated in float32.
    """
    return _ops.gguf_qmm(x, blocks, ggml_type, N, K)


# ---- Autograd ---------------------------------------------------------------------------------
# Without a registration PyTorch's fallback marks the outputs as requiring grad and backward then
# silently returns no gradient (only a deprecation warning). affine_qmm is linear in x, so its
# gradient with respect to x is the same product with the other transpose (as MLX's vjp):
#   y = x @ W.T  ->  dx = dy @ W        y = x @ W  ->  dx = dy @ W.T
# Every other gradient (packed weights, scales, biases; the other ops) raises a clear error.


def _no_grad_error(op: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"torch_qmm.{op}: no gradient with respect to {what} (quantized weights are frozen; only "
        "affine_qmm's input x is differentiable)"
    )


def _affine_qmm_setup(ctx, inputs, output):
    x, wq, scales, biases, bits, group_size, transpose = inputs
    ctx.save_for_backward(wq, scales, biases)
    ctx.args = (bits, group_size, transpose)


def _affine_qmm_backward(ctx, grad):
    if any(ctx.needs_input_grad[1:4]):
        raise _no_grad_error("affine_qmm", "'wq', 'scales' or 'biases'")
    grad_x = None
    if ctx.needs_input_grad[0]:
        wq, scales, biases = ctx.saved_tensors
        bits, group_size, transpose = ctx.args
        grad_x = _ops.affine_qmm(grad, wq, scales, biases, bits, group_size, not transpose)
    return grad_x, None, None, None, None, None, None


torch.library.register_autograd("torch_qmm::affine_qmm", _affine_qmm_backward, setup_context=_affine_qmm_setup)


def _refuse_backward(op: str, what: str):
    def backward(ctx, *grads):
        raise _no_grad_error(op, what)

    return backward


torch.library.register_autograd(
    "torch_qmm::affine_quantize", _refuse_backward("affine_quantize", "'w' (rounding has no useful gradient)")
)
torch.library.register_autograd(
    "torch_qmm::affine_dequantize", _refuse_backward("affine_dequantize", "'scales' or 'biases'")
)
torch.library.register_autograd("torch_qmm::gguf_qmm", _refuse_backward("gguf_qmm", "its input x"))
