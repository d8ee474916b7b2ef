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
