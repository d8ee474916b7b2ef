"""The quantization methods by name: the one table that quantize_model, TorchQmmConfig and
`python -m torch_qmm convert --method` read.

A method is a name and the options of the pass that runs it: rtn and mse are data-free (each
layer on its own weights); gptq and awq are calibrated (GPTQ / AWQ options below). Named presets
are the option sets worth asking for by name; any other set is passed as a GPTQ(...) or AWQ(...).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTQ:
    """gptq options: damp, the fraction of the mean Hessian diagonal added to it; act_order, visit
    columns by decreasing activation energy (the stored format is the same either way); clip,
    choose each group's scale and bias by the mse search weighted by the inputs' energy instead of
    the min/max range; refit, rounds of refitting each row's scales and biases to the layer's
    output error with the codes fixed (gptq.refine; 0: none); sequential, quantize a block's
    layers in execution order (q/k/v, o, gate/up, down), each on inputs recomputed through the
    block's already-quantized layers (GPTQ's "true sequential"), instead of all from one pass."""

    damp: float = 0.01
    act_order: bool = False
    clip: bool = False
    refit: int = 0
    sequential: bool = False

    def __post_init__(self):
        if not (isinstance(self.damp, (int, float)) and not isinstance(self.damp, bool) and 0 < self.damp < 1):
            raise ValueError(f"argument 'damp' must be in (0, 1), got {self.damp!r}")
        if not isinstance(self.refit, int) or isinstance(self.refit, bool) or not 0 <= self.refit <= 8:
            raise ValueError(f"argument 'refit' must be an int in [0, 8], got {self.refit!r}")
        for flag in ("act_order", "clip", "sequential"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"argument '{flag}' must be a bool, got {getattr(self, flag)!r}")


@dataclass(frozen=True)
class AWQ:
    """awq options: gptq, GPTQ options to quantize each scaled layer with GPTQ's error feedback
    (on the Hessian of its scaled inputs) instead of the activation-weighted mse search; None
    (default) for the mse search."""

    gptq: GPTQ | None = None

    def __post_init__(self):
        if self.gptq is not None and not isinstance(self.gptq, GPTQ):
            raise TypeError(f"argument 'gptq' must be a GPTQ or None, got {type(self.gptq).__name__}")


@dataclass(frozen=True)
class Method:
    """A named method: `kind` names the pass ("rtn", "mse", "gptq", "awq"), `options` its GPTQ /
    AWQ options (None for the data-free kinds)."""

    name: str
    kind: str
    options: GPTQ | AWQ | None
    summary: str

    @property
    def calibrated(self) -> bool:
        return self.options is not None


_KINDS = {"rtn": type(None), "mse": type(None), "gptq": GPTQ, "awq": AWQ}
REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Adds a named method (its name must be new; its kind one of rtn, mse, gptq, awq with options
    of that kind's type)."""
    if not isinstance(method, Method):
        raise TypeError(f"argument 'method' must be a torch_qmm.quantizers.Method, got {type(method).__name__}")
    if method.kind not in _KINDS or not isinstance(method.options, _KINDS[method.kind]):
        raise ValueError(f"method {method.name!r}: kind must be one of {tuple(_KINDS)} with options of type "
                         f"{_KINDS.get(method.kind, object).__name__}, got kind={method.kind!r}, options={method.options!r}")
    if method.name in REGISTRY:
        raise ValueError(f"a method named {method.name!r} is already registered")
    REGISTRY[method.name] = method
    return method


_BEST_GPTQ = GPTQ(act_order=True, clip=True)
_REFIT_GPTQ = GPTQ(act_order=True, clip=True, refit=2, sequential=True)
for _m in (
    Method("rtn", "rtn", None, "MLX's round-to-nearest, bit for bit (the default)"),
    Method("mse", "mse", None, "data-free: per group, the clipping range and least-squares scale/bias of least "
                               "weight error"),
    Method("awq", "awq", AWQ(), "activation-aware per-channel scales folded into the producer, then the "
                                "activation-weighted clipping search"),
    Method("gptq", "gptq", GPTQ(), "Hessian error feedback, groups by the min/max range"),
    Method("gptq-clip", "gptq", _BEST_GPTQ, "gptq with activation order and the energy-weighted clipping search"),
    Method("awq-gptq", "awq", AWQ(gptq=_BEST_GPTQ), "awq's scales, then gptq-clip's error feedback on the scaled "
                                                    "layers"),
    Method("gptq-refit", "gptq", _REFIT_GPTQ, "gptq-clip quantizing each block's layers in execution order, "
                                              "then refitting scales and biases to the output error"),
    Method("awq-gptq-refit", "awq", AWQ(gptq=_REFIT_GPTQ), "awq's scales, then gptq-refit on the scaled layers"),
):
    register(_m)


def names() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(REGISTRY)


def resolve(method) -> Method:
    """The Method of a name, or of GPTQ(...) / AWQ(...) options; ValueError / TypeError otherwise."""
    if isinstance(method, Method):
        return method
    if isinstance(method, GPTQ):
        return Method("gptq", "gptq", method, "")
    if isinstance(method, AWQ):
        return Method("awq", "awq", method, "")
    if isinstance(method, str):
        if method not in REGISTRY:
            raise ValueError(f"argument 'method' must be one of {names()} (or torch_qmm.quantizers.GPTQ(...) / "
                             f"AWQ(...)), got {method!r}")
        return REGISTRY[method]
    raise TypeError(f"argument 'method' must be a method name {names()} or torch_qmm.quantizers.GPTQ(...) / "
                    f"AWQ(...), got {type(method).__name__}")


def help_text() -> str:
    """One line per registered method (the CLI's --method help)."""
    return "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY.values())
