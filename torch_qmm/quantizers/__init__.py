"""Quantizers that write MLX's affine format: rtn (MLX's round-to-nearest, bit for bit), mse
(data-free error-minimising scales and biases), awq and gptq (calibrated), and per-layer bits.

    torch_qmm.quantize_model(model, bits=4, group_size=64, method="gptq", calibration=[ids, ...])
    torch_qmm.quantize_model(model, bits=MixedBits(4.5, low=4, high=6), method="mse")

Methods by name (torch_qmm.quantizers.names(), methods.py): rtn, mse, awq, gptq and the presets
gptq-clip, awq-gptq, gptq-refit and awq-gptq-refit; other option sets as GPTQ(...) / AWQ(...).
Calibration without text: generate_calibration(model) samples it from the float model.
"""

from .generated import generate_calibration
from .mixed import MixedBits
from .methods import AWQ, GPTQ, REGISTRY, Method, help_text, names, register, resolve
from .plan import Plan, prepare

__all__ = ["AWQ", "GPTQ", "REGISTRY", "Method", "MixedBits", "Plan", "generate_calibration", "help_text", "names", "prepare",
           "register", "resolve"]
