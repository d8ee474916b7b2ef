"""SIMD-group and quad-group collectives, simdgroup_matrix and atomics under metalsim."""
import numpy as np
import pytest

SRC = r"""
#include <metal_stdlib>
using namespace metal;

kernel void reductions(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                       device int* iout [[buffer(2)]],
                       uint i [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float v = x[i];
  out[8 * i + 0] = simd_sum(v);
  out[8 * i + 1] = simd_max(v);
  out[8 * i + 2] = simd_min(v);
  out[8 * i + 3] = simd_prefix_exclusive_sum(v);
  out[8 * i + 4] = simd_prefix_inclusive_sum(v);
  out[8 * i + 5] = quad_sum(v);
  out[8 * i + 6] = simd_product(lane < 4 ? 2.0f : 1.0f);
  out[8 * i + 7] = float(simd_sum(half(1)));
  iout[4 * i + 0] = simd_or(1 << (lane % 8));
  iout[4 * i + 1] = int(uint64_t(simd_ballot(lane % 3 == 0)) & 0xffffffffu);
  iout[4 * i + 2] = simd_all(v > -100.0f) + 2 * simd_any(lane == 31);
  iout[4 * i + 3] = simd_is_first();
}

kernel void shuffles(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint i [[thread_position_in_grid]], ushort lane [[thread_index_in_simdgroup]]) {
  float v = x[i];
  out[8 * i + 0] = simd_shuffle(v, (lane * 7) % 32);
  out[8 * i + 1] = simd_shuffle_down(v, 3);
  out[8 * i + 2] = simd_shuffle_up(v, 5);
  out[8 * i + 3] = simd_shuffle_xor(v, 6);
  out[8 * i + 4] = simd_broadcast(v, 17);
  out[8 * i + 5] = quad_shuffle(v, 3 - lane % 4);
  out[8 * i + 6] = simd_shuffle_rotate_down(v, 30);
  float4 f4 = simd_shuffle_xor(float4(v, 1, 2, 3), 1);
  out[8 * i + 7] = f4.x + f4.w;
}

// tree reduction with shuffles, the way reduction kernels write it
kernel void shuffle_tree(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         uint i [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
  float v = x[i];
  for (ushort d = 16; d > 0; d /= 2) v += simd_shuffle_down(v, d);
  if (lane == 0) out[sg] = v;
}

// lanes that left early do not take part; diverged lanes reduce among themselves
kernel void divergent(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                      uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= 20) return;
  float v = x[lane];
  float s;
  if (lane < 8) s = simd_sum(v);
  else s = simd_sum(v * 10);
  out[lane] = s;
}

// simdgroup_matrix: C[M, N] = A[M, K] @ B[K, N], one 8x8 output tile per simdgroup, tiles of A and B
// staged through threadgroup memory; loads from device with a stride and a transposed load.
template <typename T>
[[kernel]] void mma(const device T* A [[buffer(0)]], const device T* B [[buffer(1)]],
                    device float* C [[buffer(2)]], const device T* BT [[buffer(3)]],
                    constant uint3& mnk [[buffer(4)]],
                    uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                    uint lane [[thread_index_in_simdgroup]], uint tid [[thread_index_in_threadgroup]]) {
  const uint M = mnk.x, N = mnk.y, K = mnk.z;
  threadgroup T As[2][8 * 8];
  simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_matrix<T, 8, 8> a, b;
  uint row0 = tg.y * 16 + (sg / 2) * 8;   // 4 simdgroups as 2x2 tiles
  uint col0 = tg.x * 16 + (sg % 2) * 8;
  for (uint k = 0; k < K; k += 8) {
    // each simdgroup stages its own A tile through threadgroup memory (2 elements per lane)
    if (sg < 2) {
      for (uint e = lane; e < 64; e += 32) As[sg][e] = A[(tg.y * 16 + sg * 8 + e / 8) * K + k + e % 8];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_load(a, &As[sg / 2][0], 8);
    if (sg % 2 == 0) simdgroup_load(b, B, N, ulong2(col0, k));
    else simdgroup_load(b, BT, K, ulong2(k, col0), true);     // B^T stored [N, K]
    simdgroup_multiply_accumulate(acc, a, b, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  simdgroup_store(acc, C, N, ulong2(col0, row0));
}
template [[host_name("mma_float")]] [[kernel]] decltype(mma<float>) mma<float>;
template [[host_name("mma_half")]] [[kernel]] decltype(mma<half>) mma<half>;

kernel void matrix_layout(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  thread auto& e = m.thread_elements();
  e[0] = lane * 2;
  e[1] = lane * 2 + 1;
  simdgroup_store(m, out, 8);
  simdgroup_float8x8 id(2.0f);
  simdgroup_float8x8 r;
  simdgroup_multiply(r, m, id);
  simdgroup_store(r, out + 64, 8);
}

kernel void atomics(device atomic_uint* counter [[buffer(0)]], device atomic_float* fsum [[buffer(1)]],
                    device uint* hist_out [[buffer(2)]], device const uint* keys [[buffer(3)]],
                    device atomic_int* mx [[buffer(4)]],
                    uint i [[thread_position_in_grid]], uint t [[thread_index_in_threadgroup]]) {
  threadgroup atomic_uint hist[8];
  if (t < 8) atomic_store_explicit(&hist[t], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(fsum, 0.5f, memory_order_relaxed);
  atomic_fetch_add_explicit(&hist[keys[i] % 8], 1u, memory_order_relaxed);
  atomic_fetch_max_explicit(mx, int(keys[i]), memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t < 8) {
    uint expected = atomic_load_explicit(&hist[t], memory_order_relaxed);
    uint old = expected;
    bool ok = atomic_compare_exchange_weak_explicit(&hist[t], &expected, old + 0u, memory_order_relaxed,
                                                    memory_order_relaxed);
    if (ok) atomic_fetch_add_explicit((device atomic_uint*)&hist_out[t], old, memory_order_relaxed);
  }
}
"""


@pytest.fixture(scope="module")
def lib(metalsim):
    return metalsim.compile(SRC)


def test_simd_reductions_scans_and_votes(lib):
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    out = np.zeros((64, 8), np.float32)
    iout = np.zeros((64, 4), np.int32)
    lib.dispatch("reductions", buffers={0: x, 1: out, 2: iout}, threadgroups=1, threads_per_threadgroup=64)
    g = x.reshape(2, 32)
    np.testing.assert_allclose(out[:, 0], np.repeat(g.sum(1), 32), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 1], np.repeat(g.max(1), 32))
    np.testing.assert_array_equal(out[:, 2], np.repeat(g.min(1), 32))
    inc = np.cumsum(g, 1, dtype=np.float32).reshape(-1)
    np.testing.assert_allclose(out[:, 4], inc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[:, 3], inc - x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 5], np.repeat(x.reshape(16, 4).sum(1), 4), rtol=1e-5)
    assert (out[:, 6] == 16).all() and (out[:, 7] == 32).all()
    assert (iout[:, 0] == 255).all()
    ballot = sum(1 << l for l in range(32) if l % 3 == 0)
    assert (iout[:, 1].astype(np.uint32) == ballot).all()
    assert (iout[:, 2] == 3).all()
    np.testing.assert_array_equal(iout[:, 3], (np.arange(64) % 32 == 0))


def test_simd_shuffles(lib):
    x = np.arange(64, dtype=np.float32) + 0.25
    out = np.zeros((64, 8), np.float32)
    lib.dispatch("shuffles", buffers={0: x, 1: out}, threadgroups=1, threads_per_threadgroup=64)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane
    np.testing.assert_array_equal(out[:, 0], x[base + (lane * 7) % 32])
    np.testing.assert_array_equal(out[:, 1], np.where(lane + 3 < 32, x[np.minimum(np.arange(64) + 3, 63)], x))
    np.testing.assert_array_equal(out[:, 2], np.where(lane >= 5, x[np.arange(64) - 5], x))
    np.testing.assert_array_equal(out[:, 3], x[base + (lane ^ 6)])
    np.testing.assert_array_equal(out[:, 4], x[base + 17])
    np.testing.assert_array_equal(out[:, 5], x[base + (lane & ~3) + 3 - lane % 4])
    np.testing.assert_array_equal(out[:, 6], x[base + (lane + 30) % 32])
    np.testing.assert_array_equal(out[:, 7], x[base + (lane ^ 1)] + 3)


def test_shuffle_tree_reduction(lib):
    x = np.random.default_rng(2).standard_normal(256).astype(np.float32)
    out = np.zeros(8, np.float32)
    lib.dispatch("shuffle_tree", buffers={0: x, 1: out}, threadgroups=1, threads_per_threadgroup=256)
    np.testing.assert_allclose(out, x.reshape(8, 32).sum(1), rtol=1e-5, atol=1e-5)


def test_collectives_over_diverged_and_exited_lanes(lib):
    x = np.arange(32, dtype=np.float32)
    out = np.full(32, -1, np.float32)
    lib.dispatch("divergent", buffers={0: x, 1: out}, threadgroups=1, threads_per_threadgroup=32)
    np.testing.assert_array_equal(out[:8], x[:8].sum())
    np.testing.assert_array_equal(out[8:20], x[8:20].sum() * 10)
    assert (out[20:] == -1).all()


def test_simdgroup_matrix_thread_elements_layout(lib):
    out = np.zeros(128, np.float32)
    lib.dispatch("matrix_layout", buffers={0: out}, threadgroups=1, threads_per_threadgroup=32)
    m = out[:64].reshape(8, 8)
    for lane in range(32):
        qid = lane // 4
        row = (qid & 4) + (lane // 2) % 4
        col = (qid & 2) * 2 + (lane % 2) * 2
        assert m[row, col] == lane * 2 and m[row, col + 1] == lane * 2 + 1
    np.testing.assert_array_equal(out[64:].reshape(8, 8), m * 2)


@pytest.mark.parametrize("dtype,name", [(np.float32, "mma_float"), (np.float16, "mma_half")])
def test_simdgroup_matrix_matmul_matches_numpy(lib, dtype, name):
    rng = np.random.default_rng(3)
    M, N, K = 32, 48, 24
    A = rng.standard_normal((M, K)).astype(dtype)
    B = rng.standard_normal((K, N)).astype(dtype)
    C = np.zeros((M, N), np.float32)
    mnk = np.array([M, N, K], np.uint32)
    lib.dispatch(name, buffers={0: A, 1: B, 2: C, 3: np.ascontiguousarray(B.T)}, bytes={4: mnk},
                 threadgroups=(N // 16, M // 16, 1), threads_per_threadgroup=(128, 1, 1), check=True)
    ref = A.astype(np.float64) @ B.astype(np.float64)
    np.testing.assert_allclose(C, ref, rtol=1e-4, atol=1e-4)


def test_atomics_on_device_and_threadgroup_memory(lib):
    n, tg = 256, 64
    keys = np.random.default_rng(4).integers(0, 1000, n).astype(np.uint32)
    counter = np.zeros(1, np.uint32)
    fsum = np.zeros(1, np.float32)
    hist = np.zeros(8, np.uint32)
    mx = np.zeros(1, np.int32)
    lib.dispatch("atomics", buffers={0: counter, 1: fsum, 2: hist, 3: keys, 4: mx}, threadgroups=n // tg,
                 threads_per_threadgroup=tg, workers=2)
    assert counter[0] == n and fsum[0] == n * 0.5 and mx[0] == keys.max()
    np.testing.assert_array_equal(hist, np.bincount(keys % 8, minlength=8))
    # and clean in checked mode (atomics are not races)
    counter[:] = 0
    hist[:] = 0
    lib.dispatch("atomics", buffers={0: counter, 1: fsum, 2: hist, 3: keys, 4: mx}, threadgroups=n // tg,
                 threads_per_threadgroup=tg, check=True)
    assert counter[0] == n
    np.testing.assert_array_equal(hist, np.bincount(keys % 8, minlength=8))
