"""Interop: MLX checkpoints, GGUF files, transformers.

    from torch_qmm.interop import load_mlx, save_mlx
    load_mlx(model, "path/to/mlx-model")          # MLX-quantized folder -> QuantLinear layers
                                                   # (the model may be built on the meta device)
    save_mlx(model, "out")                         # readable by mlx / mlx_lm
"""

from .mlx import LoadReport, load_mlx, parse_quantization, quantization_config, save_mlx
from .modules import GGUFLinear, QuantEmbedding, TiedQuantLinear
from .mxfp4_blocks import load_mxfp4_checkpoint

__all__ = [
    "GGUFLinear",
    "LoadReport",
    "QuantEmbedding",
    "TiedQuantLinear",
    "load_mlx",
    "load_mxfp4_checkpoint",
    "parse_quantization",
    "quantization_config",
    "save_mlx",
]
