"""torch_qmm: low-bit quantized matmul for PyTorch (MLX's affine and fp formats, GGUF blocks).

    import torch_qmm
    wq, scales, biases = torch_qmm.quantize(w, group_size=64, bits=4)
    y = torch_qmm.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4)
    wq, scales = torch_qmm.quantize(w, mode="mxfp4")            # as mx.quantize: no biases
    y = torch_qmm.quantized_matmul(x, wq, scales, mode="mxfp4")
    torch_qmm.quantize_model(model, bits=4, group_size=64)   # swaps nn.Linear for QuantLinear

torch_qmm.formats.FORMATS describes every mode (allowed and default bits and group sizes).
"""

from .formats import FORMATS, SUPPORTED_BITS, SUPPORTED_DTYPES, SUPPORTED_GROUP_SIZES
from .ops import dequantize, gather_qmm, quantize, quantized_matmul
from .activations import activation_quantization
from . import formats, nn, reference
from .convert import QuantizeSummary, quantize_model
from . import transformers_hook

transformers_hook.install()  # folders saved with torch_qmm layers reload with from_pretrained

__all__ = [
    "FORMATS",
    "SUPPORTED_BITS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_GROUP_SIZES",
    "QuantizeSummary",
    "activation_quantization",
    "dequantize",
    "formats",
    "gather_qmm",
    "nn",
    "quantize",
    "quantize_model",
    "quantized_matmul",
]
__version__ = "0.1.0"
