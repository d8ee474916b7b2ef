"""Typed Python wrappers of the torch_qmm ops and their autograd rules, mirroring MLX's API.

    wq, scales, biases = quantize(w)                      # affine: 3 tensors (as mx.quantize)
    wq, scales = quantize(w, mode="mxfp4")                # fp modes: 2 tensors, uint8 scales
    y = quantized_matmul(x, wq, scales, mode="mxfp4")     # group_size / bits: the mode's defaults
    y = gather_qmm(x, wq, scales, biases, rhs_indices=experts)  # wq [E, N, K*bits/32]: per-pair expert

The schemas are defined once in csrc/ops.cpp (but gguf_gather_qmm's: torch_qmm/interop/gguf_gather.py,
a Python op over gguf_qmm); the formats (allowed and default bits and group
sizes) in csrc/format_spec.h, read by torch_qmm/formats.py. The fake (meta) kernels are C++
(csrc/meta.cpp): they give output shapes and dtypes without computing anything, so the ops trace
under torch.compile(fullgraph=True, dynamic=True) and pass torch.library.opcheck, and they run the
same argument checks as the real kernels (csrc/validate.h), so meta and fake tensors are refused
exactly as real ones.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwAD

from . import _C  # noqa: F401  (loads the library that defines and implements the ops)
from . import activations as _activations
from . import gguf_blocks as _gguf_blocks
from .formats import FORMATS

_ops = torch.ops.torch_qmm


def _params(op: str, mode: str, bits: int | None, group_size: int | None) -> tuple[int, int]:
    """bits / group_size with None as the mode's default. An unknown mode is left to the op,
    whose error names the known modes (csrc/validate.cpp); a bool (an int to the op: True would
    be read as 1) is a TypeError naming the argument."""
    for name, value in (("bits", bits), ("group_size", group_size)):
        if isinstance(value, bool):
            raise TypeError(f"{op}: argument '{name}' must be an int or None, got the bool {value}")
    f = FORMATS.get(mode) if isinstance(mode, str) else None
    if f is None:
        return (0 if bits is None else bits, 0 if group_size is None else group_size)
    return (f.default_bits if bits is None else bits, f.default_group_size if group_size is None else group_size)


def _check_flags(op: str, **flags) -> None:
    """TypeError naming the first flag that is not a bool: the ops would read None, 0 or a
    one-element tensor by truth value (transpose=None meaning False, the other product)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{op}: argument '{name}' must be a bool, got {value!r}")


def quantize(w: torch.Tensor, group_size: int | None = None, bits: int | None = None, mode: str = "affine"):
    """Quantizes W exactly as ``mlx.core.quantize(w, group_size, bits, mode=mode)`` (its CPU path) does.

    Args:
        w: float32/float16/bfloat16 [..., K], K a multiple of group_size; finite values only
            (NaN or Inf raise ValueError).
        group_size, bits: None for the mode's default (MLX's: affine 64 / 4, mxfp4 32 / 4, ...);
            affine allows bits 2, 3, 4, 5, 6, 8 and group sizes 32, 64, 128, the fp modes only
            their defaults (torch_qmm.formats.FORMATS lists every mode's).
        mode: a key of torch_qmm.formats.FORMATS: "affine" or an fp mode such as "mxfp4"
            (docs/formats.md).

    Returns:
        affine: (wq uint32 [..., K*bits/32], scales [..., K/group_size], biases [..., K/group_size]),
        scales and biases in w's dtype; fp modes: (wq, scales uint8 [..., K/group_size]).
    """
    bits, group_size = _params("quantize", mode, bits, group_size)
    return tuple(_ops.quantize(w, mode, bits, group_size))


def dequantize(
    wq: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W [..., rows, cols] as ``mlx.core.dequantize``: scales * q + biases (affine) or scales * element(q).

    Args:
        wq: uint32 [..., rows, cols*bits/32] (what quantize returns for w [..., rows, cols]).
        scales: [..., rows, cols/group_size]: float32/float16/bfloat16 (affine) or uint8 codes (fp modes).
        biases: as scales for affine; None for the fp modes.
        dtype: of the result; None: the scales' dtype (affine) or bfloat16 (fp modes), as MLX.
    """
    bits, group_size = _params("dequantize", mode, bits, group_size)
    if not isinstance(wq, torch.Tensor) or wq.dim() == 2:
        return _ops.dequantize(wq, scales, biases, mode, bits, group_size, dtype)
    # The op dequantizes one matrix [rows, words]. Each row is dequantized on its own, so the
    # leading dimensions of wq [..., rows, words] are flattened into the op's rows (scales and
    # biases alike) and restored on the result.
    if wq.dim() < 2:
        raise ValueError(f"dequantize: argument 'wq' must have at least 2 dimensions [..., rows, cols*bits/32], "
                         f"got shape {list(wq.shape)}")
    for name, t in (("scales", scales), ("biases", biases)):
        if isinstance(t, torch.Tensor) and t.shape[:-1] != wq.shape[:-1]:
            raise ValueError(f"dequantize: argument '{name}' must have the leading dimensions and rows of 'wq' "
                             f"{list(wq.shape[:-1])} (wq of shape {list(wq.shape)}), got shape {list(t.shape)}")
    flat = (t.reshape(-1, t.shape[-1]) if isinstance(t, torch.Tensor) else t for t in (wq, scales, biases))
    w = _ops.dequantize(*flat, mode, bits, group_size, dtype)
    return w.reshape(*wq.shape[:-1], w.shape[-1])


def quantized_matmul(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None = None,
    transpose: bool = True,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    activations: str | None = None,
) -> torch.Tensor:
    """y = x @ W.T (transpose=True, W [N, K]) or x @ W (transpose=False, W [K, N] quantized along N).

    Args:
        x: [..., K] float32/float16/bfloat16 (affine: the dtype of scales); any strides.
        wq: uint32 [N, K*bits/32] (transpose) or [K, N*bits/32].
        scales, biases: [N, K/group_size] (transpose) or [K, N/group_size]; biases None for the
            fp modes, whose scales are uint8 codes.
        activations: "int8": x quantized to int8 per block of 32 (torch_qmm.activations; affine,
            transpose=True, CPU only; approximate). None: torch_qmm.activation_quantization's
            setting for the calls it applies to, else exact.

    Returns:
        y [..., N] in x's dtype, accumulated in float32.
    """
    bits, group_size = _params("quantized_matmul", mode, bits, group_size)
    _check_flags("quantized_matmul", transpose=transpose)
    _activations.check_activations(activations)
    _check_frozen_tangents("qmm", wq=wq, scales=scales, biases=biases)
    if _affine_activations(activations, x, mode, transpose, "qmm_int8_activations") == "int8":
        return _run(_ops.qmm_int8_activations, x, wq, scales, biases, mode, bits, group_size)
    return _carry_tangent(lambda t: _run(_ops.qmm, t, wq, scales, biases, mode, bits, group_size, transpose), x)


def _affine_activations(activations: str | None, x, mode: str, transpose: bool, op: str) -> str | None:
    """The activation quantization of an affine-format product (quantized_matmul, gather_qmm): the
    `activations` argument (checked by the caller), else torch_qmm.activation_quantization's setting
    where it applies (mode "affine", transpose=True, x on the CPU), else None (exact). An int8 call
    (to `op`) that cannot run raises ValueError (x off the CPU, transpose=False) or the no-gradient
    error (x carrying a forward-mode tangent); a non-affine mode is refused by the op."""
    kind = activations
    current = _activations.current_activations() if kind is None else None
    if current is not None:
        applies = mode == "affine" and transpose and x.device.type == "cpu"
        kind = current if applies else None
    if kind == "int8":
        if x.device.type != "cpu":
            raise ValueError(f"argument 'activations': 'int8' runs on CPU tensors only, got x on {x.device}")
        if not transpose:
            raise ValueError("argument 'transpose' must be True with activations='int8', got False")
        if _has_tangent(x):
            raise _int8_no_grad_error(op)
    return kind


def gather_qmm(
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None = None,
    lhs_indices: torch.Tensor | None = None,
    rhs_indices: torch.Tensor | None = None,
    transpose: bool = True,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    *,
    sorted_indices: bool = False,
    activations: str | None = None,
) -> torch.Tensor:
    """Quantized matmul with matrix-level gather, as ``mlx.core.gather_qmm``: y[p] = x[lhs[p]] @ W[rhs[p]].

    Args:
        x: [..., M, K] float32/float16/bfloat16 (affine: the dtype of scales).
        w: uint32 [..., N, K*bits/32] (transpose) or [..., K, N*bits/32]: a stack of packed
            matrices (e.g. [E, N, K*bits/32] for E experts); scales and biases have w's leading
            dimensions ([..., N, K/group_size]). biases None for the fp modes.
        lhs_indices, rhs_indices: int32, int64 or uint32 (MLX: uint32) flat indices into x's and
            w's leading (batch) dimensions; None means all of them (an arange of that batch
            shape). The two shapes broadcast to the output's batch shape. Indices out of range
            raise ValueError (CPU) before anything is read.
        sorted_indices: a hint that rhs_indices is sorted (consecutive pairs of one matrix form a
            run); the result is the same either way.
        activations: "int8": each pair's rows of x quantized to int8 per block of 32, as
            quantized_matmul's (torch_qmm.activations; affine, transpose=True, CPU only;
            approximate). None: torch_qmm.activation_quantization's setting for the calls it
            applies to, else exact.

    Returns:
        y [*broadcast(lhs.shape, rhs.shape), M, N] in x's dtype, accumulated in float32.

    With both indices None this is the broadcast batched product; MLX then calls
    quantized_matmul, which agrees except for a 2-D x with a stacked w (MLX multiplies by the
    first matrix only; here y has one product per matrix).
    """
    bits, group_size = _params("gather_qmm", mode, bits, group_size)
    _check_flags("gather_qmm", transpose=transpose, sorted_indices=sorted_indices)
    _activations.check_activations(activations)
    _check_frozen_tangents("gather_qmm", w=w, scales=scales, biases=biases)
    if _affine_activations(activations, x, mode, transpose, "gather_qmm_int8_activations") == "int8":
        return _run(_ops.gather_qmm_int8_activations, x, w, scales, biases, lhs_indices, rhs_indices, mode, bits,
                    group_size, sorted_indices)
    return _carry_tangent(lambda t: _run(_ops.gather_qmm, t, w, scales, biases, lhs_indices, rhs_indices, mode, bits,
                                         group_size, transpose, sorted_indices), x)


def _gguf_activations(activations, x: torch.Tensor, ggml_type, op: str) -> str | None:
    """The activations a GGUF product of `ggml_type` takes: the argument, else (CPU x) the setting
    of torch_qmm.activation_quantization where the type has int8 kernels (GGUF_INT8_TYPES; other
    types stay exact there). ValueError for an explicit "int8" that cannot run."""
    _activations.check_activations(activations)
    # (a ggml_type that is no int is the op's to refuse, naming the argument)
    has_int8 = isinstance(ggml_type, int) and int(ggml_type) in _activations.GGUF_INT8_TYPES
    kind = activations
    if kind is None and x.device.type == "cpu" and has_int8:
        kind = _activations.current_activations()
    if kind == "int8" and x.device.type != "cpu":
        raise ValueError(f"{op}: argument 'activations': 'int8' runs on CPU tensors only, got x on {x.device}")
    if kind == "int8" and not has_int8:
        raise ValueError(f"{op}: argument 'activations': 'int8' has kernels for ggml types "
                         f"{_activations.GGUF_INT8_TYPES} (Q4_K, Q6_K) only, got ggml_type {ggml_type!r}")
    return kind


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, N: int, K: int,
                activations: str | None = None) -> torch.Tensor:
    """y = x @ W.T with W [N, K] stored as GGUF blocks (Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
    Q6_K = 14, IQ4_XS = 23, and the lattice i-quants IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
    IQ3_S = 21, IQ2_S = 22, IQ1_M = 29), decoded in-kernel.

    Args:
        x: float32/float16/bfloat16 [..., K], K a multiple of 256.
        blocks: uint8 [N, K/256 * block_bytes] (84 / 110 / 144 / 176 / 210 / 136 bytes per Q2_K / Q3_K /
            Q4_K / Q5_K / Q6_K / IQ4_XS super-block; 66 / 74 / 98 / 50 / 110 / 82 / 56 per IQ2_XXS / IQ2_XS /
            IQ3_XXS / IQ1_S / IQ3_S / IQ2_S / IQ1_M), each row the super-blocks of one row of W as llama.cpp
            writes them.
        activations: "int8": x quantized to int8 per super-block of 256 (torch_qmm.activations; CPU
            only, Q4_K and Q6_K; approximate). None: torch_qmm.activation_quantization's setting for
            CPU calls of Q4_K / Q6_K, else exact.

    Returns:
        y [..., N] in x's dtype, accumulated in float32.
    """
    kind = _gguf_activations(activations, x, ggml_type, "gguf_matmul")
    _check_frozen_tangents("gguf_qmm", blocks=blocks)
    if kind == "int8":
        if _has_tangent(x):
            raise _int8_no_grad_error("gguf_qmm_int8_activations")
        return _run(_ops.gguf_qmm_int8_activations, x, blocks, ggml_type, N, K)
    return _carry_tangent(lambda t: _run(_ops.gguf_qmm, t, blocks, ggml_type, N, K), x)


# ---- Autograd ---------------------------------------------------------------------------------
# Without a registration PyTorch's fallback marks the outputs as requiring grad and backward then
# silently returns no gradient (only a deprecation warning). qmm is linear in x, so its gradient
# with respect to x is the same product with the other transpose (as MLX's vjp):
#   y = x @ W.T  ->  dx = dy @ W        y = x @ W  ->  dx = dy @ W.T
# gather_qmm's and gguf_qmm's gradients with respect to x follow (below). Every other gradient
# (packed weights, scales, biases, GGUF blocks; quantize, dequantize, the int8-activation ops)
# raises a clear error. The affine_* aliases decompose into these ops (csrc/ops.cpp) and so share
# their rules.


def _no_grad_error(op: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"torch_qmm.{op}: no gradient with respect to {what} (quantized weights are frozen; only "
        "the input x of qmm, gather_qmm and gguf_qmm is differentiable)"
    )


_INT8_X = "its input x (int8 rounding; train with the exact path)"


def _int8_no_grad_error(op: str) -> RuntimeError:
    return _no_grad_error(op, _INT8_X)


# Forward mode (torch.autograd.forward_ad, torch.func.jvp / jacfwd): torch.library's autograd
# registration (below) has no forward-mode rule, so a dual x would pass through the ops with its
# tangent dropped (a zero jvp, no error). The Python functions above and the backward rules below
# carry it instead: every product is linear in its input, so the tangent of y = f(x) is
# f(tangent of x) (the backward's dx = g(dy) likewise, for forward-over-reverse: Hessian-vector
# products). A tangent on a quantized weight, or on x of the int8-activation ops, raises as its
# gradient does. The raw torch.ops.torch_qmm ops do not carry tangents.


def _no_dual_level() -> bool:
    """True outside every dual level (forward_ad's own record, which unpack_dual reads too): no
    tensor can carry a tangent, and the checks below cost one comparison."""
    return _fwAD._current_level < 0


def _check_frozen_tangents(op: str, **frozen) -> None:
    """RuntimeError naming the first of the `frozen` tensors that carries a forward-mode tangent."""
    if _no_dual_level():
        return
    for name, t in frozen.items():
        if isinstance(t, torch.Tensor) and _fwAD.unpack_dual(t).tangent is not None:
            raise _no_grad_error(op, f"'{name}'")


def _has_tangent(x: torch.Tensor) -> bool:
    return not _no_dual_level() and isinstance(x, torch.Tensor) and _fwAD.unpack_dual(x).tangent is not None


def _run(op, *args):
    """op(*args). Where no gradient can flow through it (grad mode off, or no tensor argument
    requiring grad) the call goes straight to the op's backend kernel, below the autograd keys, as
    torch.library's autograd registration itself would send it, but without its Python detour
    (about 5 us a call: benchmarks/module_call_overhead.py, QuantLinear 256 -> 64 under
    torch.no_grad, 27.4 -> 22.5 us on a 2-core Xeon; nn.Linear 7.2). Ordinary op calls remain for
    traced calls (torch.compile), calls inside a torch.func transform (vmap, jvp, ...: their wrapped
    tensors do not show the requires_grad of what they wrap) and calls a __torch_function__ mode or
    subclass may take over (it may compute the product with tensors that require grad)."""
    if (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or torch._C._is_torch_function_mode_enabled() or torch._C._has_torch_function(args)):
        return op(*args)
    if torch._C.is_grad_enabled() and torch._C._any_requires_grad(*args):  # torch.library's own test
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _carry_tangent(product, x: torch.Tensor) -> torch.Tensor:
    """product(x) for a product linear in x; when x carries a tangent t at the current dual level,
    the result is product(primal of x) with the tangent product(t)."""
    if _no_dual_level() or not isinstance(x, torch.Tensor):
        return product(x)
    primal, tangent = _fwAD.unpack_dual(x)
    if tangent is None:
        return product(x)
    return _fwAD.make_dual(product(primal), product(tangent))


def _qmm_setup(ctx, inputs, output):
    x, wq, scales, biases, mode, bits, group_size, transpose = inputs
    ctx.save_for_backward(wq, scales, biases)
    ctx.args = (mode, bits, group_size, transpose)


def _qmm_backward(ctx, grad):
    if any(ctx.needs_input_grad[1:4]):
        raise _no_grad_error("qmm", "'wq', 'scales' or 'biases'")
    grad_x = None
    if ctx.needs_input_grad[0]:
        wq, scales, biases = ctx.saved_tensors
        mode, bits, group_size, transpose = ctx.args
        grad_x = _carry_tangent(lambda t: _ops.qmm(t, wq, scales, biases, mode, bits, group_size, not transpose), grad)
    return grad_x, None, None, None, None, None, None, None


torch.library.register_autograd("torch_qmm::qmm", _qmm_backward, setup_context=_qmm_setup)


def _gather_qmm_setup(ctx, inputs, output):
    x, w, scales, biases, lhs, rhs, mode, bits, group_size, transpose, sorted_indices = inputs
    ctx.save_for_backward(w, scales, biases, lhs, rhs)
    ctx.x_shape = x.shape
    ctx.args = (mode, bits, group_size, transpose, sorted_indices)


def _gather_qmm_backward(ctx, grad):
    """y[p] = x[lhs[p]] @ W[rhs[p]] (transposed or not), so dx[b] = sum over p with lhs[p] == b
    of dy[p] @ W[rhs[p]] with the other transpose: one gather_qmm of dy, scattered by lhs."""
    if any(ctx.needs_input_grad[1:4]):
        raise _no_grad_error("gather_qmm", "'w', 'scales' or 'biases'")
    if not ctx.needs_input_grad[0]:
        return (None,) * 11
    w, scales, biases, lhs, rhs = ctx.saved_tensors
    mode, bits, group_size, transpose, sorted_indices = ctx.args
    x_shape = ctx.x_shape
    x_batch, w_batch = x_shape[:-2], w.shape[:-2]
    dev = grad.device
    lhs = lhs.long() if lhs is not None else torch.arange(x_batch.numel(), device=dev).reshape(x_batch)
    rhs = rhs.long() if rhs is not None else torch.arange(w_batch.numel(), device=dev).reshape(w_batch)
    lhs, rhs = torch.broadcast_tensors(lhs, rhs)
    M, N = grad.shape[-2:]
    dz = _carry_tangent(lambda t: _ops.gather_qmm(t, w, scales, biases, None, rhs.reshape(-1), mode, bits,
                                                  group_size, not transpose, sorted_indices), grad.reshape(-1, M, N))
    dx = torch.zeros((x_batch.numel(),) + tuple(dz.shape[1:]), dtype=torch.float32, device=dev)
    dx.index_add_(0, lhs.reshape(-1), dz.float())
    return (dx.to(grad.dtype).reshape(x_shape),) + (None,) * 10


torch.library.register_autograd("torch_qmm::gather_qmm", _gather_qmm_backward, setup_context=_gather_qmm_setup)


# gguf_qmm's dx decodes at most this many bytes of float32 weights at a time (below).
GGUF_DX_SLICE_BYTES = 16 << 20


def gguf_dx_slice_rows(K: int) -> int:
    """Rows of W [N, K] a GGUF backward decodes at a time (GGUF_DX_SLICE_BYTES of float32)."""
    return max(1, GGUF_DX_SLICE_BYTES // (4 * K))


def _gguf_qmm_setup(ctx, inputs, output):
    x, blocks, ggml_type, N, K = inputs
    ctx.save_for_backward(blocks)
    ctx.args = (ggml_type, N, K)
    ctx.x_dtype = x.dtype


def _gguf_qmm_backward(ctx, grad):
    """y = x @ W.T with W [N, K] as GGUF blocks, so dx = dy @ W. The kernels only multiply by W.T,
    so W is decoded here with plain tensor ops (torch_qmm.gguf_blocks, the gguf package's float32
    weights bit for bit; any device, traceable by torch.compile) and multiplied in float32. Memory
    stays bounded: W is decoded a slice of rows at a time, each slice at most GGUF_DX_SLICE_BYTES
    of float32 weights (its decode's temporaries a few times that), and dx accumulates the slices'
    products dy[:, rows] @ W[rows] in float32; it is returned in x's dtype."""
    if ctx.needs_input_grad[1]:
        raise _no_grad_error("gguf_qmm", "'blocks'")
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    (blocks,) = ctx.saved_tensors
    ggml_type, N, K = ctx.args
    lead = grad.shape[:-1]
    dy = grad.reshape(lead.numel(), N).float()
    dx = torch.zeros(lead.numel(), K, dtype=torch.float32, device=grad.device)
    step = gguf_dx_slice_rows(K)
    for n0 in range(0, N, step):
        dx.addmm_(dy[:, n0:n0 + step], _gguf_blocks.dequantize_rows(blocks[n0:n0 + step], ggml_type))
    return dx.to(ctx.x_dtype).reshape(*lead, K), None, None, None, None


torch.library.register_autograd("torch_qmm::gguf_qmm", _gguf_qmm_backward, setup_context=_gguf_qmm_setup)


def _refuse_backward(op: str, what: str):
    def backward(ctx, *grads):
        raise _no_grad_error(op, what)

    return backward


torch.library.register_autograd(
    "torch_qmm::quantize", _refuse_backward("quantize", "'w' (rounding has no useful gradient)")
)
torch.library.register_autograd("torch_qmm::dequantize", _refuse_backward("dequantize", "'scales' or 'biases'"))
torch.library.register_autograd(
    "torch_qmm::qmm_int8_activations",
    _refuse_backward("qmm_int8_activations", _INT8_X),
)
torch.library.register_autograd(
    "torch_qmm::gather_qmm_int8_activations",
    _refuse_backward("gather_qmm_int8_activations", _INT8_X),
)
torch.library.register_autograd(
    "torch_qmm::gguf_qmm_int8_activations",
    _refuse_backward("gguf_qmm_int8_activations", _INT8_X),
)


# torch.func.vmap. The products take x with any leading dimensions, so a batch of x alone is one
# call with the batch dimension in front; a batch of any other argument (weights, scales, blocks)
# runs one call per batch element, as PyTorch's fallback would, without its warning.
def _meta_element(a, d):
    """An argument of one batch element on the meta device (tensors; others as they are)."""
    if not isinstance(a, torch.Tensor):
        return a
    shape = a.shape if d is None else a.shape[:d] + a.shape[d + 1:]
    return torch.empty(shape, dtype=a.dtype, device="meta")


def _vmap_over_x(op):
    def rule(info, in_dims, x, *rest):
        if all(d is None for d in in_dims[1:]):
            return op(x.movedim(in_dims[0], 0), *rest), 0
        args = (x, *rest)
        if info.batch_size == 0:  # no element to call: one element's result shape from the meta kernels
            one = op(*(_meta_element(a, d) for a, d in zip(args, in_dims)))
            return x.new_empty((0, *one.shape), dtype=one.dtype), 0
        per_element = [op(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)))
                       for i in range(info.batch_size)]
        return torch.stack(per_element), 0

    return rule


for _name in ("qmm", "gguf_qmm", "qmm_int8_activations", "gguf_qmm_int8_activations"):
    torch.library.register_vmap(f"torch_qmm::{_name}", _vmap_over_x(getattr(torch.ops.torch_qmm, _name)))


def _vmap_dequantize(info, in_dims, wq, scales, biases, mode, bits, group_size, dtype=None):
    """dequantize dequantizes each row on its own: the batch's matrices are stacked into one of
    batch * rows rows (an argument without a batch dimension is expanded, not copied), after one
    element's arguments passed the op's checks on the meta device (the stack would hide a shape
    that differs from wq's by a leading 1)."""
    _ops.dequantize(*(_meta_element(a, d) for a, d in zip((wq, scales, biases), in_dims)), mode, bits, group_size,
                    dtype)
    batch, rows = info.batch_size, wq.shape[-2] if in_dims[0] is None else wq.movedim(in_dims[0], 0).shape[1]

    def stacked(t, d):
        if t is None:
            return None
        t = t.movedim(d, 0) if d is not None else t.expand(batch, *t.shape)
        return t.reshape(batch * rows, t.shape[-1])

    w = _ops.dequantize(stacked(wq, in_dims[0]), stacked(scales, in_dims[1]), stacked(biases, in_dims[2]), mode, bits,
                        group_size, dtype)
    return w.reshape(batch, rows, w.shape[-1]), 0


torch.library.register_vmap("torch_qmm::dequantize", _vmap_dequantize)
