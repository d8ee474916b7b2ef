"""gguf_gather_matmul: y = x @ W[indices].T for a stack of expert weights W [E, N, K] kept as GGUF
blocks (the K-quants Q2_K .. Q6_K, IQ4_XS and the lattice i-quants), the gather_qmm of the GGUF formats.

    y = gguf_gather_matmul(x, blocks, ggml_type, N, K, indices)   # blocks uint8 [E, N, bytes]

The op ``torch_qmm::gguf_gather_qmm`` is defined here, in Python (torch.library.custom_op), on top
of the native ``torch_qmm::gguf_qmm`` (``gguf_qmm_int8_activations`` for int8 activations): the
(x rows, expert) pairs are grouped by expert (one sort) and each expert's rows of x go through
gguf_qmm once, on its own blocks (a view, no copy); x is indexed per pair, not copied per pair. The grouping
depends on the values of `indices`, so the op is opaque to torch.compile (its fake kernel gives
the output's shape) and a model holding it still compiles with fullgraph=True. It runs on every
device gguf_qmm runs on (CPU, MPS). It is differentiable in x as gguf_qmm is (dx = dy @ W_e for
each pair, W_e decoded by torch_qmm.gguf_blocks a slice of rows at a time; forward-mode tangents
carried the same way); the blocks are frozen, and x of the int8-activation path takes no gradient.
"""

from __future__ import annotations

import torch

from .. import gguf_blocks as _gguf_blocks
from .. import ops as _ops
from ..ops import _carry_tangent, _gguf_activations, _has_tangent, _int8_no_grad_error, _no_grad_error
from .gguf_types import native_type, type_name

_EXACT = "exact"


def _batch_shape(x: torch.Tensor, indices: torch.Tensor) -> torch.Size:
    return torch.broadcast_shapes(x.shape[:-2], indices.shape)


def _pairs(x_batch: torch.Size, indices: torch.Tensor, device) -> tuple[torch.Size, torch.Tensor, torch.Tensor]:
    """(broadcast batch shape, the row block of x each pair reads, each pair's expert): x's own row
    blocks are indexed, never copied once per pair."""
    batch = torch.broadcast_shapes(x_batch, indices.shape)
    src = torch.arange(x_batch.numel(), device=device).reshape(x_batch).expand(batch).reshape(-1)
    return batch, src, indices.expand(batch).reshape(-1)


def _groups(experts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(expert, its pairs)] from one stable sort of the pairs' experts."""
    order = torch.argsort(experts, stable=True)
    uniq, counts = torch.unique_consecutive(experts.index_select(0, order), return_counts=True)
    return list(zip(uniq.tolist(), torch.split(order, counts.tolist())))


@torch.library.custom_op("torch_qmm::gguf_gather_qmm", mutates_args=())
def _gguf_gather_qmm(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, N: int, K: int,
                     indices: torch.Tensor, activations: str) -> torch.Tensor:
    m = x.shape[-2]
    xs = x.reshape(-1, m, K)
    batch, src, experts = _pairs(x.shape[:-2], indices, x.device)
    y = x.new_empty(experts.numel(), m, N)
    if experts.numel() == 0:
        return y.reshape(*batch, m, N)
    groups = _groups(experts)
    bad = [e for e, _ in groups if not 0 <= e < blocks.shape[0]]
    if bad:
        raise ValueError(f"gguf_gather_matmul: argument 'indices' must be in [0, {blocks.shape[0]}) (the experts "
                         f"of 'blocks'), got {bad[0]}")
    product = torch.ops.torch_qmm.gguf_qmm if activations == _EXACT else torch.ops.torch_qmm.gguf_qmm_int8_activations
    for e, pairs in groups:
        xe = xs.index_select(0, src.index_select(0, pairs)).reshape(-1, K)
        y.index_copy_(0, pairs, product(xe, blocks[e], ggml_type, N, K).reshape(-1, m, N))
    return y.reshape(*batch, m, N)


def _setup(ctx, inputs, output):
    x, blocks, ggml_type, N, K, indices, activations = inputs
    ctx.save_for_backward(blocks, indices)
    ctx.args = (ggml_type, N, K, activations, x.shape, x.dtype)


def _backward(ctx, grad):
    """dx = sum over the pairs p reading a row block of x of dy[p] @ W_e (e: p's expert); W_e
    decoded as gguf_qmm's backward decodes it (torch_qmm.ops), in float32."""
    if ctx.needs_input_grad[1]:
        raise _no_grad_error("gguf_gather_matmul", "'blocks'")
    if not ctx.needs_input_grad[0]:
        return (None,) * 7
    ggml_type, N, K, activations, x_shape, x_dtype = ctx.args
    if activations != _EXACT:
        raise _int8_no_grad_error("gguf_gather_matmul")
    blocks, indices = ctx.saved_tensors
    m = x_shape[-2]
    _, src, experts = _pairs(x_shape[:-2], indices, grad.device)
    dy = grad.reshape(-1, m, N).float()
    dx = torch.zeros(x_shape[:-2].numel(), m, K, dtype=torch.float32, device=grad.device)
    step = _ops.gguf_dx_slice_rows(K)
    for e, pairs in _groups(experts):
        dye = dy.index_select(0, pairs).reshape(-1, N)
        dxe = torch.zeros(dye.shape[0], K, dtype=torch.float32, device=grad.device)
        for n0 in range(0, N, step):
            dxe.addmm_(dye[:, n0:n0 + step], _gguf_blocks.dequantize_rows(blocks[e, n0:n0 + step], ggml_type))
        dx.index_add_(0, src.index_select(0, pairs), dxe.reshape(-1, m, K))
    return dx.reshape(x_shape).to(x_dtype), None, None, None, None, None, None


_gguf_gather_qmm.register_autograd(_backward, setup_context=_setup)


@_gguf_gather_qmm.register_fake
def _(x, blocks, ggml_type, N, K, indices, activations):
    return x.new_empty(*_batch_shape(x, indices), x.shape[-2], N)


def gguf_gather_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, N: int, K: int,
                       indices: torch.Tensor, activations: str | None = None) -> torch.Tensor:
    """y[..., M, N] = x[..., M, K] @ W[indices].T, W [E, N, K] stored as GGUF blocks.

    Args:
        x: float32/float16/bfloat16 [..., M, K], K a multiple of 256.
        blocks: uint8 [E, N, K/256 * block_bytes]: expert e's rows as llama.cpp writes them.
        ggml_type: a native type (gguf_types.NATIVE_TYPES: Q2_K .. Q6_K, IQ4_XS, the lattice i-quants).
        indices: integer tensor whose shape broadcasts with x's batch dims (x.shape[:-2]): the
            expert of each row block of x, in [0, E).
        activations: as gguf_matmul's ("int8": x quantized per super-block, CPU only, Q4_K and Q6_K;
            None: the torch_qmm.activation_quantization setting on CPU for those, else exact).

    Returns:
        y [*broadcast(x.shape[:-2], indices.shape), M, N] in x's dtype, each expert's product
        gguf_matmul's.
    """
    try:
        ggml_type, row_bytes = native_type(ggml_type, K, "K")
    except (TypeError, ValueError) as e:
        raise type(e)(f"gguf_gather_matmul: {e}") from None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point() or x.shape[-1] != K:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"gguf_gather_matmul: argument 'x' must be a float tensor [..., M, K={K}], got {got}")
    want = f"uint8 [E, N={N}, {row_bytes}] ({type_name(ggml_type)} blocks of K={K})"
    if (not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 3
            or tuple(blocks.shape[1:]) != (N, row_bytes)):
        got = f"{blocks.dtype} {list(blocks.shape)}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"gguf_gather_matmul: argument 'blocks' must be {want}, got {got}")
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.is_complex() \
            or indices.dtype == torch.bool:
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"gguf_gather_matmul: argument 'indices' must be an integer tensor, got {got}")
    try:
        _batch_shape(x, indices)
    except RuntimeError:
        raise ValueError(f"gguf_gather_matmul: argument 'indices' of shape {list(indices.shape)} does not broadcast "
                         f"with x's batch dims {list(x.shape[:-2])}") from None
    kind = _gguf_activations(activations, x, ggml_type, "gguf_gather_matmul")
    if kind == "int8" and _has_tangent(x):  # as gguf_matmul: no tangent through the int8 rounding
        raise _int8_no_grad_error("gguf_gather_matmul")
    blocks = blocks.contiguous()
    return _carry_tangent(lambda t: _gguf_gather_qmm(t, blocks, ggml_type, N, K, indices, kind or _EXACT), x)
