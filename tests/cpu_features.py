"""What this CPU has, read from /proc/cpuinfo independently of the code under test, and the CPU
routing rules the tests share that depend on it.

The extension is built with -march=native (setup.py) unless TORCH_QMM_PORTABLE=1, so the
instruction sets a kernel is compiled for are this CPU's (NATIVE). The bfloat16 GEMM route
(csrc/cpu/bf16_gemm.h) instead asks torch at run time whether the CPU has bfloat16 matrix units,
whatever the build.
"""

from __future__ import annotations

import os
import platform

import torch


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


NATIVE = os.environ.get("TORCH_QMM_PORTABLE", "0") != "1" and platform.machine() == "x86_64"
HAS_AVX512 = NATIVE and {"avx512f", "avx512bw"} <= cpu_flags()
HAS_BF16 = HAS_AVX512 and "avx512_bf16" in cpu_flags()
HAS_VL = HAS_AVX512 and "avx512vl" in cpu_flags()  # the GGUF panel kernels (csrc/cpu/gguf_panel.cpp)
HAS_VBMI = HAS_AVX512 and "avx512vbmi" in cpu_flags()  # bit-stream chunks (bits 3/5/6) gather with vpermb
HAS_AVX2 = NATIVE and {"avx2", "fma"} <= cpu_flags()

# The int8-activation kernels' dot-product instructions (csrc/cpu/actq_dot.h kDotIsa), part of
# their route names ("int8x/<isa>-u4").
if NATIVE and {"avx512_vnni", "avx512vl"} <= cpu_flags():
    DOT_ISA = "avx512vnni"
elif NATIVE and "avx_vnni" in cpu_flags():
    DOT_ISA = "avxvnni"
else:
    DOT_ISA = "avx2"
# The 512-bit int8-activation kernels (actq_dot.h kHaveDot512; GGUF: AVX512BW alone), unless
# TORCH_QMM_CPU_NO_INT8_512.
HAS_INT8_512 = NATIVE and {"avx512_vnni", "avx512bw"} <= cpu_flags()
HAS_GGUF_INT8_512 = HAS_AVX512


def int8_affine_route(bits: int, k: int, no_512: bool | None = None) -> str:
    """The route of qmm_int8_activations for finite x [m, k] under the environment (`no_512`
    None: TORCH_QMM_CPU_NO_INT8_512 decides): bits 4 and 8 from K of one chunk (512-bit: 64
    bytes, where K holds an even number of 256-bit chunks; 256-bit: 32), else the portable kernel."""
    no_512 = env_on("TORCH_QMM_CPU_NO_INT8_512") if no_512 is None else no_512
    if HAS_AVX2 and not env_on("TORCH_QMM_CPU_NO_AVX2_CHUNKS") and bits in (4, 8):
        codes_per_byte = 8 // bits
        even = (k // (32 * codes_per_byte)) % 2 == 0
        if HAS_INT8_512 and not no_512 and k >= 64 * codes_per_byte and even:
            return f"int8x/avx512vnni-512-u{bits}"
        if k >= 32 * codes_per_byte:
            return f"int8x/{DOT_ISA}-u{bits}"
    return "int8x/scalar"


def int8_gguf_route(kind: str, no_512: bool | None = None) -> str:
    """The route of gguf_qmm_int8_activations for finite x, kind "q4k" or "q6k"."""
    no_512 = env_on("TORCH_QMM_CPU_NO_INT8_512") if no_512 is None else no_512
    if not HAS_AVX2 or env_on("TORCH_QMM_CPU_NO_AVX2_CHUNKS"):
        return "int8x/scalar"
    return f"int8x/avx512bw-{kind}" if HAS_GGUF_INT8_512 and not no_512 else f"int8x/avx2-{kind}"

# ---- the bfloat16 GEMM route ("gemm-bf16") --------------------------------------------------------
# Bfloat16 matrix units as torch reports them (at::cpu capabilities "amx_bf16" / "avx512_bf16"):
# AMX-BF16, or AVX512_BF16 alone (e.g. Zen 4) counts too.
HAS_BF16_MATRIX_UNITS = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
# AMX-BF16 tiles among them: the route then goes before the chunk kernels; with AVX512_BF16 alone
# it serves only where no chunk kernel does (csrc/cpu/bf16_gemm.h bf16_gemm_taken).
HAS_BF16_TILES = "amx_bf16" in cpu_flags()
BF16_GEMM_MIN_ROWS = 16  # mirrors csrc/cpu/bf16_gemm.h kBf16GemmMinRows


def env_on(name: str) -> bool:
    """Whether an environment switch is set as the C++ reads it (non-empty, not starting with 0)."""
    v = os.environ.get(name, "")
    return v != "" and v[0] != "0"


def takes_bf16_gemm(m: int, x_dtype: torch.dtype, transpose: bool = True, precision: str | None = None,
                    no_bf16: bool | None = None, *, bits: int, k: int, mode: str = "affine",
                    no_f32: bool | None = None) -> bool:
    """Whether CPU qmm of x [m, k] in x_dtype (in the chunk kernels' range) with weights of `mode`
    and `bits` takes "gemm-bf16": transpose=True, m >= 16, x allowed in bfloat16 (bfloat16 x, or
    float32 x under float32 matmul precision "medium"; `precision` None: torch's current
    setting), TORCH_QMM_CPU_NO_BF16 and _NO_BF16_GEMM unset (`no_bf16` None: the environment
    decides), and TORCH_QMM_CPU_FORCE_BF16_GEMM=1, or bfloat16 matrix units: AMX-BF16 tiles, or
    AVX512_BF16 alone where no chunk kernel serves the call (chunk_route with one bfloat16 term
    of x; `no_f32`: TORCH_QMM_CPU_NO_F32_CHUNKS as affine_chunk_route takes it). Its results are
    within the tolerance of float32 matmul precision "medium" (bf16_precision)."""
    if not transpose or m < BF16_GEMM_MIN_ROWS or env_on("TORCH_QMM_CPU_NO_BF16_GEMM"):
        return False
    no_bf16 = env_on("TORCH_QMM_CPU_NO_BF16") if no_bf16 is None else no_bf16
    if no_bf16:
        return False
    if x_dtype == torch.float32:
        if (torch.get_float32_matmul_precision() if precision is None else precision) != "medium":
            return False
    elif x_dtype != torch.bfloat16:
        return False
    if env_on("TORCH_QMM_CPU_FORCE_BF16_GEMM"):
        return True
    if not HAS_BF16_MATRIX_UNITS:
        return False
    return HAS_BF16_TILES or chunk_route(mode, bits, 1, m, k, no_bf16=no_bf16, no_f32=no_f32) is None


def bf16_precision(m: int, x_dtype: torch.dtype, transpose: bool = True, precision: str = "highest",
                   no_bf16: bool | None = None, *, bits: int, k: int, mode: str = "affine") -> str:
    """The tolerance precision (tests/tolerance.py X_RTOL) a CPU qmm result is held to: "medium"
    where the call takes gemm-bf16 (w rounded to bfloat16 as x is at "medium"), else `precision`."""
    taken = takes_bf16_gemm(m, x_dtype, transpose, precision, no_bf16, bits=bits, k=k, mode=mode)
    return "medium" if taken else precision


# ---- float32 x on the float32 chunk kernels --------------------------------------------------------
# The AVX2 affine chunk kernels (csrc/cpu/avx2_chunked.cpp): codes per chunk by bits, rows of x.
AVX2_AFFINE_CHUNKS = {3: 64, 4: 64, 5: 32, 6: 32, 8: 32}
AVX2_AFFINE_MAX_ROWS = 15  # cpu::avx2_affine_max_rows


def avx2_affine_serves(bits: int, m: int, k: int) -> bool:
    """Whether the AVX2 affine chunk kernel takes x [m, k] (x in range), TORCH_QMM_CPU_NO_AVX2_CHUNKS unset."""
    return (HAS_AVX2 and not env_on("TORCH_QMM_CPU_NO_AVX2_CHUNKS") and bits in AVX2_AFFINE_CHUNKS
            and k >= AVX2_AFFINE_CHUNKS[bits] and 1 <= m <= AVX2_AFFINE_MAX_ROWS)


def cpu_vendor() -> str:
    """vendor_id of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_is_intel() -> bool:
    return cpu_vendor() == "GenuineIntel"


def subnormal_fields_on() -> bool:
    """cpu::subnormal_fields_enabled(): TORCH_QMM_CPU_SUBNORMAL_FIELDS=1 or 0 says; unset, on AMD CPUs."""
    v = os.environ.get("TORCH_QMM_CPU_SUBNORMAL_FIELDS", "")
    return v == "1" if v else cpu_vendor() == "AuthenticAMD"


def fma_first() -> bool:
    """cpu::float32_fma_first(): the AVX-512 float32 multipliers before the bfloat16 dot products
    for 16-bit x, on Intel CPUs, unless TORCH_QMM_CPU_FMA_FIRST says otherwise (non-empty: "0..."
    no, anything else yes)."""
    v = os.environ.get("TORCH_QMM_CPU_FMA_FIRST", "")
    return v[0] != "0" if v else cpu_is_intel()


# ---- the AVX-512 affine chunk kernels ("chunked/f32", "chunked/bf16xP") ------------------------
F32_CHUNK_BITS = (4, 8)  # chunk.h F32Multiplier
F32_MAX_ROWS = {4: 24, 8: 16}  # cpu::f32_affine_max_rows, by bits
# cpu::chunked_max_rows by (bits, bfloat16 terms of x); None: no limit.
CHUNKED_MAX_ROWS = {(b, 3): 32 for b in (2, 4)} | {(b, 2): 128 for b in (2, 4)} | {(b, 1): None for b in (2, 4)}
CHUNKED_MAX_ROWS |= {(8, 3): 1, (8, 2): 2, (8, 1): 32}
CHUNKED_MAX_ROWS |= {(b, t): 16 for b in (3, 5, 6) for t in (2, 3)} | {(b, 1): 32 for b in (3, 5, 6)}


def f32_chunks_serve(bits: int, m: int, no_f32: bool | None = None) -> bool:
    """Whether the AVX-512 float32 affine multiplier takes x of m rows (K of a chunk, x in range):
    bits 4 and 8, up to F32_MAX_ROWS rows, TORCH_QMM_CPU_NO_F32_CHUNKS unset (`no_f32` None: the
    environment decides)."""
    return f32_format(bits, no_f32) and 1 <= m <= F32_MAX_ROWS[bits]


def f32_format(bits: int, no_f32: bool | None = None) -> bool:
    """Whether the AVX-512 float32 affine multiplier is there for `bits` (any M)."""
    no_f32 = env_on("TORCH_QMM_CPU_NO_F32_CHUNKS") if no_f32 is None else no_f32
    return HAS_AVX512 and not no_f32 and bits in F32_CHUNK_BITS


def float32_first(bits: int, terms: int, m: int, k: int, no_f32: bool | None = None) -> bool:
    """Whether the AVX-512 bfloat16 affine multipliers leave x to the float32 kernels: float32 x
    (three terms) where the float32 multiplier or the AVX2 kernels serve; bfloat16 / float16 x
    where the float32 multiplier serves and fma_first()."""
    if terms >= 3:
        return f32_chunks_serve(bits, m, no_f32) or avx2_affine_serves(bits, m, k)
    return f32_chunks_serve(bits, m, no_f32) and fma_first()


def affine_chunk_route(bits: int, terms: int, m: int, k: int, no_bf16: bool | None = None,
                       no_f32: bool | None = None) -> str | None:
    """The chunk route of CPU affine qmm, transpose=True, group size 32/64/128, x in range, under
    the environment (or `no_bf16` / `no_f32` for TORCH_QMM_CPU_NO_BF16 / _NO_F32_CHUNKS); None
    where no chunk kernel serves (the fused or GEMM routes)."""
    no_bf16 = env_on("TORCH_QMM_CPU_NO_BF16") if no_bf16 is None else no_bf16
    stream = bits in (3, 5, 6)
    if HAS_AVX512 and m >= 1 and k >= (32 if stream else 512 // bits) and not (stream and not HAS_VBMI):
        # Where fma_first(), the float32 multiplier keeps its bits from the bfloat16 ones at any M.
        displaced = fma_first() and f32_format(bits, no_f32)
        if HAS_BF16 and not no_bf16 and not float32_first(bits, terms, m, k, no_f32) and not displaced:
            limit = CHUNKED_MAX_ROWS[bits, terms]
            if limit is None or m <= limit:
                return f"chunked/bf16x{terms}"
        elif f32_chunks_serve(bits, m, no_f32):
            return "chunked/f32"
    if avx2_affine_serves(bits, m, k):
        return f"chunked/avx2-u{bits}"
    return None


# ---- every chunk route ------------------------------------------------------------------------
FP_CHUNK_CODES = {"mxfp4": 64, "nvfp4": 64, "mxfp8": 32}  # codes per chunk of the AVX2 fp kernels
FP_CHUNKED_MAX_ROWS = 16  # cpu::fp_chunked_max_rows
FP_MULTIPLIERS = {"mxfp4": "chunked/avx2-e2m1", "nvfp4": "chunked/avx2-e2m1", "mxfp8": "chunked/avx2-e4m3"}


def chunk_route(mode: str, bits: int, terms: int, m: int, k: int, no_bf16: bool | None = None,
                no_f32: bool | None = None) -> str | None:
    """The chunk route of CPU qmm (transpose=True, x in range) for weights of `mode` and `bits`
    and x in `terms` bfloat16 terms, or None: affine_chunk_route for the affine mode; the AVX2
    kernels of the fp modes from one chunk of K up to FP_CHUNKED_MAX_ROWS rows."""
    if mode == "affine":
        return affine_chunk_route(bits, terms, m, k, no_bf16=no_bf16, no_f32=no_f32)
    if (HAS_AVX2 and not env_on("TORCH_QMM_CPU_NO_AVX2_CHUNKS") and k >= FP_CHUNK_CODES[mode]
            and 1 <= m <= FP_CHUNKED_MAX_ROWS):
        return FP_MULTIPLIERS[mode]
    return None
