"""selftest's verdicts can fail: a case whose kernel returns a result one ulp off, or that ran
another route than planned, or a gather_qmm case that multiplies a pair by the wrong expert,
is reported as failed (torch_qmm/selftest.py). Each test runs the
real case once unchanged (it must pass) and once with the op's result perturbed."""

from __future__ import annotations

import contextlib

import pytest
import torch

import torch_qmm.metalsim_backend as metalsim_backend
import torch_qmm.ops as ops
from torch_qmm import selftest


def _one_case(**kw) -> selftest.Case:
    found = selftest.cases(**kw)
    assert found, kw
    return found[0]


def _next_up(t: torch.Tensor) -> torch.Tensor:
    """t with its first element moved one ulp up (towards +inf), in t's dtype."""
    out = t.clone()
    flat = out.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=t.dtype))
    return out


def test_affine_quantize_case_checks_every_output(monkeypatch):
    case = dict(bits=(4,), group_sizes=(64,), dtypes=("float32",), routes={"quantize"}, modes={"affine"})
    assert selftest.run_case(_one_case(**case), selftest._Runner("cpu"), seed=0).ok
    real = ops.quantize
    for which in range(3):  # wq, scales, biases
        def wrong(*args, which=which, **kwargs):
            got = list(real(*args, **kwargs))
            got[which] = (got[which].view(torch.int32) ^ 1).view(torch.uint32) if which == 0 else _next_up(got[which])
            return tuple(got)

        monkeypatch.setattr(ops, "quantize", wrong)
        c = selftest.run_case(_one_case(**case), selftest._Runner("cpu"), seed=0)
        assert not c.ok and "bit-exact" in c.error, (which, c.error)


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_fp_dequantize_case_requires_bit_exact(monkeypatch, mode):
    case = dict(dtypes=("float16",), routes={"dequantize"}, modes={mode})
    assert selftest.run_case(_one_case(**case), selftest._Runner("cpu"), seed=0).ok
    real = ops.dequantize
    monkeypatch.setattr(ops, "dequantize", lambda *a, **k: _next_up(real(*a, **k)))
    c = selftest.run_case(_one_case(**case), selftest._Runner("cpu"), seed=0)
    assert not c.ok and "bit-exact" in c.error, c.error


def test_metalsim_case_refuses_another_route(monkeypatch):
    """The runner compares the route that ran (metalsim's launch record) with the planned one; here
    the op runs on the CPU and the launch record names a different route."""
    case = _one_case(bits=(4,), group_sizes=(64,), dtypes=("float32",), routes={"qmv_fast"}, modes={"affine"})

    def launched(route):
        return [metalsim_backend.Launch(kernel="k", route=route, threadgroups=(1, 1, 1),
                                        threads_per_threadgroup=(1, 1, 1), buffers={}, tile=(0, 0), stats=None)]

    monkeypatch.setattr(metalsim_backend, "backend", lambda check=None: contextlib.nullcontext())
    monkeypatch.setattr(metalsim_backend, "last_launches", lambda: launched(case.route))
    assert selftest.run_case(case, selftest._Runner("metalsim"), seed=0).ok
    monkeypatch.setattr(metalsim_backend, "last_launches", lambda: launched("qmv_bounded"))
    c = selftest.run_case(_one_case(bits=(4,), group_sizes=(64,), dtypes=("float32",), routes={"qmv_fast"},
                                    modes={"affine"}), selftest._Runner("metalsim"), seed=0)
    assert not c.ok and "ran route(s) ['qmv_bounded']" in c.error, c.error


@pytest.mark.parametrize("route", ["gather_qmv", "gather_qmm_mma32", "gather_qmm_n_mma32"])
def test_gather_case_fails_when_a_pair_takes_another_expert(monkeypatch, route):
    """The reference multiplies each pair by its own expert: the op given the experts in reverse
    order (still valid indices, every expert repeated in the patterns) must fail the case."""
    case = dict(bits=(4,), group_sizes=(64,), dtypes=("float16",), routes={route}, modes={"affine"})
    assert selftest.run_case(_one_case(**case), selftest._Runner("cpu"), seed=0).ok
    real = ops.gather_qmm
    monkeypatch.setattr(ops, "gather_qmm", lambda x, w, s, b, lhs, rhs, **k: real(x, w, s, b, lhs, rhs.flip(0), **k))
    c = selftest.run_case(_one_case(**case), selftest._Runner("cpu"), seed=0)
    assert not c.ok and "exceeds the float16 tolerance" in c.error, c.error
