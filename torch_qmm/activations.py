"""Opt-in activation quantization of quantized_matmul and gather_qmm, after llama.cpp: x quantized
to int8 per block along K (one float32 scale per block, round to nearest even; blocks of 32 for
the affine formats, of one 256-weight super-block for GGUF Q4_K / Q6_K: GGUF_INT8_TYPES), multiplied with the
weight codes in integer arithmetic. Faster on CPUs at small M, approximate: the bound and the
measured error are in docs/activation-quantization.md. Never the default.

    with torch_qmm.activation_quantization("int8"):
        y = model(x)                                   # every affine CPU qmm and gather_qmm (the MoE
                                                       # experts) of the block, and GGUF's
    layer = QuantLinear(..., activations="int8")       # this layer, always (QuantSwitchLinear alike)

The setting is per thread, as torch.no_grad's: a block in one thread leaves the calls of other
threads as they are (a new thread starts exact). It is read when quantized_matmul or gather_qmm
runs, so torch.compile guards on it and recompiles when it changes. It applies to affine-mode,
transpose=True calls on CPU tensors; other calls stay exact (an explicit ``activations="int8"``
argument raises for them instead).
"""

from __future__ import annotations

import contextlib
import threading

KINDS = ("int8",)
# The GGUF types with int8-activation kernels (csrc/cpu/actq_gguf.cpp): Q4_K, Q6_K. Calls on other
# GGUF types stay exact inside activation_quantization.
GGUF_INT8_TYPES = (12, 14)

# .kind: the setting of the calling thread (unset: None, exact).
_state = threading.local()


def check_activations(kind, name: str = "activations") -> None:
    """ValueError naming `name` unless kind is None (exact) or one of KINDS."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"argument '{name}' must be None (exact) or one of {KINDS}, got {kind!r}")


def current_activations() -> str | None:
    """The activation quantization in effect: None (exact) or a kind of KINDS."""
    return getattr(_state, "kind", None)


@contextlib.contextmanager
def activation_quantization(kind: str | None = "int8"):
    """Within the block, affine CPU quantized_matmul and gather_qmm calls quantize x to `kind`
    ("int8"); None: exact (e.g. to exempt a region inside an outer block)."""
    check_activations(kind, "kind")
    previous, _state.kind = current_activations(), kind
    try:
        yield
    finally:
        _state.kind = previous
