"""An independent audit list: realistic single bugs written from the product code alone, by
someone who had not read the tests (python -m tests.mutation --fresh). The test selections are
broad (whole files chosen by name), not the tests meant to catch each bug: the question is
whether the suite as a whole kills them. Not run in CI."""

from __future__ import annotations

import glob
import os

from . import ROOT, Mutant


def _files(*patterns: str) -> tuple[str, ...]:
    out: list[str] = []
    for pat in patterns:
        found = sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / pat)))
        out += [f for f in found if f not in out]
    return tuple(out)


METAL = _files("tests/test_routes_metal.py", "tests/test_metal_ops.py", "tests/test_metal_gguf.py",
               "tests/test_metal_plan.py", "tests/test_metal_*.py")
PLAN = _files("tests/test_metal_plan.py", "tests/test_routes_metal.py", "tests/test_metal_ops.py",
              "tests/test_metal_gguf.py")
VALIDATE = _files("tests/test_errors.py", "tests/test_hardening_ops.py", "tests/test_fakes.py",
                  "tests/test_hostile_files.py", "tests/test_gguf_qmm.py", "tests/test_qmm.py")
# (order only sets how soon -x stops: the faster files first)
CPU = _files("tests/test_quantize.py", "tests/test_hardening_ops.py", "tests/test_errors.py", "tests/test_qmm.py",
             "tests/test_gguf_qmm.py", "tests/test_cpu_*.py", "tests/test_routes_cpu.py")
OPS = _files("tests/test_regressions.py", "tests/test_qmm.py", "tests/test_nn.py", "tests/test_compile.py", "tests/test_errors.py",
             "tests/test_hardening_ops.py", "tests/test_fakes.py")
NN = _files("tests/test_nn.py", "tests/test_regressions.py", "tests/test_hardening_ops.py", "tests/test_interop_transformers.py")
CONVERT = _files("tests/test_nn.py", "tests/test_regressions.py", "tests/test_interop_transformers.py",
                 "tests/test_cli_convert.py")
MLX = _files("tests/test_interop_mlx.py", "tests/test_interop_mlx_lm.py", "tests/test_interop_cli.py",
             "tests/test_cli_convert.py")
GGUF = _files("tests/test_interop_gguf*.py", "tests/test_hostile_files.py", "tests/test_gguf_qmm.py",
              "tests/test_interop_cli.py", "tests/test_cli_convert.py")
CLI = _files("tests/test_cli_convert.py", "tests/test_interop_cli.py", "tests/test_cli_help.py",
             "tests/test_hostile_files.py")

MUTANTS: list[Mutant] = [
    # ---- Metal kernels (metal/) ----------------------------------------------------------------
    Mutant("f-qmv-bounded-k-tail-off-by-one", "metal/quant_qmv.h",
           "    if (bounded && k >= K) break;", "    if (bounded && k > K) break;", METAL,
           "a lane whose slice starts exactly at K still reads x[K..K+V) and the next row's weights: "
           "wrong y (and out-of-bounds reads) whenever K % (32*V) != 0"),
    Mutant("f-decode8-odd-bits-absolute-byte-shift", "metal/quant_format.h",
           "v |= uint32_t(p[j]) << (8 * (j - first));", "v |= uint32_t(p[j]) << (8 * j);", METAL,
           "bits 3/5/6: the second half-unit's bytes are shifted by their absolute byte index, so "
           "codes 4..7 of every unit decode wrong"),
    Mutant("f-qmv-2bit-prescale-x3", "metal/quant_common.h",
           "      xt[i + 3] = x3 / 64.0f;", "      xt[i + 3] = x3 / 32.0f;", METAL,
           "bits 2 qmv: every fourth code is read as twice its value"),
    Mutant("f-qvm-reduction-drops-last-simdgroup", "metal/quant_qvm.h",
           "for (int s = 1; s < QVM_SIMDGROUPS; ++s)", "for (int s = 1; s < QVM_SIMDGROUPS - 1; ++s)", METAL,
           "transpose=False small M: rows k = 3, 7, 11, ... of W are left out of y (any K >= 4)"),
    Mutant("f-quantize-pack-carry-shift", "metal/quant_format.h",
           "      cur = used > 0 ? q >> (bits - used) : 0u;", "      cur = used > 0 ? q >> used : 0u;", METAL,
           "Metal quantize, bits 3/5/6: the high bits of a code that straddles two words go to the next "
           "word shifted wrong"),
    Mutant("f-mma-b-frag-wnk-index", "metal/mma_tile.h",
           "WLoader::W_NK ? ws[(n + 1) * LDW + k] : ws[k * LDW + n + 1];",
           "WLoader::W_NK ? ws[n * LDW + k + 1] : ws[k * LDW + n + 1];", METAL,
           "transposed W tile: the second element of each B fragment is read along k instead of n "
           "(every mma route with transpose=True and gguf mma32)"),
    Mutant("f-affine-mma-loader-local-group", "metal/quant_mma.h",
           "    const float s = F::scale(scales, ga * groups + gc / G);",
           "    const float s = F::scale(scales, ga * groups + c / G);", METAL,
           "the mma W loader takes the scale group of the tile-local column: wrong for every K-step past "
           "the first group"),
    Mutant("f-q4k-scale-min-copy-paste", "metal/gguf_format.h",
           "    r.min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);", "    r.min = (q[j + 4] >> 4) | ((q[j - 4] >> 6) << 4);",
           METAL, "Metal Q4_K: the mins of sub-blocks 4..7 take their top bits from the scale bytes"),
    Mutant("f-q6k-slice-scale-index", "metal/gguf_qmm.h",
           "      scale[t] = d * float(b->scales[8 * h + 2 * t + l0 / 16]);",
           "      scale[t] = d * float(b->scales[8 * h + 2 * t + l0 / 8]);", METAL,
           "gguf_qmv/bm Q6_K: lanes past the first 16 weights of a run use the wrong sub-block scale"),
    Mutant("f-gguf-mma-q4k-min-sign", "metal/gguf_mma.h",
           "w[4 * h + i] = s * float((v >> (8 * i + shift)) & 0xfu) - m;",
           "w[4 * h + i] = s * float((v >> (8 * i + shift)) & 0xfu) + m;", METAL,
           "gguf mma32 Q4_K loader adds the sub-block min instead of subtracting it (M >= 17)"),
    Mutant("f-gguf-bm-x-row-missing-m0", "metal/gguf_qmm.h",
           "    const device T* xb = x + m0 * K + ib * torch_qmm::gguf::kQK_K;",
           "    const device T* xb = x + ib * torch_qmm::gguf::kQK_K;", METAL,
           "gguf bm8 with 9..16 rows of x (two row blocks): the second block reads the first block's rows of x"),
    # ---- Planner (csrc/plan.cpp) ---------------------------------------------------------------
    Mutant("f-plan-qmv-fast-ignores-n", "csrc/plan.cpp",
           "    return p.N % QMV_ROWS_PER_TG == 0 && p.K % qmv_block_k(p.bits) == 0;",
           "    return p.K % qmv_block_k(p.bits) == 0;", PLAN,
           "M = 1 with N % 8 != 0 takes qmv_fast, which has no row bounds: writes past y"),
    Mutant("f-plan-mma16-m-min-off-by-one", "csrc/plan.cpp",
           '{"qmm_t_mma16", Op::kQmm, kQuantModes, 1, 9, 16,', '{"qmm_t_mma16", Op::kQmm, kQuantModes, 1, 10, 16,', PLAN,
           "M = 9 with transpose=True has no route (logic_error: the table has a gap)"),
    Mutant("f-plan-ceil-div-off-by-one", "csrc/plan.cpp",
           "  const int64_t q = (a + b - 1) / b;", "  const int64_t q = a / b + 1;", PLAN,
           "every grid gets one threadgroup too many when the size divides evenly (qmv_fast then writes "
           "past y; plan JSON grids change)"),
    # ---- Validation (csrc/) ------------------------------------------------------------------
    Mutant("f-validate-biases-shape-dropped", "csrc/validate.cpp",
           "    TORCH_CHECK_VALUE(biases->sym_sizes() == scales.sym_sizes(), op,",
           "    TORCH_CHECK_VALUE(true, op,", VALIDATE,
           "biases of another shape than scales are accepted: out-of-bounds reads or a wrong answer "
           "instead of a ValueError"),
    Mutant("f-validate-x-dtype-dropped", "csrc/validate.cpp",
           "  TORCH_CHECK_TYPE(x.scalar_type() == scales.scalar_type(), op,",
           "  TORCH_CHECK_TYPE(true, op,", VALIDATE,
           "x in another float dtype than scales is accepted (the kernels reinterpret one as the other)"),
    Mutant("f-gguf-validate-x-k-dropped", "csrc/gguf_validate.cpp",
           "  TORCH_CHECK_VALUE(x.dim() >= 1 && x.sym_size(-1) == K, op,",
           "  TORCH_CHECK_VALUE(x.dim() >= 1, op,", VALIDATE,
           "gguf_qmm accepts x whose last dimension is not K: reads past x or a silently wrong answer"),
    # ---- CPU kernels (csrc/cpu/) ------------------------------------------------------------------
    Mutant("f-cpu-quantize-range-overflow-unchecked", "csrc/cpu/quantize.cpp",
           "      if (std::isinf(w_max - w_min)) range_overflow.store(true, std::memory_order_relaxed);\n", "",
           CPU, "a finite group whose max - min overflows float32 is quantized to an Inf scale instead of refused"),
    Mutant("f-cpu-q6k-decode-s4-index", "csrc/cpu/gguf_qmm.cpp",
           "                  s4 = d * float(sc[is + 6]);", "                  s4 = d * float(sc[is + 4]);", CPU,
           "CPU Q6_K decode (GEMM path, M >= 16): the last run of 32 weights of each half uses run 3's scale"),
    # ---- Python ops and modules ----------------------------------------------------------------
    Mutant("f-ops-backward-same-transpose", "torch_qmm/ops.py",
           "_ops.qmm(t, wq, scales, biases, mode, bits, group_size, not transpose), grad)",
           "_ops.qmm(t, wq, scales, biases, mode, bits, group_size, transpose), grad)", OPS,
           "dx = dy @ W.T instead of dy @ W: a shape error, or a wrong gradient for square W"),
    Mutant("f-ops-backward-biases-grad-not-refused", "torch_qmm/ops.py",
           "    if any(ctx.needs_input_grad[1:4]):", "    if any(ctx.needs_input_grad[1:3]):", OPS,
           "biases that require grad get None silently instead of the clear error"),
    Mutant("f-nn-forward-swapped-format-args", "torch_qmm/nn.py",
           "group_size=self.group_size, bits=self.bits, mode=self.mode)",
           "group_size=self.bits, bits=self.group_size, mode=self.mode)", NN,
           "QuantLinear.forward passes bits and group_size swapped"),
    Mutant("f-nn-state-precheck-dropped", "torch_qmm/format_state.py",
           '            self._check_format_state(state_dict[key], f"{type(self).__name__} {key!r}")',
           "            pass", NN,
           "a state_dict of another format is refused only after torch copied its buffers: the layer is "
           "left modified (or the shape error comes first)"),
    Mutant("f-convert-first-name-only", "torch_qmm/convert.py",
           "        for name, module in model.named_modules(remove_duplicate=False)\n        if type(module) is nn.Linear",
           "        for name, module in model.named_modules()\n        if type(module) is nn.Linear", CONVERT,
           "a Linear registered under two names is replaced at the first only: the other stays float"),
    # ---- Interop ---------------------------------------------------------------------------------
    Mutant("f-mlx-false-override-unchecked", "torch_qmm/interop/mlx.py",
           "        if spec is False:\n            raise ValueError(", "        if False:\n            raise ValueError(",
           MLX, "a config that says a layer is not quantized while the checkpoint stores its scales crashes "
           "(AttributeError on False.bits) instead of a ValueError naming config.json"),
    Mutant("f-gguf-q5_1-high-bits-offset", "torch_qmm/interop/gguf.py",
           "nibbles(b[..., 8:24]) | (high_bits(4) << 4)", "nibbles(b[..., 8:24]) | (high_bits(2) << 4)",
           GGUF, "Q5_1 -> affine takes the 5th bits from the m field (copy-paste from Q5_0)"),
    Mutant("f-gguf-q4k-affine-min-high-bits", "torch_qmm/interop/gguf.py",
           "    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)",
           "    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((lo >> 2) & 0x30)], axis=-1)", GGUF,
           "q4_k_to_affine: mins of sub-blocks 4..7 take their top bits from the scale bytes"),
    Mutant("f-gguf-header-data-offset-unpadded", "torch_qmm/interop/gguf_header.py",
           "    data_offset = _pad(c.pos, alignment)", "    data_offset = c.pos", GGUF,
           "the data section is taken to start right after the tensor infos, not at the next alignment "
           "boundary: tensors read shifted bytes (or the file-size check refuses valid files)"),
    Mutant("f-output-dst-inside-src-allowed", "torch_qmm/interop/output_folder.py",
           "    if s == d or s in d.parents or d in s.parents:", "    if s == d or d in s.parents:", CLI,
           "convert SRC SRC/out writes into its source"),
    Mutant("f-cli-bits-without-requantize-ignored", "torch_qmm/interop/cli_convert.py",
           "    if flags and not args.requantize:", "    if flags and not args.requantize and False:", CLI,
           "GGUF convert with --bits but no --requantize silently ignores --bits"),
    Mutant("f-cli-requantize-rest-drops-exact-layers", "torch_qmm/interop/cli_convert.py",
           'keep_affine=args.requantize != "all")', "keep_affine=args.requantize is None)", CLI,
           "--requantize rest re-quantizes the exact (Q8_0/Q4_0/.../Q4_K) layers too: lossy"),
]
