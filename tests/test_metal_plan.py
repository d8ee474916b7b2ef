"""The planner (csrc/plan.cpp): routing table, kernel names, geometry, validation."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_qmm
from metal_helpers import BITS, DTYPES, GROUPS, ROUTE_PROBLEMS, plan, require_clang, routes


def test_every_route_has_a_problem_that_selects_it():
    # GGUF: tests/test_metal_gguf.py; gather_qmm: tests/test_metal_gather.py
    table = {r["route"] for r in routes() if r["op"] not in ("gguf_qmm", "gather_qmm")}
    assert table == set(ROUTE_PROBLEMS), "tests/metal_helpers.py ROUTE_PROBLEMS must list every affine route"
    for route, (op, M, N, K, transpose) in ROUTE_PROBLEMS.items():
        launches = plan(op, M, N, K, 4, 64, torch.float16, transpose)
        assert [l["route"] for l in launches] == [route], (route, launches)


def test_routing_by_m_matches_the_table():
    expect_t = {1: "qmv_bounded", 2: "qmm_t_bm2", 3: "qmm_t_bm4", 4: "qmm_t_bm4", 5: "qmm_t_bm8", 8: "qmm_t_bm8",
                9: "qmm_t_mma16", 16: "qmm_t_mma16", 17: "qmm_t_mma32", 32: "qmm_t_mma32", 129: "qmm_t_mma32"}
    for M, route in expect_t.items():
        assert plan("qmm", M, 40, 128, 4, 64, torch.float32, True)[0]["route"] == route, M
    expect_n = {1: "qvm_bounded", 3: "qvm_bounded", 4: "qmm_n_mma32", 129: "qmm_n_mma32"}
    for M, route in expect_n.items():
        assert plan("qmm", M, 128, 40, 4, 64, torch.float32, False)[0]["route"] == route, M


@pytest.mark.parametrize("bits", BITS)
def test_qmv_fast_needs_aligned_shapes(bits):
    block = 512 if bits <= 5 else 256  # Must match qmv_block_k in metal/qmm_params.h
    assert plan("qmm", 1, 64, block, bits, 64, torch.float16)[0]["route"] == "qmv_fast"
    assert plan("qmm", 1, 64, block + 64, bits, 64, torch.float16)[0]["route"] == "qmv_bounded"
    assert plan("qmm", 1, 60, block, bits, 64, torch.float16)[0]["route"] == "qmv_bounded"


def test_kernel_names_follow_the_convention():
    (l,) = plan("qmm", 1, 4096, 4096, 4, 64, torch.float16)
    assert l["kernel"] == "affine_qmv_fast_float16_t_gs_64_b_4"
    (l,) = plan("qmm", 64, 4096, 4096, 3, 128, torch.bfloat16, False)
    assert l["kernel"] == "affine_qmm_n_mma32_bfloat16_t_gs_128_b_3"
    (l,) = plan("dequantize", 0, 10, 64, 8, 32, torch.float32)
    assert l["kernel"] == "affine_dequantize_rows_float_gs_32_b_8"


def test_geometry_and_bindings():
    (l,) = plan("qmm", 1, 4096, 4096, 4, 64, torch.float16)
    assert l["threadgroups"] == [512, 1, 1] and l["threads_per_threadgroup"] == [64, 1, 1]
    assert {b["operand"]: b["index"] for b in l["buffers"]} == {"wq": 0, "scales": 1, "biases": 2, "x": 3, "y": 4}
    assert l["bytes"] == [{"index": 5, "u32": [1, 4096, 4096, 0]}]
    (l,) = plan("qmm", 33, 37, 192, 4, 64, torch.float16)
    assert l["threadgroups"] == [2, 2, 1] and l["threads_per_threadgroup"] == [128, 1, 1]
    (l,) = plan("qmm", 13, 37, 192, 4, 64, torch.float16)
    assert l["threadgroups"] == [2, 1, 1] and l["threads_per_threadgroup"] == [64, 1, 1]
    (l,) = plan("qmm", 7, 37, 192, 4, 64, torch.float16)
    assert l["threadgroups"] == [5, 1, 1]
    (l,) = plan("qmm", 3, 300, 45, 4, 64, torch.float16, False)
    assert l["threadgroups"] == [2, 3, 1] and l["threads_per_threadgroup"] == [128, 1, 1]


def test_empty_problems_plan_no_launch():
    assert plan("qmm", 0, 64, 64, 4, 64, torch.float32) == []
    assert plan("qmm", 3, 64, 0, 4, 64, torch.float32, False) == []
    assert plan("dequantize", 0, 0, 64, 4, 64, torch.float32) == []


def test_plan_for_runs_the_same_validation_as_the_cpu_ops():
    wq, s, b = torch_qmm.quantize(torch.randn(8, 64), group_size=32, bits=4)
    x = torch.randn(2, 48)
    with pytest.raises(ValueError) as cpu:
        torch.ops.torch_qmm.affine_qmm(x, wq, s, b, 4, 32, True)
    with pytest.raises(ValueError) as planned:
        torch.ops.torch_qmm._plan_for("qmm", [x, wq, s, b], 4, 32, True)
    assert str(planned.value).splitlines()[0] == str(cpu.value).splitlines()[0]
    with pytest.raises(ValueError, match="bits"):
        torch.ops.torch_qmm._plan("qmm", 1, 8, 64, 7, 32, torch.float32, True)
    with pytest.raises(TypeError, match="x"):
        torch.ops.torch_qmm._plan_for("qmm", [x.half()[:, :64], wq, s, b], 4, 32, True)


def test_every_kernel_a_plan_can_name_exists_in_the_library():
    require_clang()
    from torch_qmm.metalsim_backend import library

    for bits in BITS:
        kernels = set(library(bits).kernels)
        named = set()
        for gs, dtype, (op, M, N, K, transpose) in itertools.product(GROUPS, DTYPES, ROUTE_PROBLEMS.values()):
            if op != "qmm":
                K = gs * 3
            elif not transpose:
                N = gs * 3
            elif M == 1 and N == 64:
                K = 512 if bits <= 5 else 256
            else:
                K = gs * 3
            named |= {l["kernel"] for l in plan(op, M, N, K, bits, gs, dtype, transpose)}
        assert len(named) == len(ROUTE_PROBLEMS) * len(GROUPS) * len(DTYPES)
        missing = named - kernels
        assert not missing, f"bits={bits}: planned kernels missing from metal/quant.metal: {sorted(missing)[:5]}"


def test_fp_modes_plan_their_kernels_without_biases():
    for mode, gs in (("mxfp4", 32), ("nvfp4", 16)):
        for op, M in (("qmm", 1), ("qmm", 7), ("qmm", 40), ("quantize", 0), ("dequantize", 0)):
            (l,) = plan(op, M, 40, 4 * gs, 4, gs, torch.float16, True, mode)
            assert l["kernel"].startswith(mode + "_") and l["kernel"].endswith(f"_float16_t_gs_{gs}_b_4")
            assert "biases" not in {b["operand"] for b in l["buffers"]}
    (l,) = plan("qmm", 1, 40, 128, 4, 64, torch.float16)
    assert "biases" in {b["operand"] for b in l["buffers"]}
    with pytest.raises(ValueError, match="mode"):
        torch.ops.torch_qmm._plan("qmm", 1, 40, 128, 4, 32, torch.float16, True, "mxfp5")


def test_a_route_row_without_geometry_does_not_compile(tmp_path):
    """RouteRow's Geometry has no default: leaving it out of a row is a compile error, not a
    run-time gap (csrc/plan.h)."""
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    row = ('{"r", Op::kQmm, kQuantModes, 1, 1, 1, Cond::kAny, "qmv_fast", %s "when", "why"}')
    for geometry, compiles in (("Geometry::tiled(1, 8, 64),", True), ("", False)):
        src = tmp_path / "row.cpp"
        src.write_text('#include "plan.h"\nusing namespace torch_qmm::plan;\n'
                       f"const RouteRow kRow = {row % geometry};\n")
        r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{csrc}", str(src)], capture_output=True, text=True)
        assert (r.returncode == 0) == compiles, r.stderr[-2000:]
