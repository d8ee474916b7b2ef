"""GGML tensor types: ids, block geometry, what torch_qmm does with each.

Python mirror of csrc/gguf_format.h (the C++/Metal side). Ids and block sizes are llama.cpp's
(ggml's `enum ggml_type` and block structs) as the gguf package lists them;
tests/test_gguf_qmm.py checks that csrc/gguf_format.h agrees.
"""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# id -> (name, weights per block, bytes per block), from the gguf package (llama.cpp's numbers).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES
}

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
F32, F16, BF16 = 0, 1, 30
IQ4_NL, IQ4_XS = 20, 23
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29
MXFP4 = 39
# The i-quants whose groups of 8 weights are codebook entries (metal/gguf_format.h, Lattice).
LATTICE_TYPES = (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)

# Kept as blocks, multiplied by the native op torch_qmm::gguf_qmm.
# Must match block_bytes / is_native_gguf_type in metal/gguf_format.h.
NATIVE_TYPES = tuple(sorted((Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) + LATTICE_TYPES))
# With a lossless affine form (group_size 32): one block (Q5_K, IQ4_XS: one sub-block of a
# super-block) is one affine group. Linear layers of these types but Q5_K and IQ4_XS (native)
# load as QuantLinear; embeddings of all of them as QuantEmbedding. IQ4_NL / IQ4_XS take 8 bits
# (their 4-bit codes index a non-uniform table of int8 values: gguf.to_affine), about twice the
# file's.
AFFINE_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K, IQ4_NL, IQ4_XS)
FLOAT_TYPES = (F32, F16, BF16)
# The same bits as one of MLX's fp formats (torch_qmm.formats): type -> mode. Linear layers and
# experts of these types load as QuantLinear / QuantSwitchLinear of that mode, bit for bit
# (gguf.to_fp). MXFP4: a block of 32 E2M1 codes with one E8M0 scale byte, MLX's mxfp4 group.
FP_TYPES = {MXFP4: "mxfp4"}
SUPPORTED_TYPES = (FLOAT_TYPES + AFFINE_TYPES + tuple(t for t in NATIVE_TYPES if t not in AFFINE_TYPES)
                   + tuple(FP_TYPES))
# Types whose layers keep their blocks in a quantized torch_qmm layer (never decoded to float).
QUANTIZED_TYPES = AFFINE_TYPES + tuple(t for t in NATIVE_TYPES if t not in AFFINE_TYPES) + tuple(FP_TYPES)


def type_name(ggml_type: int) -> str:
    entry = GGML_TYPES.get(int(ggml_type))
    return entry[0] if entry else f"unknown type {ggml_type}"


def block_info(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    _, per_block, nbytes = GGML_TYPES[int(ggml_type)]
    return per_block, nbytes


def supported_list() -> str:
    return ", ".join(type_name(t) for t in SUPPORTED_TYPES)


def native_list() -> str:
    """The native types as "id (name)", for messages."""
    return ", ".join(f"{t} ({type_name(t)})" for t in NATIVE_TYPES)


def native_type(ggml_type, in_features: int, features_arg: str = "in_features") -> tuple[int, int]:
    """(ggml_type as an int, bytes of one row of `in_features` weights) for a type GGUF blocks are
    kept in (NATIVE_TYPES); TypeError / ValueError naming the argument (features_arg: the name of
    in_features) otherwise."""
    native = native_list()
    if not isinstance(ggml_type, int) or isinstance(ggml_type, bool):
        raise TypeError(f"argument 'ggml_type' must be an int, one of {native}, got {ggml_type!r}")
    ggml_type = int(ggml_type)  # an IntEnum (gguf.GGMLQuantizationType) as its value
    if ggml_type not in NATIVE_TYPES:
        raise ValueError(f"argument 'ggml_type' must be one of {native}, got {ggml_type} ({type_name(ggml_type)})")
    per_block, block_bytes = block_info(ggml_type)
    if in_features % per_block != 0:
        raise ValueError(f"argument '{features_arg}' must be a multiple of {per_block}, got {in_features}")
    return ggml_type, in_features // per_block * block_bytes
