"""QuantLinear: a drop-in replacement for nn.Linear holding affine-quantized weights."""

from __future__ import annotations

import torch
from torch import nn

from .format_state import FormatState
from .formats import SUPPORTED_DTYPES, check_format, packed_words
from .ops import quantize


def register_affine_weight(
    module: nn.Module,
    rows: int,
    cols: int,
    bits: int,
    group_size: int,
    device: torch.device | str | None,
    dtype: torch.dtype,
    cols_name: str,
) -> None:
    """Checks the format and registers a [rows, cols] weight quantized along cols on `module`:
    buffers ``qweight`` uint32 [rows, cols*bits/32], ``scales`` and ``biases`` [rows, cols/group_size]
    in `dtype`, and the attributes ``bits`` and ``group_size``. `cols_name` names cols in errors."""
    check_format(bits, group_size)
    if cols % group_size != 0:
        raise ValueError(f"argument '{cols_name}' must be a multiple of group_size={group_size}, got {cols}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"argument 'dtype' must be one of {SUPPORTED_DTYPES}, got {dtype}")
    module.bits = bits
    module.group_size = group_size
    groups = cols // group_size
    module.register_buffer("qweight", torch.zeros(rows, packed_words(cols, bits), dtype=torch.uint32, device=device))
    module.register_buffer("scales", torch.zeros(rows, groups, dtype=dtype, device=device))
    module.register_buffer("biases", torch.zeros(rows, groups, dtype=dtype, device=device))


def load_affine_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Quantizes a float [rows, cols] weight into the buffers made by register_affine_weight."""
    with torch.no_grad():
        wq, scales, biases = quantize(
            weight.detach().to(module.scales.dtype), group_size=module.group_size, bits=module.bits
        )
        module.qweight.copy_(wq)
        module.scales.copy_(scales)
        module.biases.copy_(biases)


class AffineFormatState(FormatState):
    """The affine format (bits, group_size) in state_dict (FormatState). The buffer shapes cannot
    tell: qweight and scales of an 8-bit group_size=32 layer with K columns have the shapes of a
    4-bit group_size=64 one with 2K.
    """

    FORMAT_FIELDS = ("bits", "group_size")
    bits: int
    group_size: int


class QuantLinear(AffineFormatState, nn.Module):
    """y = x @ W.T + bias with W [out_features, in_features] stored in MLX's affine format.

    Buffers (all in state_dict): ``qweight`` uint32 [out, in*bits/32], ``scales`` and ``biases``
    [out, in/group_size] in the compute dtype; optional ``bias`` [out]; the format (bits,
    group_size) as ``_extra_state`` (AffineFormatState). ``.to(dtype)`` converts the
    float buffers (the compute dtype) and leaves the packed words alone; inputs must have the
    compute dtype, as with nn.Linear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 4,
        group_size: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        register_affine_weight(self, out_features, in_features, bits, group_size, device, dtype, "in_features")
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int = 4, group_size: int = 64, dtype: torch.dtype | None = None
    ) -> "QuantLinear":
        """Quantizes an nn.Linear (on its device). dtype: compute dtype, default the weight's."""
        dtype = dtype or linear.weight.dtype
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            bits=bits,
            group_size=group_size,
            device=linear.weight.device,
            dtype=dtype,
        )
        load_affine_weight(module, linear.weight)
        with torch.no_grad():
            if linear.bias is not None:
                module.bias.copy_(linear.bias.detach().to(dtype))
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.torch_qmm.affine_qmm(x, self.qweight, self.scales, self.biases, self.bits, self.group_size, True)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, bits={self.bits}, dtype={self.scales.dtype}"
        )
