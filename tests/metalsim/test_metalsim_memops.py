"""Checked/counting mode sees the accesses clang does not emit as plain 1-16 byte loads and stores:
loops turned into memset/memcpy, struct copies (llvm.memcpy), zero-initialisation (llvm.memset),
wide vectors. Regression tests: a zero-filled threadgroup array read after a barrier
was reported as uninitialised, and out-of-bounds copies went unreported and uncounted."""
import importlib
import re

import numpy as np
import pytest

SRC = r"""
#include <metal_stdlib>
using namespace metal;

struct Row { float v[16]; };   // 64 bytes: clang copies it with llvm.memcpy

// each thread zero-fills a contiguous chunk (clang's loop idiom makes this a memset)
kernel void zero_chunks_then_read(device float* y [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tg[2048];
  for (uint k = i * 32; k < i * 32 + 32; k++) tg[k] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = tg[(i * 37) % 2048] + 1.0f;
}

// one thread zero-fills, the others read after the barrier
kernel void zero_by_one_then_read(device float* y [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tg[4096];
  if (i == 0) for (uint k = 0; k < 4096; k++) tg[k] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = tg[4095 - i] + 2.0f;
}

// strided zero-fill as in the issue: for (k = tid; k < N; k += 64)
kernel void zero_strided_then_read(device float* y [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tg[4096];
  for (uint k = i; k < 4096; k += 64) tg[k] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = tg[(i * 61) % 4096] + 3.0f;
}

// a threadgroup struct zero-initialised by aggregate assignment (llvm.memset), then read
kernel void zero_struct_then_read(device float* y [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup Row r[4];
  if (i < 4) r[i] = Row{};
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = r[i % 4].v[i % 16] + 4.0f;
}

// zero-fill only half, then read all: the other half really is uninitialised
kernel void zero_half_then_read(device float* y [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tg[4096];
  if (i == 0) for (uint k = 0; k < 2048; k++) tg[k] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = tg[2048 + i];
}

// a copy loop (memcpy idiom) over device memory, n elements from one thread
kernel void copy_loop(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i != 0) return;
  for (uint k = 0; k < n; k++) y[k] = x[k];
}

// struct copy from device memory: row i + shift (shift = 1 reads past the last row)
kernel void copy_rows(device const Row* x [[buffer(0)]], device Row* y [[buffer(1)]],
                      constant uint& shift [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] = x[i + shift];
}

// 32-byte vector loads/stores (wider than sanitizer coverage traces)
kernel void copy_float8(device const float8* x [[buffer(0)]], device float8* y [[buffer(1)]],
                        constant uint& shift [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] = x[i + shift];
}
"""


@pytest.fixture(scope="module")
def lib(metalsim):
    return metalsim.compile(SRC)


ZERO_FILLS = [("zero_chunks_then_read", 1.0), ("zero_by_one_then_read", 2.0), ("zero_strided_then_read", 3.0),
              ("zero_struct_then_read", 4.0)]


@pytest.mark.parametrize("name,value", ZERO_FILLS, ids=[z[0] for z in ZERO_FILLS])
def test_zero_fill_then_read_runs_clean_in_checked_mode(lib, name, value):
    y = np.full(64, -1.0, np.float32)
    lib.dispatch(name, buffers={0: y}, threadgroups=2, threads_per_threadgroup=64, check=True)
    assert (y == value).all()


def test_partial_zero_fill_still_reports_uninitialised_read(lib, metalsim):
    y = np.zeros(64, np.float32)
    with pytest.raises(metalsim.KernelFault, match=r"uninitialised threadgroup memory 'tg' byte 8192"):
        lib.dispatch("zero_half_then_read", buffers={0: y}, threadgroups=1, threads_per_threadgroup=64, check=True)


def _copy(lib, name, n_src, n_dst, arg, count=False, check=True, row=1):
    x = np.arange(n_src * row, dtype=np.float32).reshape(n_src, row)
    y = np.zeros((n_dst, row), np.float32)
    threads = 1 if name == "copy_loop" else n_dst
    st = lib.dispatch(name, buffers={0: x, 1: y}, bytes={2: np.uint32(arg)}, threadgroups=1,
                      threads_per_threadgroup=threads, check=check, count=count)
    return st, x, y


@pytest.mark.parametrize("name,n_src,n_dst,arg,row,buf,offset", [
    ("copy_loop", 100, 200, 150, 1, 0, 400),    # reads x[100..149]
    ("copy_loop", 200, 100, 150, 1, 1, 400),    # writes y[100..149]
    ("copy_rows", 4, 4, 1, 16, 0, 256),         # thread 3 copies row 4 of 4
    ("copy_float8", 4, 4, 1, 8, 0, 128),
])
def test_out_of_bounds_copy_is_reported(lib, metalsim, name, n_src, n_dst, arg, row, buf, offset):
    with pytest.raises(metalsim.KernelFault) as ei:
        _copy(lib, name, n_src, n_dst, arg, row=row)
    msg = str(ei.value)
    kind = "read" if buf == 0 else "write"
    assert re.search(rf"out-of-bounds device {kind} of \d+ bytes at buffer\({buf}\) byte offset {offset}\b", msg), msg


@pytest.mark.parametrize("name,n,row", [("copy_loop", 100, 1), ("copy_rows", 5, 16), ("copy_float8", 5, 8)])
def test_byte_counters_over_copies_are_exact(lib, name, n, row):
    st, x, y = _copy(lib, name, n, n if name == "copy_loop" else n - 1, n if name == "copy_loop" else 1,
                     count=True, check=False, row=row)
    if name == "copy_loop":
        np.testing.assert_array_equal(y, x)
        moved = x.nbytes
    else:
        np.testing.assert_array_equal(y, x[1:])
        moved = y.nbytes
    b = st.buffers
    assert (b[0].bytes_loaded, b[0].bytes_stored, b[0].unique_bytes, b[0].tg_footprint) == (moved, 0, moved, moved)
    assert (b[1].bytes_loaded, b[1].bytes_stored, b[1].unique_bytes, b[1].tg_footprint) == (0, moved, moved, moved)


def test_rewrite_routes_intrinsics_and_wide_accesses(metalsim):
    _trace_ir = importlib.import_module(metalsim.__name__ + "._trace_ir")

    ir = "\n".join([
        "  tail call void @llvm.memcpy.p0.p0.i64(ptr noundef nonnull align 4 %8, ptr align 4 %6, i64 64, i1 false)",
        "  call void @llvm.memset.p0.i64(ptr align 16 %t, i8 0, i64 4096, i1 false), !dbg !3",
        "  %25 = load <8 x float>, ptr %21, align 4, !tbaa !4",
        "  store <3 x float> <float 0.0, float 1.0, float 2.0>, ptr %p.x, align 16",
        "  %26 = load <4 x float>, ptr %22, align 16",
        "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1 immarg)",
    ])
    out = _trace_ir.rewrite(ir).splitlines()
    assert out[0] == "  tail call void @__msim_memcpy(ptr noundef nonnull align 4 %8, ptr align 4 %6, i64 64)"
    assert out[1] == "  call void @__msim_memset(ptr align 16 %t, i8 0, i64 4096), !dbg !3"
    assert out[2] == "  call void @__msim_trace(ptr %21, i64 32, i32 0)"
    assert out[4] == "  call void @__msim_trace(ptr %p.x, i64 12, i32 1)"
    assert out[6] == "  %26 = load <4 x float>, ptr %22, align 16"  # 16 bytes: sanitizer coverage traces it
    with pytest.raises(_trace_ir.UnsupportedIR):
        _trace_ir.rewrite("  call void @llvm.memcpy.p0.p1.i64(ptr %a, ptr addrspace(1) %b, i64 8, i1 false)")
