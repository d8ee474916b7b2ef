"""QuantLinear: a drop-in replacement for nn.Linear holding weights in one of MLX's quantized
formats (the modes of torch_qmm.formats.FORMATS: affine, mxfp4, nvfp4, ...)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .activations import check_activations
from .format_state import QuantFormatState
from .formats import FORMATS, SUPPORTED_DTYPES, check_format, format_of, packed_words
from .ops import quantize, quantized_matmul

# torch.fx.symbolic_trace records a call of the product as one node (the function checks and
# dispatches on its arguments' values, which a trace does not have).
torch.fx.wrap("quantized_matmul")


def resolve_format(mode: str, bits: int | None, group_size: int | None) -> tuple[int, int]:
    """(bits, group_size) of `mode`, None meaning the mode's default (MLX's); ValueError naming
    the argument when the mode is unknown or does not allow the value (formats.format_of,
    check_format)."""
    fmt = format_of(mode)
    bits = fmt.default_bits if bits is None else bits
    group_size = fmt.default_group_size if group_size is None else group_size
    for name, value in (("bits", bits), ("group_size", group_size)):
        if type(value) is not int:
            raise ValueError(f"argument '{name}' must be an int, got {value!r}")
    check_format(bits, group_size, mode)
    return bits, group_size


def check_module_activations(activations: str | None, mode: str) -> None:
    """The ``activations`` argument of a quantized module (QuantLinear, QuantSwitchLinear):
    None, or a kind of torch_qmm.activations.KINDS for mode "affine" (ValueError otherwise)."""
    check_activations(activations)
    if activations is not None and mode != "affine":
        raise ValueError(f"argument 'activations' must be None for mode {mode!r} (int8 activations are "
                         f"implemented for mode 'affine'), got {activations!r}")


def activations_repr(module: nn.Module) -> str:
    """", activations=..." of a quantized module with a per-layer setting, else ""."""
    return f", activations={module.activations}" if module.activations is not None else ""


def check_positive_ints(**sizes) -> None:
    """ValueError naming the first argument of `sizes` that is not a positive int."""
    for name, v in sizes.items():
        if type(v) is not int or v <= 0:
            raise ValueError(f"argument '{name}' must be a positive int, got {v!r}")


def module_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """A quantized module's float dtype: `dtype`, else torch's default dtype (torch.set_default_dtype),
    as nn.Linear takes it, or float32 where that default is one the kernels do not take (float64)."""
    if dtype is not None:
        return dtype
    default = torch.get_default_dtype()
    return default if default in SUPPORTED_DTYPES else torch.float32


def register_quantized_weight(
    module: nn.Module,
    rows: int | tuple[int, ...],
    cols: int,
    bits: int | None,
    group_size: int | None,
    mode: str,
    device: torch.device | str | None,
    dtype: torch.dtype,
    cols_name: str,
) -> None:
    """Checks the format and registers a [rows, cols] weight quantized along cols on `module`:
    buffers ``qweight`` uint32 [rows, cols*bits/32] and ``scales`` [rows, cols/group_size] (in
    `dtype` for affine, uint8 codes for the fp modes), ``biases`` like scales for affine and None
    (no buffer) otherwise, and the attributes ``bits``, ``group_size`` and ``mode``. `rows` may be
    a shape (e.g. (experts, out) for a stack of weights). `cols_name` names cols in errors."""
    bits, group_size = resolve_format(mode, bits, group_size)
    if cols % group_size != 0:
        raise ValueError(f"argument '{cols_name}' must be a multiple of group_size={group_size}, got {cols}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"argument 'dtype' must be one of {SUPPORTED_DTYPES}, got {dtype}")
    fmt = FORMATS[mode]
    module.bits, module.group_size, module.mode = bits, group_size, mode
    groups = cols // group_size
    lead = tuple(rows) if isinstance(rows, tuple) else (rows,)
    module.register_buffer("qweight", torch.zeros(*lead, packed_words(cols, bits), dtype=torch.uint32, device=device))
    scale_dtype = dtype if fmt.has_biases else torch.uint8
    module.register_buffer("scales", torch.zeros(*lead, groups, dtype=scale_dtype, device=device))
    biases = torch.zeros(*lead, groups, dtype=dtype, device=device) if fmt.has_biases else None
    module.register_buffer("biases", biases)


def load_quantized_weight(module: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> None:
    """Quantizes a float [..., rows, cols] weight (cast to `dtype` first) into the buffers made by
    register_quantized_weight."""
    with torch.no_grad():
        wq, scales, *biases = quantize(
            weight.detach().to(dtype), group_size=module.group_size, bits=module.bits, mode=module.mode
        )
        module.qweight.copy_(wq)
        module.scales.copy_(scales)
        if biases:
            module.biases.copy_(biases[0])


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype torch.autocast gives the input x of a linear layer: inside an enabled autocast
    region for x's device type, the region's dtype for a float x other than float64 (which autocast
    leaves as it is); None otherwise (and on device types autocast does not know, such as meta)."""
    device = x.device.type
    if (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
            and x.is_floating_point() and x.dtype != torch.float64):
        return torch.get_autocast_dtype(device)
    return None


def follows_autocast(forward):
    """Decorates forward(self, x, ...) of a module that replaces nn.Linear so that it follows
    torch.autocast as nn.Linear does: where autocast_dtype(x) is a dtype, x is cast to it and the
    result has it. The quantized weights are not rounded to it: affine ones are multiplied in the
    dtype of their scales (the dtype the ops take x in), so x is cast on to that dtype (exactly,
    when it is wider) and the result back; the fp modes and GGUF blocks take x in any float dtype.
    Outside autocast, forward runs unchanged. Under torch.fx.symbolic_trace (no values, no
    autocast state) the two casts are recorded as calls that decide when the traced module runs."""

    @functools.wraps(forward)
    def wrapper(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not isinstance(x, torch.fx.Proxy) and autocast_dtype(x) is None:
            return forward(self, x, *args, **kwargs)
        scales = self._buffers.get("scales")  # (the buffer itself: under fx, self.scales is a proxy)
        compute = scales.dtype if scales is not None and scales.is_floating_point() else None
        return _autocast_output(forward(self, _autocast_input(x, compute), *args, **kwargs), x)

    return wrapper


def _autocast_input(x: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """x cast to autocast_dtype(x), then to the layer's compute dtype (None: none); x outside autocast."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return x
    x = x.to(dtype)
    return x if compute_dtype is None else x.to(compute_dtype)


def _autocast_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y in autocast_dtype(x) (as nn.Linear's result under autocast); y outside autocast."""
    dtype = autocast_dtype(x)
    return y if dtype is None else y.to(dtype)


torch.fx.wrap("_autocast_input")
torch.fx.wrap("_autocast_output")


def quantized_from(cls, weight: torch.Tensor, dtype: torch.dtype | None, *args, **kwargs) -> nn.Module:
    """cls(*args, device=weight's, dtype=dtype, **kwargs) holding the float `weight` quantized
    (load_quantized_weight): the from_float of the quantized modules. dtype: the compute dtype,
    default the weight's."""
    dtype = dtype or weight.dtype
    module = cls(*args, device=weight.device, dtype=dtype, **kwargs)
    load_quantized_weight(module, weight, dtype)
    return module


class QuantLinear(QuantFormatState, nn.Module):
    """y = x @ W.T + bias with W [out_features, in_features] stored in one of MLX's formats.

    Buffers (all in state_dict): ``qweight`` uint32 [out, in*bits/32]; ``scales`` [out,
    in/group_size], in the compute dtype for mode "affine" (then also ``biases``, the same shape)
    and uint8 codes for the fp modes (no biases); optional ``bias`` [out]; the format (bits,
    group_size, mode) as ``_extra_state`` (QuantFormatState). bits / group_size None: the mode's
    defaults (as mlx.nn.QuantizedLinear). ``.to(dtype)`` converts the float buffers (the compute
    dtype) and leaves the packed words and uint8 scales alone; inputs must have the compute dtype,
    as with nn.Linear (fp modes: any float dtype, the output has x's); inside torch.autocast, x
    and the output take the autocast dtype, as nn.Linear's do (follows_autocast). ``activations="int8"``
    (affine only): x quantized to int8 per block of 32 on every call (torch_qmm.activations; CPU,
    approximate); None: exact unless inside torch_qmm.activation_quantization.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int | None = None,
        group_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        mode: str = "affine",
        activations: str | None = None,
    ) -> None:
        super().__init__()
        dtype = module_dtype(dtype)
        check_positive_ints(in_features=in_features, out_features=out_features)
        check_module_activations(activations, mode)
        self.activations = activations
        self.in_features = in_features
        self.out_features = out_features
        register_quantized_weight(self, out_features, in_features, bits, group_size, mode, device, dtype,
                                  "in_features")
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int | None = None, group_size: int | None = None,
        dtype: torch.dtype | None = None, mode: str = "affine", activations: str | None = None,
    ) -> "QuantLinear":
        """Quantizes an nn.Linear (on its device). dtype: compute dtype, default the weight's (the
        weight is cast to it before quantization)."""
        module = quantized_from(cls, linear.weight, dtype, linear.in_features, linear.out_features,
                                bias=linear.bias is not None, bits=bits, group_size=group_size, mode=mode,
                                activations=activations)
        with torch.no_grad():
            if linear.bias is not None:
                module.bias.copy_(linear.bias.detach().to(module.bias.dtype))
        return module

    @follows_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quantized_matmul(x, self.qweight, self.scales, self.biases, transpose=True,
                             group_size=self.group_size, bits=self.bits, mode=self.mode,
                             activations=self.activations)
        if self.bias is not None:  # in y's dtype: x's (the fp modes take any float x)
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, bits={self.bits}, mode={self.mode}{compute_dtype_repr(self)}"
            + activations_repr(self)
        )


def compute_dtype_repr(module: nn.Module) -> str:
    """", dtype=..." of a quantized module's float tensors (the affine scales, else the bias)."""
    floats = [t for t in (module.scales, getattr(module, "bias", None)) if t is not None and t.is_floating_point()]
    return f", dtype={floats[0].dtype}" if floats else ""
