"""The threads a CPU kernel call runs on (csrc/cpu/work_split.h): one per 2^20 multiply-adds of
the call, at most torch's thread count, so that small calls run on the calling thread with no
parallel region (a region waits for every thread of its team to start, which on cores shared with
other processes can take a scheduler time slice)."""

import pytest
import torch

import torch_qmm  # noqa: F401  (registers the ops)


def threads_for(M, N, K):
    return torch.ops.torch_qmm._cpu_threads(torch.zeros(M, K), N, K)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("M,N,K,pool,expected", [
    (1, 1536, 576, 2, 1),      # a small model's MLP layer: 0.88 M multiply-adds
    (1, 1024, 1024, 2, 1),     # exactly 2^20: one thread's worth
    (1, 2048, 1024, 2, 2),     # 2^21: two
    (3, 1024, 1024, 4, 3),     # three rows of x: three threads' worth
    (1, 4096, 14336, 2, 2),    # the benchmark's shape: every thread of the pool
    (1, 4096, 14336, 1, 1),
    (16, 4096, 4096, 4, 4),
])
def test_threads_follow_the_work_up_to_the_pool(threads, M, N, K, pool, expected):
    threads(pool)
    assert threads_for(M, N, K) == expected


def test_x_that_is_not_rows_of_k_is_refused():
    with pytest.raises(ValueError, match="not rows of K = 5"):
        torch.ops.torch_qmm._cpu_threads(torch.zeros(2, 3), 8, 5)


def spans_of(M, N, K):
    bounds = torch.ops.torch_qmm._cpu_spans(torch.zeros(M, K), N, K)
    return list(zip(bounds[0::2], bounds[1::2]))


def runs(spans):
    """[(rows, how many spans in a row of that size)], in order."""
    out = []
    for n0, n1 in spans:
        if out and out[-1][0] == n1 - n0:
            out[-1][1] += 1
        else:
            out.append([n1 - n0, 1])
    return [tuple(r) for r in out]


@pytest.mark.parametrize("M,N,K,pool,expected", [
    # The benchmark's shape: spans of 128 W rows, the last 256 rows in spans of 16.
    (1, 4096, 14336, 2, [(128, 30), (16, 16)]),
    # One thread has nobody to wait for: spans of 128 to the end.
    (1, 4096, 14336, 1, [(128, 32)]),
    # 600 rows on two threads: 72-row spans (every thread has at least 4), 144 rows left in 16s.
    (6, 600, 1024, 2, [(72, 7), (16, 6)]),
    # Rows not a multiple of 16: the last span is short.
    (64, 20, 4096, 2, [(16, 1), (4, 1)]),
    # Sixteen threads: spans of 64 rows, the last 16 * 64 in spans of 16.
    (16, 4096, 4096, 16, [(64, 48), (16, 64)]),
])
def test_spans_shrink_to_16_rows_for_the_last_span_per_thread(threads, M, N, K, pool, expected):
    threads(pool)
    spans = spans_of(M, N, K)
    assert runs(spans) == expected
    assert spans[0][0] == 0 and spans[-1][1] == N
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # every row once, in order
