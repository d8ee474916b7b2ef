"""FormatState: a module's format in its state_dict, so that a state of another format is refused."""

from __future__ import annotations

from typing import Sequence

import torch

# Key of the format in a module's state_dict: torch's name for get_extra_state's value.
FORMAT_STATE_KEY = "_extra_state"


# The signed dtype of each unsigned one: the same bits, read as signed.
_SIGNED_OF = {torch.uint8: torch.int8, torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


class FormatState:
    """Mixin for modules whose buffer shapes do not tell their format: the format as integers
    (format_values(); by default the integer attributes named by FORMAT_FIELDS) goes into state_dict
    (``_extra_state``, an int32 vector), and loading a state that holds other values raises
    ValueError before any buffer is copied. torch.jit.script of such a module (or of a model holding
    one) raises a RuntimeError saying so; torch.export and torch.jit.trace record its ops.
    """

    FORMAT_FIELDS: tuple[str, ...] = ()

    def format_values(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, field)) for field in self.FORMAT_FIELDS)

    def describe_format(self, values: Sequence[int]) -> str:
        """`values` as a message shows them ("bits=4, group_size=64")."""
        return ", ".join(f"{field}={v}" for field, v in zip(self.FORMAT_FIELDS, values))

    def describe_state_shape(self) -> str:
        """The accepted state tensors, for the error message ("[1] (ggml_type)")."""
        return f"[{len(self.FORMAT_FIELDS)}] ({', '.join(self.FORMAT_FIELDS)})"

    def state_lengths(self) -> tuple[int, ...]:
        """The lengths a state of this class may have (any of its formats)."""
        return (len(self.FORMAT_FIELDS),)

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.format_values(), dtype=torch.int32)

    def set_extra_state(self, state) -> None:
        self._check_format_state(state, type(self).__name__)

    def _check_format_state(self, state, where: str) -> None:
        if not (isinstance(state, torch.Tensor) and state.dim() == 1 and state.shape[0] in self.state_lengths()
                and not state.is_floating_point() and not state.is_complex() and state.dtype != torch.bool):
            got = f"{state.dtype} {list(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(
                f"{where}: the format state must be an integer tensor {self.describe_state_shape()}, got {got}"
            )
        values = tuple(int(v) for v in state.tolist())
        if values != self.format_values():
            raise ValueError(
                f"{where}: the state holds {self.describe_format(values)}, this layer has "
                f"{self.describe_format(self.format_values())}; build the layer with the saved format to load it"
            )

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on the module and each submodule before compiling any of them.
        raise RuntimeError(
            f"torch.jit.script cannot compile {type(self).__name__}: its forward runs Python that TorchScript does "
            "not support; torch.export.export (or torch.jit.trace) records its torch_qmm ops instead (import "
            "torch_qmm before loading what it saves)"
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checked before torch copies the buffers, so a refused state leaves the module unchanged.
        key = prefix + FORMAT_STATE_KEY
        if key in state_dict:
            self._check_format_state(state_dict[key], f"{type(self).__name__} {key!r}")
        self._check_state_tensors(state_dict, prefix)
        unsigned = {name: t.dtype for name, t in self._buffers.items() if t is not None and t.dtype in _SIGNED_OF}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # load_state_dict(assign=True) takes a signed tensor as it came: the same bits, viewed back.
        for name, dtype in unsigned.items():
            t = self._buffers.get(name)
            if t is not None and t.dtype == _SIGNED_OF[dtype]:
                self._buffers[name] = t.view(dtype)

    def _check_state_tensors(self, state_dict, prefix: str) -> None:
        """ValueError naming the key, this layer's shape or dtype and the given one when a tensor of
        the state has another shape than the parameter or buffer it would be copied into, or a dtype
        that copy_ would convert into other values: packed codes and scale codes (uint32, uint8)
        must come in their dtype or the signed one of the same width (int32, int8: copy_ keeps the
        bits), never float (rounded) or wider (int64: wrapped); float tensors in a float dtype
        (cast, as nn.Linear's weights are)."""
        for name, own in (*self._parameters.items(), *self._buffers.items()):
            given = state_dict.get(prefix + name)
            if own is None or not isinstance(given, torch.Tensor):
                continue
            if given.shape != own.shape:
                raise ValueError(
                    f"{type(self).__name__} {prefix + name!r}: expected shape {list(own.shape)} (this layer, "
                    f"{self.describe_format(self.format_values())}), got {list(given.shape)}"
                )
            if own.is_floating_point() != given.is_floating_point() or (
                    not own.is_floating_point() and given.dtype not in (own.dtype, _SIGNED_OF.get(own.dtype))):
                expected = "a float dtype" if own.is_floating_point() else own.dtype
                raise ValueError(
                    f"{type(self).__name__} {prefix + name!r}: expected {expected} (this layer, "
                    f"{self.describe_format(self.format_values())}), got {given.dtype}"
                )


# ---- The quantized formats of QuantLinear / QuantEmbedding ---------------------------------------
# State [bits, group_size] for the affine mode (the state torch_qmm has always written), and
# [bits, group_size, c0, ..., c7] for the other modes: c the ASCII codes of the mode's name (MLX's
# mode string, as config.json files name it), zero-padded. The name, not a table index, so that a
# file means the same whatever formats a later version adds.
AFFINE = "affine"
_MODE_CHARS = 8
QUANT_STATE_LENGTHS = (2, 2 + _MODE_CHARS)


def quant_state_values(bits: int, group_size: int, mode: str) -> tuple[int, ...]:
    if mode == AFFINE:
        return (int(bits), int(group_size))
    codes = list(mode.encode("ascii"))
    if len(codes) > _MODE_CHARS:
        raise ValueError(f"mode name {mode!r} is longer than {_MODE_CHARS} characters")
    return (int(bits), int(group_size), *codes, *([0] * (_MODE_CHARS - len(codes))))


def parse_quant_state(values: Sequence[int]) -> tuple[int, int, str | None]:
    """(bits, group_size, mode) of a state's values; mode None when the codes spell no name."""
    bits, group_size, *codes = (int(v) for v in values)
    if not codes:
        return bits, group_size, AFFINE
    if not all(0 <= c < 128 for c in codes):
        return bits, group_size, None
    name = "".join(map(chr, codes)).rstrip("\0")
    # a name written by quant_state_values: printable, zero-padded to its length, not "affine"
    valid = (name.isprintable() and name not in ("", AFFINE)
             and quant_state_values(bits, group_size, name)[2:] == tuple(codes))
    return bits, group_size, name if valid else None


_UNSIGNED_BUFFERS_KEY = "_torch_qmm_unsigned_buffers"


class QuantFormatState(FormatState):
    """The format (bits, group_size, mode) of a QuantLinear / QuantEmbedding in state_dict: the
    buffer shapes cannot tell (qweight and scales of an 8-bit group_size=32 layer with K columns
    have the shapes of a 4-bit group_size=64 one with 2K).

    Pickling (pickle, copy, torch.save of the module): torch pickles a uint16 / uint32 / uint64
    tensor but cannot unpickle it outside torch.save's format ("'UntypedStorage' has no attribute
    'dtype'"), so the packed words are pickled as a signed view of the same bits and viewed back
    on unpickling."""

    def __getstate__(self):
        state = super().__getstate__()
        unsigned = {name: b.dtype for name, b in state["_buffers"].items()
                    if type(b) is torch.Tensor and b.dtype in _SIGNED_OF and b.element_size() > 1}
        if unsigned:
            buffers = state["_buffers"].copy()
            for name, dtype in unsigned.items():
                buffers[name] = buffers[name].view(_SIGNED_OF[dtype])
            state = {**state, "_buffers": buffers, _UNSIGNED_BUFFERS_KEY: unsigned}
        return state

    def __setstate__(self, state):
        state = dict(state)
        unsigned = state.pop(_UNSIGNED_BUFFERS_KEY, {})
        super().__setstate__(state)
        for name, dtype in unsigned.items():
            self._buffers[name] = self._buffers[name].view(dtype)

    FORMAT_FIELDS = ("bits", "group_size", "mode")
    bits: int
    group_size: int
    mode: str

    def format_values(self) -> tuple[int, ...]:
        return quant_state_values(self.bits, self.group_size, self.mode)

    def state_lengths(self) -> tuple[int, ...]:
        return QUANT_STATE_LENGTHS

    def describe_state_shape(self) -> str:
        return f"[2] (bits, group_size) or [{QUANT_STATE_LENGTHS[1]}] (bits, group_size, mode name)"

    def describe_format(self, values: Sequence[int]) -> str:
        bits, group_size, mode = parse_quant_state(values)
        return f"bits={bits}, group_size={group_size}, mode={mode if mode is not None else list(values[2:])}"
