"""Quantizers that write MLX's affine format: rtn (MLX's round-to-nearest, bit for bit), mse
(data-free error-minimising scales and biases), awq and gptq (calibrated), and per-layer bits.

    torch_qmm.quantize_model(model, bits=4, group_size=64, method="gptq", calibration=[ids, ...])
    torch_qmm.quantize_model(model, bits=MixedBits(4.5, low=4, high=6), method="mse")
"""

from .generated import generate_calibration
from .mixed import MixedBits
from .plan import AWQ, CALIBRATED, DATA_FREE, GPTQ, METHODS, Plan, prepare

__all__ = ["AWQ", "CALIBRATED", "DATA_FREE", "GPTQ", "METHODS", "MixedBits", "Plan", "generate_calibration", "prepare"]
