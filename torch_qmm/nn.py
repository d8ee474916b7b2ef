"""QuantLinear: a drop-in replacement for nn.Linear holding affine-quantized weights."""

from __future__ import annotations

import torch
from torch import nn

from .formats import SUPPORTED_DTYPES, check_format, packed_words
from .ops import quantize


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W [out_features, in_features] stored in MLX's affine format.

    Buffers (all in state_dict): ``qweight`` uint32 [out, in*bits/32], ``scales`` and ``biases``
    [out, in/group_size] in the compute dtype; optional ``bias`` [out]. ``.to(dtype)`` converts the
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
        check_format(bits, group_size)
        if in_features % group_size != 0:
            raise ValueError(
                f"argument 'in_features' must be a multiple of group_size={group_size}, got {in_features}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"argument 'dtype' must be one of {SUPPORTED_DTYPES}, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.zeros(out_features, packed_words(in_features, bits), dtype=torch.uint32, device=device)
        )
        self.register_buffer("scales", torch.zeros(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("biases", torch.zeros(out_features, groups, dtype=dtype, device=device))
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
        with torch.no_grad():
            wq, scales, biases = quantize(linear.weight.detach().to(dtype), group_size=group_size, bits=bits)
            module.qweight.copy_(wq)
            module.scales.copy_(scales)
            module.biases.copy_(biases)
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
