"""FormatState: a module's format in its state_dict, so that a state of another format is refused."""

from __future__ import annotations

from typing import Sequence

import torch

# Key of the format in a module's state_dict: torch's name for get_extra_state's value.
FORMAT_STATE_KEY = "_extra_state"


class FormatState:
    """Mixin for modules whose buffer shapes do not tell their format: the integer attributes named
    by FORMAT_FIELDS go into state_dict (``_extra_state``, int32 [len(FORMAT_FIELDS)]), and loading
    a state that holds other values raises ValueError before any buffer is copied.
    """

    FORMAT_FIELDS: tuple[str, ...] = ()

    def format_values(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, field)) for field in self.FORMAT_FIELDS)

    def describe_format(self, values: Sequence[int]) -> str:
        """`values` as a message shows them ("bits=4, group_size=64")."""
        return ", ".join(f"{field}={v}" for field, v in zip(self.FORMAT_FIELDS, values))

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.format_values(), dtype=torch.int32)

    def set_extra_state(self, state) -> None:
        self._check_format_state(state, type(self).__name__)

    def _check_format_state(self, state, where: str) -> None:
        n = len(self.FORMAT_FIELDS)
        if not (isinstance(state, torch.Tensor) and state.shape == (n,) and not state.is_floating_point()
                and not state.is_complex() and state.dtype != torch.bool):
            got = f"{state.dtype} {list(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(
                f"{where}: the format state must be an integer tensor [{n}] ({', '.join(self.FORMAT_FIELDS)}), "
                f"got {got}"
            )
        values = tuple(int(v) for v in state.tolist())
        if values != self.format_values():
            raise ValueError(
                f"{where}: the state holds {self.describe_format(values)}, this layer has "
                f"{self.describe_format(self.format_values())}; build the layer with the saved format to load it"
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checked before torch copies the buffers, so a refused state leaves the module unchanged.
        key = prefix + FORMAT_STATE_KEY
        if key in state_dict:
            self._check_format_state(state_dict[key], f"{type(self).__name__} {key!r}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
