"""Checked mode: each seeded bug raises KernelFault with a useful message and its fixed
version runs clean; byte counters; throughput of the plain path."""
import os

import numpy as np
import pytest

SRC = r"""
#include <metal_stdlib>
using namespace metal;

// OOB device read: reads x[i + 1] for every thread (bug) / guarded (fixed)
kernel void shift_read(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       constant uint& n [[buffer(2)]], constant uint& fixed [[buffer(3)]],
                       uint i [[thread_position_in_grid]]) {
  if (i >= n) return;
  y[i] = (fixed && i + 1 >= n) ? 0.0f : x[i + 1];
}

// OOB device write: the grid is rounded up and the bug forgets the bounds check
kernel void scale_write(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                        constant uint& n [[buffer(2)]], constant uint& fixed [[buffer(3)]],
                        uint i [[thread_position_in_grid]]) {
  if (fixed && i >= n) return;
  y[i] = 2.0f * x[min(i, n - 1)];
}

// an access that starts inside the buffer and ends past it: a uint read at byte 4 of a 6-byte buffer (bug)
kernel void straddle_read(device const uint* x [[buffer(0)]], device uint* y [[buffer(1)]],
                          constant uint& fixed [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] = (fixed && i == 1) ? 0u : x[i];
}

// the same in threadgroup memory: a uint read at byte 4 of a 6-byte array (bug) / a ushort (fixed)
kernel void tg_straddle(device uint* y [[buffer(0)]], constant uint& fixed [[buffer(1)]],
                        uint i [[thread_index_in_threadgroup]]) {
  threadgroup uchar buf[6];
  if (i < 6) buf[i] = uchar(i);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const uchar* p = buf + 4;
  y[i] = fixed ? uint(*(threadgroup const ushort*)p) : *(threadgroup const uint*)p;
}

// uninitialised threadgroup read: thread i reads slot i+1, which only 63 threads write (bug)
kernel void tg_uninit(device float* y [[buffer(0)]], constant uint& fixed [[buffer(1)]],
                      uint i [[thread_index_in_threadgroup]]) {
  threadgroup float buf[65];
  buf[i] = float(i);
  if (fixed && i == 0) buf[64] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = buf[i + 1];
}

// threadgroup race: neighbour read without a barrier between write and read (bug)
kernel void tg_race(device float* y [[buffer(0)]], constant uint& fixed [[buffer(1)]],
                    uint i [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  buf[i] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  buf[i] = float(i);
  if (fixed) threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = buf[(i + 33) % 64];
}

// barrier divergence: some threads return before the barrier (bug)
kernel void early_exit(device float* y [[buffer(0)]], constant uint& fixed [[buffer(1)]],
                       uint i [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  if (!fixed && i >= 60) return;
  buf[i] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i < 60) y[i] = buf[63 - i];
}

// barrier divergence: two different barriers (bug)
kernel void two_barriers(device float* y [[buffer(0)]], constant uint& fixed [[buffer(1)]],
                         uint i [[thread_index_in_threadgroup]]) {
  if (!fixed && i < 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_device);
  }
  y[i] = 1.0f;
}

// shuffle from an inactive lane: lanes >= 16 exited, lane 15 reads lane 16 (bug)
kernel void shuffle_inactive(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                             constant uint& fixed [[buffer(2)]], ushort lane [[thread_index_in_simdgroup]]) {
  if (lane >= 16) return;
  ushort d = fixed ? ushort(lane < 8 ? 8 : 0) : ushort(1);
  y[lane] = simd_shuffle_down(x[lane], d) + (fixed ? 0.0f : 0.0f);
  if (fixed) return;
}

// simdgroup matrix multiply entered by half of the simdgroup (bug)
kernel void partial_mma(device const float* a [[buffer(0)]], device float* c [[buffer(1)]],
                        constant uint& fixed [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 A, B, C;
  simdgroup_load(A, a, 8);
  simdgroup_load(B, a, 8);
  C = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  if (fixed || lane < 16) simdgroup_multiply_accumulate(C, A, B, C);
  simdgroup_store(C, c, 8);
}

// a tiled kernel for the byte counters: each threadgroup reads all of w and its own row of x
kernel void counted(device const float* w [[buffer(0)]], device const float* x [[buffer(1)]],
                    device float* y [[buffer(2)]], uint2 tg [[threadgroup_position_in_grid]],
                    uint t [[thread_index_in_threadgroup]]) {
  float s = 0;
  for (uint k = 0; k < 64; k++) s += w[t * 64 + k] * x[tg.x * 64 + k];
  y[tg.x * 16 + t] = s;
}

kernel void axpy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  y[i] = 2.0f * x[i] + y[i];
}
"""

N = 100


@pytest.fixture(scope="module")
def lib(metalsim):
    return metalsim.compile(SRC)


def _run(lib, name, fixed, check=True):
    u = lambda v: np.uint32(v)  # noqa: E731
    x = np.arange(N, dtype=np.float32)
    y = np.zeros(128, np.float32)
    if name == "shift_read":
        return lib.dispatch(name, buffers={0: x, 1: y}, bytes={2: u(N), 3: u(fixed)}, threadgroups=4,
                            threads_per_threadgroup=32, check=check)
    if name == "scale_write":
        y = np.zeros(N, np.float32)
        return lib.dispatch(name, buffers={0: x, 1: y}, bytes={2: u(N), 3: u(fixed)}, threadgroups=4,
                            threads_per_threadgroup=32, check=check)
    if name == "straddle_read":
        return lib.dispatch(name, buffers={0: np.zeros(6, np.uint8), 1: np.zeros(2, np.uint32)}, bytes={2: u(fixed)},
                            threadgroups=1, threads_per_threadgroup=2, check=check)
    if name in ("shuffle_inactive", "partial_mma"):
        a = np.ones(64, np.float32)
        return lib.dispatch(name, buffers={0: a, 1: y if name == "shuffle_inactive" else np.zeros(64, np.float32)},
                            bytes={2: u(fixed)}, threadgroups=1, threads_per_threadgroup=32, check=check)
    return lib.dispatch(name, buffers={0: y}, bytes={1: u(fixed)}, threadgroups=2, threads_per_threadgroup=64,
                        check=check)


FAULTS = [
    ("shift_read", [r"out-of-bounds device read", r"buffer\(0\)", r"byte offset 400", r"thread_position_in_grid=\(99,0,0\)"]),
    ("scale_write", [r"out-of-bounds device write", r"buffer\(1\)", r"byte offset 400", r"thread_position_in_grid=\(100,0,0\)"]),
    ("straddle_read", [r"out-of-bounds device read of 4 bytes", r"buffer\(0\) byte offset 4 ", r"so 6 valid bytes",
                       r"thread_position_in_grid=\(1,0,0\)"]),
    ("tg_straddle", [r"out-of-bounds threadgroup read of 4 bytes", r"in/after 'buf'"]),
    ("tg_uninit", [r"uninitialised threadgroup memory 'buf' byte 256", r"thread_index_in_threadgroup=63"]),
    ("tg_race", [r"threadgroup memory race on 'buf' byte 0", r"thread_index_in_threadgroup=31 .*reads it after "
                 r"thread_index_in_threadgroup=0 wrote it", r"no threadgroup_barrier"]),
    ("early_exit", [r"barrier divergence", r"exited"]),
    ("two_barriers", [r"barrier divergence", r"different threadgroup_barrier"]),
    ("shuffle_inactive", [r"buffer\(1\) byte offset 60 holds an undefined value",
                          r"simd_shuffle_down by .*lane 15\) read lane 16, which is inactive"]),
    ("partial_mma", [r"simdgroup_multiply_accumulate entered by 16 of 32 lanes"]),
]


@pytest.mark.parametrize("name,patterns", FAULTS, ids=[f[0] for f in FAULTS])
def test_seeded_bug_raises_kernel_fault(lib, metalsim, name, patterns):
    with pytest.raises(metalsim.KernelFault) as ei:
        _run(lib, name, fixed=0)
    msg = str(ei.value)
    assert ei.value.kernel == name and f"kernel '{name}'" in msg
    for p in patterns:
        assert __import__("re").search(p, msg), f"{p!r} not in: {msg}"


@pytest.mark.parametrize("name", [f[0] for f in FAULTS])
def test_fixed_version_runs_clean(lib, name):
    _run(lib, name, fixed=1)


def test_env_var_turns_on_checked_mode(lib, metalsim, monkeypatch):
    monkeypatch.setenv("TORCH_QMM_METALSIM_CHECK", "1")
    assert metalsim.check_enabled()
    with pytest.raises(metalsim.KernelFault):
        _run(lib, "tg_race", fixed=0, check=None)
    monkeypatch.setenv("TORCH_QMM_METALSIM_CHECK", "0")
    _run(lib, "tg_race", fixed=0, check=None)  # unchecked: runs (result unspecified)


def test_byte_counters(lib):
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    y = np.zeros((8, 16), np.float32)
    st = lib.dispatch("counted", buffers={0: w, 1: x, 2: y}, threadgroups=(8, 1, 1), threads_per_threadgroup=16,
                      count=True)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-4, atol=1e-4)
    b = st.buffers
    assert b[0].bytes_loaded == 8 * 16 * 64 * 4 and b[0].unique_bytes == w.nbytes
    assert b[0].tg_footprint == 8 * w.nbytes  # every threadgroup fetches all of w
    assert b[1].bytes_loaded == 8 * 16 * 64 * 4 and b[1].unique_bytes == x.nbytes and b[1].tg_footprint == x.nbytes
    assert b[2].bytes_stored == y.nbytes and b[2].bytes_loaded == 0 and b[2].unique_bytes == y.nbytes
    plain = lib.dispatch("counted", buffers={0: w, 1: x, 2: y}, threadgroups=(8, 1, 1), threads_per_threadgroup=16,
                         check=False)
    assert plain.buffers[0].bytes_loaded == 0 and not plain.counted


def test_light_threads_all_run(lib):
    # a million light threads on one worker: every thread runs once and the dispatch reports them
    # all (throughput is measured by benchmarks, not asserted here)
    n = 1 << 20
    x = np.ones(n, np.float32)
    y = np.ones(n, np.float32)
    lib.dispatch("axpy", buffers={0: x, 1: y}, threadgroups=n // 256, threads_per_threadgroup=256, workers=1,
                 check=False)
    st = lib.dispatch("axpy", buffers={0: x, 1: y}, threadgroups=n // 256, threads_per_threadgroup=256, workers=1,
                      check=False)
    assert (y == 5).all()
    assert st.threads == n


# A shuffle that reads an inactive lane gives an undefined value (MSL), not an error: checked
# mode reports it where the value is used (stored to a device buffer, a branch, an address),
# not where it is discarded. Lanes >= 16 exit; lane 15's shuffle_down by 1 reads lane 16.
UNDEF_SRC = r"""
#include <metal_stdlib>
using namespace metal;
kernel void undef_use(device float* y [[buffer(0)]], device const int* idx [[buffer(1)]],
                      constant uint& mode [[buffer(2)]], ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup float tg[32];
  if (lane >= 16) return;
  float v = simd_shuffle_down(float(lane), ushort(1));
  int j = simd_shuffle_down(idx[lane], ushort(1));
  if (mode == 0) {         // discarded by lane 15: only lanes whose source is active keep theirs
    if (lane < 15) y[lane] = v;
  } else if (mode == 1) {  // left in threadgroup memory that nobody reads
    tg[lane] = v;
    y[lane] = 1.0f;
  } else if (mode == 2) {  // a branch on it
    if (v > 100.0f) y[lane] = 1.0f;
  } else {                 // an int used as an address
    y[j] = 1.0f;
  }
}
"""


@pytest.fixture(scope="module")
def undef_lib(metalsim):
    return metalsim.compile(UNDEF_SRC)


def _undef(lib, mode):
    y = np.zeros(32, np.float32)
    lib.dispatch("undef_use", buffers={0: y, 1: np.arange(1, 33, dtype=np.int32)}, bytes={2: np.uint32(mode)},
                 threadgroups=1, threads_per_threadgroup=32, check=True)
    return y


@pytest.mark.parametrize("mode", [0, 1], ids=["discarded", "left-in-threadgroup-memory"])
def test_undefined_shuffle_value_not_used_is_no_fault(undef_lib, mode):
    y = _undef(undef_lib, mode)
    if mode == 0:
        np.testing.assert_array_equal(y[:15], np.arange(1, 16))


@pytest.mark.parametrize("mode", [2, 3], ids=["branch", "address"])
def test_undefined_shuffle_value_used_is_a_fault(undef_lib, metalsim, mode):
    with pytest.raises(metalsim.KernelFault, match=r"undefined value is used .*lane 15\).*simd_shuffle_down by "
                                                    r".*lane 15\) read lane 16, which is inactive"):
        _undef(undef_lib, mode)
