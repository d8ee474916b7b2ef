"""Mixture-of-experts modules: QuantSwitchLinear (a stack of quantized expert weights, MLX-LM's
SwitchLinear layout) and QuantFusedExperts (the experts of a transformers MoE block, quantized).

    layer = QuantSwitchLinear.from_float(w, mode="mxfp4")      # w [experts, out, in]
    y = layer(x, indices)                                      # gather_qmm: x[..., M, in] @ W[indices].T
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops
from .format_state import QuantFormatState
from .nn import (activations_repr, check_module_activations, check_positive_ints, compute_dtype_repr, module_dtype,
                 follows_autocast, quantized_from, register_quantized_weight, resolve_format)

# From this many (token, expert) pairs on, the pairs are sorted by expert before the matmuls, so
# that each expert's rows are read once for a run of tokens (mlx_lm's SwitchGLU sorts from 64).
SORT_MIN_PAIRS = 64


class QuantSwitchLinear(QuantFormatState, nn.Module):
    """y = x @ W[indices].T (+ bias[indices]) with W [num_experts, out, in] in one of MLX's formats
    (after MLX-LM's QuantizedSwitchLinear).

    Buffers: ``qweight`` uint32 [E, out, in*bits/32]; ``scales`` [E, out, in/group_size] (in the
    compute dtype for mode "affine", then also ``biases``; uint8 codes for the fp modes); optional
    ``bias`` [E, out]; the format as ``_extra_state`` (QuantFormatState), as QuantLinear, which
    it also follows in the dtypes of x and the output, torch.autocast included. ``activations="int8"``
    (affine only): each pair's rows of x quantized to int8 per block of 32 on every call
    (gather_qmm's int8 path, torch_qmm.activations; CPU, approximate); None: exact unless inside
    torch_qmm.activation_quantization.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        bits: int | None = None,
        group_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        mode: str = "affine",
        activations: str | None = None,
    ) -> None:
        super().__init__()
        dtype = module_dtype(dtype)
        check_positive_ints(num_experts=num_experts, in_features=in_features, out_features=out_features)
        check_module_activations(activations, mode)
        self.activations = activations
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        register_quantized_weight(self, (num_experts, out_features), in_features, bits, group_size, mode, device,
                                  dtype, "in_features")
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_experts, out_features, dtype=dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, bits: int | None = None,
        group_size: int | None = None, dtype: torch.dtype | None = None, mode: str = "affine",
        activations: str | None = None,
    ) -> "QuantSwitchLinear":
        """Quantizes W [E, out, in] (MLX's rounding, per row along in); bias [E, out] or None.
        dtype: compute dtype, default the weight's."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not weight.is_floating_point():
            got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"argument 'weight' must be a float tensor [num_experts, out, in], got {got}")
        e, out, k = weight.shape
        if bias is not None and tuple(bias.shape) != (e, out):
            raise ValueError(f"argument 'bias' must have shape [{e}, {out}], got {list(bias.shape)}")
        module = quantized_from(cls, weight, dtype, e, k, out, bias=bias is not None, bits=bits,
                                group_size=group_size, mode=mode, activations=activations)
        if bias is not None:
            with torch.no_grad():
                module.bias.copy_(bias.detach().to(module.bias.dtype))
        return module

    @classmethod
    def from_quantized(
        cls, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None = None,
        bias: torch.Tensor | None = None, bits: int | None = None, group_size: int | None = None,
        mode: str = "affine", dtype: torch.dtype | None = None, activations: str | None = None,
    ) -> "QuantSwitchLinear":
        """From MLX's tensors (QuantizedSwitchLinear's weight, scales, biases, bias; e.g. mx.quantize
        of [E, out, in] as torch tensors), kept bit for bit. dtype: compute dtype, default the float
        scales' (affine) or the bias' (else float32)."""
        if not isinstance(qweight, torch.Tensor) or qweight.dim() != 3 or qweight.dtype != torch.uint32:
            got = f"{qweight.dtype} {list(qweight.shape)}" if isinstance(qweight, torch.Tensor) else type(qweight).__name__
            raise ValueError(f"argument 'qweight' must be a uint32 tensor [num_experts, out, in*bits/32], got {got}")
        floats = [t for t in (scales, biases, bias) if t is not None and t.is_floating_point()]
        dtype = dtype or (floats[0].dtype if floats else torch.float32)
        bits, group_size = resolve_format(mode, bits, group_size)
        e, out, words = qweight.shape
        k = words * 32 // bits
        module = cls(e, k, out, bias=bias is not None, bits=bits, group_size=group_size, device=qweight.device,
                     dtype=dtype, mode=mode, activations=activations)
        parts = {"qweight": qweight, "scales": scales, "biases": biases}
        for name, t in parts.items():
            dst = getattr(module, name)
            if (dst is None) != (t is None):
                raise ValueError(f"argument '{name}': mode {mode!r} {'has' if t is None else 'has no'} {name}, "
                                 f"got {'None' if t is None else 'a tensor'}")
            if dst is not None and tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"argument '{name}' must have shape {list(dst.shape)} (num_experts={e}, out={out}, "
                                 f"in={k}, bits={bits}, group_size={group_size}), got {list(t.shape)}")
        if scales.is_floating_point() != module.scales.is_floating_point():
            raise ValueError(f"argument 'scales' of mode {mode!r} must be {module.scales.dtype}-like, got {scales.dtype}")
        with torch.no_grad():
            module.qweight.copy_(qweight)
            module.scales.copy_(scales)
            if biases is not None:
                module.biases.copy_(biases)
            if bias is not None:
                if tuple(bias.shape) != (e, out):
                    raise ValueError(f"argument 'bias' must have shape [{e}, {out}], got {list(bias.shape)}")
                module.bias.copy_(bias)
        return module

    @follows_autocast
    def forward(self, x: torch.Tensor, indices: torch.Tensor, sorted_indices: bool = False) -> torch.Tensor:
        """x [..., M, in], indices (int) broadcasting with x's batch dims -> [..., M, out], as
        mlx.core.gather_qmm(x, w, ..., rhs_indices=indices, transpose=True)."""
        y = ops.gather_qmm(x, self.qweight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                           group_size=self.group_size, bits=self.bits, mode=self.mode,
                           sorted_indices=sorted_indices, activations=self.activations)
        if self.bias is not None:
            y = y + self.bias[indices.long()].unsqueeze(-2).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}, bits={self.bits}, mode={self.mode}"
            f"{compute_dtype_repr(self)}{activations_repr(self)}"
        )


def packed_bytes(module: QuantSwitchLinear) -> int:
    """Bytes of a QuantSwitchLinear's quantized weight (qweight, scales, biases)."""
    return sum(t.numel() * t.element_size() for t in (module.qweight, module.scales, module.biases) if t is not None)


class QuantFusedExperts(nn.Module):
    """The routed experts of a MoE block with quantized weights: for each token t and each of its
    k experts e = top_k_index[t, j], y_t += top_k_weights[t, j] * down_e(gate(gate_up_e(x_t))).

    Children: ``gate_up_proj`` [E, 2I, H] (the gate and up rows in the order the source model keeps
    them, which `activation` reads) and ``down_proj`` [E, H, I], each a QuantSwitchLinear or a
    GGUFSwitchLinear (the experts of a GGUF file, torch_qmm.interop.modules),
    ``activation`` a module mapping [..., 2I] to [..., I]. forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H] in hidden_states' dtype: the forward of
    transformers' experts modules.
    """

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, activation: nn.Module,
                 interleaved: bool = False) -> None:
        super().__init__()
        if (gate_up_proj.num_experts != down_proj.num_experts or gate_up_proj.out_features != 2 * down_proj.in_features
                or down_proj.out_features != gate_up_proj.in_features):
            raise ValueError(
                f"QuantFusedExperts: gate_up_proj [E={gate_up_proj.num_experts}, {gate_up_proj.out_features}, "
                f"{gate_up_proj.in_features}] and down_proj [E={down_proj.num_experts}, {down_proj.out_features}, "
                f"{down_proj.in_features}] must be [E, 2I, H] and [E, H, I]"
            )
        self.gate_up_proj, self.down_proj, self.activation = gate_up_proj, down_proj, activation
        self.interleaved = interleaved  # gate/up rows alternate (else: all gate rows, then all up rows)
        self.num_experts = gate_up_proj.num_experts

    def switch(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, H], indices [T, k] -> [T, k, H]: each token through each of its experts (MLX-LM's
        SwitchGLU, including its sort of the (token, expert) pairs by expert)."""
        x = x.unsqueeze(-2).unsqueeze(-2)  # [T, 1, 1, H]: one row per token, broadcast over k
        idx, order = indices, None
        do_sort = sorts_pairs(indices.numel())
        if do_sort:
            k = indices.shape[-1]
            flat = indices.reshape(-1)
            order = torch.argsort(flat, stable=True)
            x = x.reshape(-1, 1, x.shape[-1])[order // k]  # [T*k, 1, H], grouped by expert
            idx = flat[order]
        h = self.activation(self.gate_up_proj(x, idx, sorted_indices=do_sort))
        y = self.down_proj(h, idx, sorted_indices=do_sort).squeeze(-2)
        if do_sort:
            y = torch.empty_like(y).index_copy_(0, order, y).reshape(*indices.shape, -1)
        return y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        y = self.switch(hidden_states, top_k_index)
        return (y * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(-2).to(hidden_states.dtype)

    def gate_and_up_rows(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate rows and the up rows of a [E, 2I, ...] tensor of gate_up_proj (MLX-LM keeps them
        as two layers)."""
        return split_gate_up(t, self.interleaved)

    def join_gate_and_up(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The inverse of gate_and_up_rows."""
        return join_gate_up(gate, up, self.interleaved)


def sorts_pairs(pairs) -> bool:
    """Whether QuantFusedExperts sorts `pairs` (token, expert) pairs by expert: from
    SORT_MIN_PAIRS on. Sorting changes the speed, not the result, so under torch.export, where the
    count may be symbolic (a dynamic number of tokens), it sorts unless the count is known to be
    smaller: a choice depending on the count would specialize the exported program to one side."""
    if torch.compiler.is_exporting():
        return not statically_known_true(pairs < SORT_MIN_PAIRS)
    return bool(pairs >= SORT_MIN_PAIRS)


def split_gate_up(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows, up rows) of a [E, 2I, ...] tensor: alternating rows, or the first I and the last I."""
    if interleaved:
        return t[:, 0::2], t[:, 1::2]
    half = t.shape[1] // 2
    return t[:, :half], t[:, half:]


def join_gate_up(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of split_gate_up."""
    if interleaved:
        return torch.stack((gate, up), dim=2).flatten(1, 2)
    return torch.cat((gate, up), dim=1)


class GateOfExperts(nn.Module):
    """[..., 2I] -> [..., I]: the gating of a transformers experts module (its class's _apply_gate:
    act_fn(gate) * up, or gpt-oss's clamped SwiGLU), run on that module with its weights removed,
    so that act_fn, alpha, limit and the row order are the model's own. The emptied module is held
    as a plain attribute, not a child: it has no state, and transformers' weight initialization
    must not visit an experts module without its weights."""

    def __init__(self, experts: nn.Module, weight_names: tuple[str, ...]) -> None:
        super().__init__()
        for name in weight_names:
            experts._parameters.pop(name, None)
        object.__setattr__(self, "experts", experts)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.experts._apply_gate(gate_up)

    def extra_repr(self) -> str:
        return f"{type(self.experts).__name__}._apply_gate"
