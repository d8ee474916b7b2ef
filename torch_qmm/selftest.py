"""`python -m torch_qmm selftest`: every kernel route on small shapes against the float64 reference.

    python -m torch_qmm selftest                          # mps when present, else cpu
    python -m torch_qmm selftest --device mps --json selftest.json   # the first run on a Mac
    python -m torch_qmm selftest --device metalsim        # the Metal kernels on metalsim (clang-19)
    python -m torch_qmm selftest --bits 4 --group-sizes 64 --dtypes float16   # a smaller run
    python -m torch_qmm selftest --device metalsim --bits 4 --group-sizes 64 --dtypes float16

The full set is every combination below: minutes on cpu and longer on metalsim (which emulates
every GPU thread); --bits / --group-sizes / --dtypes / --routes narrow it.

Cases: each row of the planner's routing table (torch.ops.torch_qmm._routes, csrc/plan.cpp) x
each mode it serves (affine: x bits x group size; the fp modes mxfp4, nvfp4, ...: their one cell)
x dtype (qmm, quantize, dequantize, gather_qmm), and each GGUF route x native type
x dtype, on an aligned shape (dimensions multiples of every tile and K-block) and an unaligned
one (odd N or K, partial tiles) where the route takes it; M for a route is found by asking the
planner, so a new route gets cases without editing this file, and a route no probe shape
reaches is reported as a failed case. gather_qmm's problems are index patterns (GATHER_PATTERNS:
decode tokens of k experts unsorted, prefill rows sorted by expert, experts repeated), tried in
order on each shape until the planner (_plan_gather) sends one to the route; the reference is one
float64 product x[lhs[p]] @ W[rhs[p]] per pair. Weights are made by the float64 oracles
(torch_qmm/reference.py, reference_fp.py for the fp modes), GGUF blocks decoded by the gguf
package; qmm and gather_qmm results must meet torch_qmm/tolerance.py's rule, quantize must equal
the reference bit for bit, and dequantize too (affine: MLX's rounding, reference.dequantize_rounded).
The rule's precision is "highest" except for CPU qmm calls that take the bfloat16 GEMM route
("gemm-bf16", csrc/cpu/bf16_gemm.h: w rounded to bfloat16), held to precision "medium"; each case
reports the precision it was checked at.

Prints one row per case, writes a JSON report (--json: `cases` with route, kernel, shapes, ok,
error, max error and bound, gather_qmm's E, pattern and indices; `environment`), exits 1 if any
case failed, 2 if the device is missing. The kernel recorded is the one that ran: metalsim's
launch, the CPU route on cpu; on mps the planner's kernel (what the MPS executor launches for
that plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from . import reference
from .tolerance import error_bound, route_precision

DESCRIPTION = __doc__  # the --help text
DEVICES = ("mps", "metalsim", "cpu")
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Probe M values: the aligned shapes take whole tiles (powers of two), the unaligned ones the
# smallest M of a route (its partial row tile). The first M the planner sends to a route is used.
ALIGNED_MS = (1, 2, 4, 8, 16, 32, 64)
UNALIGNED_MS = (1, 2, 3, 5, 7, 9, 13, 17, 33)
# Aligned: N and K multiples of every tile width (8, 32), K-block (qmv: 256 or 512) and group size.
ALIGNED_NK = (128, 512)
GGUF_UNALIGNED_NK = (37, 768)  # odd N; K = 3 super-blocks (loop tails of the lane teams)
# gather_qmm index patterns: name -> (M rows per pair, x batch, experts E, rhs, lhs, sorted_indices).
GATHER_PATTERNS = {
    # 3 tokens x k = 2 of E = 5, unsorted; expert 3 in two tokens, token 2 picks expert 3 twice.
    "decode-k2-unsorted": (1, 3, 5, [3, 1, 1, 4, 3, 3], [0, 0, 1, 1, 2, 2], False),
    # 20 tokens x k = 2 of E = 3, the pairs sorted by expert (>= 4 rows each); runs cross a 32-row tile.
    "prefill-k2-sorted": (1, 20, 3, [0] * 5 + [1] * 30 + [2] * 5, [(7 * i) % 20 for i in range(40)], True),
}

_ops = torch.ops.torch_qmm


@dataclasses.dataclass
class Case:
    op: str  # qmm | quantize | dequantize | gguf_qmm | gather_qmm
    route: str  # the routing-table row the shape was chosen to reach
    variant: str  # aligned | unaligned
    M: int
    N: int
    K: int
    dtype: str
    bits: Optional[int] = None
    group_size: Optional[int] = None
    transpose: Optional[bool] = None
    ggml_type: Optional[str] = None
    mode: str = "affine"  # quantization mode (MLX's name) of qmm / quantize / dequantize / gather_qmm
    pattern: Optional[str] = None  # gather_qmm: the GATHER_PATTERNS entry (M is rows per pair)
    E: Optional[int] = None  # gather_qmm: experts (stacked W matrices)
    x_batch: Optional[int] = None  # gather_qmm: x is [x_batch, M, K]
    rhs: Optional[list] = None  # gather_qmm: the expert of each pair
    lhs: Optional[list] = None  # gather_qmm: the x batch of each pair
    sorted_indices: Optional[bool] = None
    planned_kernel: str = ""  # what the planner names for this problem
    kernel: str = ""  # what ran (see module doc)
    ok: bool = False
    error: Optional[str] = None
    max_error: Optional[float] = None  # max |result - reference|
    bound: Optional[float] = None  # the allowed error at the worst element (max error / bound ratio)
    worst_ratio: Optional[float] = None  # max |error| / bound over elements (<= 1 passes)
    precision: Optional[str] = None  # the tolerance rule's precision (tolerance.py X_RTOL) the result was held to
    seconds: float = 0.0

    def label(self) -> str:
        if self.op == "gguf_qmm":
            return f"{self.ggml_type} {self.dtype}"
        t = "" if self.transpose is None else (" T" if self.transpose else " N")
        mode = "" if self.mode == "affine" else f"{self.mode} "
        gather = "" if self.pattern is None else f" {self.pattern} E{self.E}"
        return f"{mode}b{self.bits} gs{self.group_size} {self.dtype}{t}{gather}"


# ---- which cases ----------------------------------------------------------------------------------

def _plan_route(op: str, M: int, N: int, K: int, bits: int, gs: int, dtype, transpose: bool,
                mode: str = "affine") -> tuple[str, str]:
    (launch,) = json.loads(_ops._plan(op, M, N, K, bits, gs, dtype, transpose, mode))
    return launch["route"], launch["kernel"]


def _gather_plan_route(pattern: str, N: int, K: int, bits: int, gs: int, dtype, transpose: bool,
                       mode: str) -> tuple[str, str]:
    M, x_batch, E, rhs, _, is_sorted = GATHER_PATTERNS[pattern]
    (launch,) = json.loads(_ops._plan_gather(M, N, K, len(rhs), E, x_batch, bits, gs, dtype, transpose, is_sorted,
                                             mode))
    return launch["route"], launch["kernel"]


def _gather_probes(fields: dict) -> list:
    """_reach's probes for a gather_qmm cell (fields: op, dtype, bits, group_size, mode): each
    pattern, in order, on each of qmm's shapes, M the pattern's."""
    b, gs, d, mode = fields["bits"], fields["group_size"], DTYPES[fields["dtype"]], fields["mode"]
    probes = []
    for v, transpose, N, K, _ in _affine_probes("qmm", gs):
        for name, (M, x_batch, E, rhs, lhs, is_sorted) in GATHER_PATTERNS.items():
            plan = lambda M, N, K, p=name, t=transpose: _gather_plan_route(p, N, K, b, gs, d, t, mode)
            probes.append((v, N, K, (M,), plan, fields | dict(transpose=transpose, pattern=name, E=E, x_batch=x_batch,
                                                              rhs=rhs, lhs=lhs, sorted_indices=is_sorted)))
    return probes


def _gguf_plan_route(M: int, N: int, K: int, ggml_type: int, dtype) -> tuple[str, str]:
    (launch,) = json.loads(_ops._plan_gguf(M, N, K, ggml_type, dtype))
    return launch["route"], launch["kernel"]


def _affine_probes(op: str, gs: int) -> list[tuple[str, bool, int, int, tuple]]:
    """(variant, transpose, N, K, Ms) shapes to try: transpose=True quantizes along K (any N),
    transpose=False along N (any K); quantize/dequantize have rows N and columns K."""
    aligned_n, aligned_k = ALIGNED_NK
    probes = [("aligned", True, aligned_n, aligned_k, ALIGNED_MS), ("unaligned", True, 37, 3 * gs, UNALIGNED_MS)]
    if op == "qmm":
        probes += [("aligned", False, aligned_n, aligned_k, ALIGNED_MS),
                   ("unaligned", False, 3 * gs, 45, UNALIGNED_MS)]
    return probes


def native_gguf_types() -> dict[str, int]:
    """GGUF types with Metal/CPU kernels of their own (the planner accepts them): name -> ggml type."""
    from gguf import GGMLQuantizationType

    found = {}
    for t in GGMLQuantizationType:
        try:
            _ops._plan_gguf(1, 8, 256, int(t), torch.float32)
        except (ValueError, RuntimeError):
            continue
        found[t.name] = int(t)
    return found


def _mode_cells(mode: str, bits, group_sizes) -> list[tuple[int, int]]:
    """(bits, group size) cells of a mode: the requested ones for affine; the fp modes have one."""
    if mode == "affine":
        return [(b, gs) for b in bits for gs in group_sizes]
    from .reference_fp import MODES

    return [(MODES[mode].bits, MODES[mode].group_size)]


def cases(bits=BITS, group_sizes=GROUP_SIZES, dtypes=tuple(DTYPES), routes: Optional[set] = None,
          gguf_types: Optional[set] = None, modes: Optional[set] = None) -> list[Case]:
    """Every route x format it serves (the routing table's `formats`) x cell x dtype."""
    table = json.loads(_ops._routes())
    out: list[Case] = []
    for r in table:
        route, op = r["route"], r["op"]
        if routes is not None and route not in routes:
            continue
        if op == "gguf_qmm":
            for tname, tid in native_gguf_types().items():
                if gguf_types is not None and tname not in gguf_types:
                    continue
                for dname in dtypes:
                    out += _reach(route, [
                        (v, N, K, Ms, lambda M, N, K, d=DTYPES[dname], t=tid: _gguf_plan_route(M, N, K, t, d),
                         dict(op=op, dtype=dname, ggml_type=tname))
                        for v, (N, K), Ms in (("aligned", ALIGNED_NK, ALIGNED_MS),
                                               ("unaligned", GGUF_UNALIGNED_NK, UNALIGNED_MS))])
            continue
        from .formats import FORMATS

        for mode in r["formats"]:
            # A mode the planner serves but the op layer's format table does not list yet has no op.
            if (modes is not None and mode not in modes) or mode not in FORMATS:
                continue
            for b, gs in _mode_cells(mode, bits, group_sizes):
                for dname in dtypes:
                    if op == "gather_qmm":
                        out += _reach(route, _gather_probes(dict(op=op, dtype=dname, bits=b, group_size=gs, mode=mode)))
                        continue
                    probes = []
                    for v, transpose, N, K, Ms in _affine_probes(op, gs):
                        plan = (lambda M, N, K, t=transpose, d=DTYPES[dname], b=b, gs=gs, mode=mode:
                                _plan_route(op, M, N, K, b, gs, d, t, mode))
                        probes.append((v, N, K, Ms if op == "qmm" else (0,), plan,
                                       dict(op=op, dtype=dname, bits=b, group_size=gs, mode=mode,
                                            transpose=transpose if op == "qmm" else None)))
                    out += _reach(route, probes)
    return out


def _reach(route: str, probes: list) -> list[Case]:
    """One case per variant: the first probe shape and M the planner sends to `route`."""
    found: dict[str, Case] = {}
    for variant, N, K, Ms, plan, fields in probes:
        if variant in found:
            continue
        for M in Ms:
            got, kernel = plan(M, N, K)
            if got == route:
                found[variant] = Case(route=route, variant=variant, M=M, N=N, K=K, planned_kernel=kernel, **fields)
                break
    if not found:
        fields = probes[0][-1] if probes else {}
        c = Case(route=route, variant="-", M=0, N=0, K=0, **({"op": "?", "dtype": "?"} | fields))
        c.error = f"no probe shape reaches route {route} (selftest's probe shapes need one for it)"
        return [c]
    return list(found.values())


# ---- running one case -------------------------------------------------------------------------------

def _weights(rows: int, cols: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random rows of different scales, plus the groups that stress quantization (constant, zero,
    one dominant negative extreme, a single non-zero value)."""
    w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * (0.5 + torch.rand(rows, 1, generator=gen,
                                                                                          dtype=torch.float64))
    if rows >= 4 and cols >= 32:
        w[0, :32] = 0.75
        w[1, :32] = 0.0
        w[2, :32] = torch.linspace(-5.0, 1.0, 32, dtype=torch.float64)
        w[3, :32] = 0.0
        w[3, 7] = -2.5
    return w.to(dtype)


def _compare(case: Case, y: torch.Tensor, y_ref: torch.Tensor, magnitude: torch.Tensor, dtype) -> None:
    if y.dtype != dtype or tuple(y.shape) != tuple(y_ref.shape):
        raise AssertionError(f"result {y.dtype} {tuple(y.shape)}, expected {dtype} {tuple(y_ref.shape)}")
    case.precision = route_precision(case.kernel)
    err = (y.detach().cpu().to(torch.float64) - y_ref).abs()
    bound = error_bound(y_ref, magnitude, dtype, case.precision)
    ratio = err / bound
    case.max_error = err.max().item() if err.numel() else 0.0
    if err.numel():
        worst = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
        case.worst_ratio = ratio.reshape(-1)[worst].item()
        case.bound = bound.reshape(-1)[worst].item()
    else:
        case.worst_ratio, case.bound = 0.0, 0.0
    case.ok = bool(torch.isfinite(y.detach().cpu().float()).all()) and case.worst_ratio <= 1.0
    if not case.ok:
        case.error = (f"error {case.max_error:.3e} exceeds the {case.dtype} tolerance at precision "
                      f"{case.precision!r} (worst error/bound {case.worst_ratio:.3g})")


class _Runner:
    """Moves inputs to the device, runs an op, says which kernel ran."""

    def __init__(self, device: str, check: bool = False):
        self.device = device
        self.check = check

    def run(self, case: Case, call: Callable[[], object], cpu_route: Callable[[], str]):
        if self.device == "metalsim":
            from .metalsim_backend import backend, last_launches

            with backend(check=self.check):
                out = call()
            launches = last_launches()
            case.kernel = ",".join(l.kernel for l in launches)
            ran = [l.route for l in launches]
            if ran != [case.route]:
                raise AssertionError(f"ran route(s) {ran}, the case was planned for {case.route}")
            return out
        out = call()
        if self.device == "mps":
            torch.mps.synchronize()
            case.kernel = case.planned_kernel
        else:
            case.kernel = cpu_route()
        return out

    def to(self, *tensors):
        target = "cpu" if self.device == "metalsim" else self.device
        return [t.to(target) for t in tensors]


def run_case(case: Case, runner: _Runner, seed: int) -> Case:
    from .ops import dequantize, gguf_matmul, quantize, quantized_matmul

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES.get(case.dtype)
    try:
        if case.error is not None:
            return case
        if case.op == "gguf_qmm":
            _run_gguf(case, runner, gen, dtype, gguf_matmul)
        elif case.op == "gather_qmm":
            _run_gather(case, runner, gen, dtype)
        elif case.mode != "affine":
            _run_fp(case, runner, gen, dtype)
        elif case.op == "quantize":
            w = _weights(case.N, case.K, dtype, gen)
            want = reference.quantize(w, case.bits, case.group_size)
            (wd,) = runner.to(w)
            got = runner.run(case, lambda: quantize(wd, group_size=case.group_size, bits=case.bits), lambda: "cpu quantize")
            got = [t.cpu() for t in got]
            same = (torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
                    and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]))
            w_got = reference.dequantize(*got, case.bits, case.group_size)
            w_want = reference.dequantize(*want, case.bits, case.group_size)
            case.max_error, case.bound, case.worst_ratio = (w_got - w_want).abs().max().item(), 0.0, None
            case.ok = same
            if not same:
                case.error = "quantize differs from reference.quantize (must be bit-exact)"
        else:
            rows, cols = (case.N, case.K) if case.transpose in (None, True) else (case.K, case.N)
            wq, s, b = reference.quantize(_weights(rows, cols, dtype, gen), case.bits, case.group_size)
            if case.op == "dequantize":
                want = reference.dequantize_rounded(wq, s, b, case.bits, case.group_size)
                dev = runner.to(wq, s, b)
                got = runner.run(case, lambda: dequantize(*dev, group_size=case.group_size, bits=case.bits),
                                 lambda: "cpu dequantize").cpu()
                case.ok = got.dtype == want.dtype and torch.equal(got, want)
                if case.ok:
                    case.max_error, case.bound = 0.0, 0.0  # bit-exact with MLX's rounding: no tolerance
                else:
                    case.error = "dequantize differs from reference.dequantize_rounded (must be bit-exact)"
            else:
                x = torch.randn(case.M, case.K, generator=gen).to(dtype)
                y_ref = reference.qmm(x, wq, s, b, case.bits, case.group_size, case.transpose)
                magnitude = reference.qmm_magnitude(x, wq, s, b, case.bits, case.group_size, case.transpose)
                dev = runner.to(x, wq, s, b)
                y = runner.run(case, lambda: quantized_matmul(*dev, transpose=case.transpose, group_size=case.group_size,
                                                              bits=case.bits),
                               lambda: _ops._cpu_route(x, wq, s, b, case.bits, case.group_size, case.transpose))
                _compare(case, y.cpu(), y_ref, magnitude, dtype)
    except Exception as e:  # a failing kernel is a result, not the end of the run
        case.ok = False
        text = str(e).strip()
        case.error = f"{type(e).__name__}: {text.splitlines()[0] if text else repr(e)}"
    finally:
        case.seconds = round(time.perf_counter() - t0, 4)
    return case


def _run_fp(case: Case, runner: _Runner, gen, dtype) -> None:
    """An fp-mode case (mxfp4, nvfp4, ...) against torch_qmm/reference_fp.py: quantize and
    dequantize bit for bit, qmm within the tolerance rule."""
    from . import reference_fp
    from .ops import dequantize, quantize, quantized_matmul

    mode = case.mode
    rows, cols = (case.N, case.K) if case.transpose in (None, True) else (case.K, case.N)
    w = _weights(rows, cols, dtype, gen)
    wq, s = reference_fp.quantize_fp(w, mode)
    if case.op == "quantize":
        (wd,) = runner.to(w)
        got = [t.cpu() for t in runner.run(case, lambda: quantize(wd, mode=mode), lambda: "cpu quantize")]
        case.ok = len(got) == 2 and torch.equal(got[0].view(torch.int32), wq.view(torch.int32)) and torch.equal(got[1], s)
        if case.ok:
            case.max_error, case.bound = 0.0, 0.0
        else:
            case.error = "quantize differs from reference_fp.quantize_fp (must be bit-exact)"
    elif case.op == "dequantize":
        want = reference_fp.dequantize_fp(wq, s, mode, dtype=dtype)
        dev = runner.to(wq, s)
        got = runner.run(case, lambda: dequantize(*dev, mode=mode, dtype=dtype), lambda: "cpu dequantize").cpu()
        case.ok = got.dtype == dtype and torch.equal(got, want)
        if case.ok:
            case.max_error, case.bound = 0.0, 0.0  # bit-exact is the requirement: no tolerance
        else:
            case.error = "dequantize differs from reference_fp.dequantize_fp (must be bit-exact)"
    else:
        x = torch.randn(case.M, case.K, generator=gen).to(dtype)
        y_ref = reference_fp.qmm_fp(x, wq, s, mode, transpose=case.transpose)
        magnitude = reference_fp.qmm_fp_magnitude(x, wq, s, mode, transpose=case.transpose)
        dev = runner.to(x, wq, s)
        y = runner.run(case, lambda: quantized_matmul(dev[0], dev[1], dev[2], None, transpose=case.transpose, mode=mode),
                       lambda: _ops._cpu_route(x, wq, s, None, case.bits, case.group_size, case.transpose, mode))
        _compare(case, y.cpu(), y_ref, magnitude, dtype)


def _run_gather(case: Case, runner: _Runner, gen, dtype) -> None:
    """A gather_qmm case: each expert quantized by the oracle, y[p] against the float64 product
    x[lhs[p]] @ W[rhs[p]] of reference.qmm / reference_fp.qmm_fp, pair by pair."""
    from . import reference_fp
    from .ops import gather_qmm

    rows, cols = (case.N, case.K) if case.transpose else (case.K, case.N)
    affine = case.mode == "affine"
    experts = [reference.quantize(w, case.bits, case.group_size) if affine else reference_fp.quantize_fp(w, case.mode)
               for w in (_weights(rows, cols, dtype, gen) for _ in range(case.E))]
    x = torch.randn(case.x_batch, case.M, case.K, generator=gen).to(dtype)
    refs = []
    for i, e in zip(case.lhs, case.rhs):
        if affine:
            args = (x[i], *experts[e], case.bits, case.group_size, case.transpose)
            refs.append((reference.qmm(*args), reference.qmm_magnitude(*args)))
        else:
            args = (x[i], *experts[e], case.mode)
            refs.append((reference_fp.qmm_fp(*args, transpose=case.transpose),
                         reference_fp.qmm_fp_magnitude(*args, transpose=case.transpose)))
    w = [torch.stack(t) for t in zip(*experts)] + ([] if affine else [None])
    lhs, rhs = (torch.tensor(t, dtype=torch.int32) for t in (case.lhs, case.rhs))
    x_d, wq_d, s_d, lhs_d, rhs_d = runner.to(x, w[0], w[1], lhs, rhs)
    b_d = None if w[2] is None else runner.to(w[2])[0]
    y = runner.run(case, lambda: gather_qmm(x_d, wq_d, s_d, b_d, lhs_d, rhs_d, transpose=case.transpose,
                                            group_size=case.group_size, bits=case.bits, mode=case.mode,
                                            sorted_indices=case.sorted_indices),
                   lambda: _gather_cpu_route(case, x, w))
    _compare(case, y.cpu(), torch.stack([r[0] for r in refs]), torch.stack([r[1] for r in refs]), dtype)


def _gather_cpu_route(case: Case, x: torch.Tensor, w: list) -> str:
    """"cpu gather_qmm <route>": the CPU qmm route of the matrix with the most pairs (gather_qmm
    runs each matrix's rows through qmm's route for that many rows)."""
    e = max(set(case.rhs), key=case.rhs.count)
    rows = torch.cat([x[i] for i, r in zip(case.lhs, case.rhs) if r == e])
    route = torch.ops.torch_qmm._cpu_route(rows, w[0][e], w[1][e], None if w[2] is None else w[2][e], case.bits,
                                           case.group_size, case.transpose, case.mode)
    return f"cpu gather_qmm {route}"


def _run_gguf(case: Case, runner: _Runner, gen, dtype, gguf_matmul) -> None:
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from .bench.kernels import random_gguf_blocks

    tid = int(GGMLQuantizationType[case.ggml_type])
    blocks = random_gguf_blocks(case.N, case.K, case.ggml_type, "cpu", gen)
    w = torch.from_numpy(gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType(tid))).double()
    x = torch.randn(case.M, case.K, generator=gen).to(dtype)
    xd = x.double()
    xs, bs = runner.to(x, blocks)
    y = runner.run(case, lambda: gguf_matmul(xs, bs, tid, case.N, case.K),
                   lambda: _ops._gguf_cpu_route(x, blocks, tid, case.N, case.K))
    _compare(case, y.cpu(), xd @ w.T, xd.abs() @ w.abs().T, dtype)


# ---- report -------------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    from .bench.report import git_commit

    env = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "macos": platform.mac_ver()[0] or None,
        "machine": platform.machine(),
        "processor": _processor(),
        "mps_available": torch.backends.mps.is_available(),
        "mps_built": torch.backends.mps.is_built(),
        "commit": git_commit(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "argv": sys.argv[1:],
    }
    if device == "metalsim":
        from .metalsim import _build

        try:
            env["clang"] = _build.find_clang()
        except RuntimeError as e:
            env["clang"] = str(e)
    return env


def _processor() -> str:
    if sys.platform == "darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
            if out:
                return out  # "Apple M2 Pro": names the GPU generation too
        except (OSError, subprocess.SubprocessError):
            pass
    from .bench.report import _cpu_name

    return _cpu_name()


def format_row(c: Case) -> list[str]:
    ratio = "-" if c.worst_ratio is None else f"{c.worst_ratio:.3f}"
    return [c.route, c.variant, c.label(), f"{c.M}x{c.N}x{c.K}", c.kernel or c.planned_kernel or "-",
            f"{c.max_error:.2e}" if c.max_error is not None else "-", ratio, c.precision or "-",
            "ok" if c.ok else "FAIL"]


def device_problem(device: str) -> Optional[str]:
    """Why `device` cannot run here, or None."""
    if device == "mps" and not torch.backends.mps.is_available():
        return ("--device mps: torch.backends.mps.is_available() is False (needs Apple silicon, macOS 14+, a torch "
                f"built with MPS; this torch {torch.__version__} on {platform.system()} {platform.machine()})")
    if device == "metalsim":
        from .metalsim import _build

        if platform.machine() not in ("x86_64", "AMD64"):
            return f"--device metalsim: metalsim runs on x86-64 only (this machine: {platform.machine()})"
        try:
            _build.find_clang()
        except RuntimeError as e:
            return f"--device metalsim: {e}"
    return None


def _csv(kind, choices):
    def parse(text: str):
        items = [kind(t) for t in text.split(",") if t.strip()]
        bad = [i for i in items if i not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {list(choices)}, got {text!r}")
        return tuple(items)

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    default = "mps" if torch.backends.mps.is_available() else "cpu"
    p.add_argument("--device", choices=DEVICES, default=default,
                   help=f"mps (our Metal kernels on the GPU), metalsim (the same kernels on the emulator), cpu "
                        f"(the C++ kernels); default here: {default}")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the report (cases + environment) to FILE")
    p.add_argument("--bits", type=_csv(int, BITS), default=BITS, help="e.g. 4,8 (default: all)")
    p.add_argument("--group-sizes", type=_csv(int, GROUP_SIZES), default=GROUP_SIZES, help="e.g. 64 (default: all)")
    p.add_argument("--dtypes", type=_csv(str, tuple(DTYPES)), default=tuple(DTYPES), help="e.g. float16,bfloat16 (default: all)")
    p.add_argument("--modes", type=lambda t: set(t.split(",")), default=None,
                   help="quantization modes to run, e.g. affine,mxfp4 (default: every mode a route serves)")
    p.add_argument("--routes", type=lambda t: set(t.split(",")), default=None,
                   help="routing-table rows to run (default: all; names: torch.ops.torch_qmm._routes())")
    p.add_argument("--check", action="store_true", help="metalsim only: checked mode (out-of-bounds, races, ...)")
    p.add_argument("--failures-only", action="store_true", help="print only the failed cases")


def run(args: argparse.Namespace) -> int:
    problem = device_problem(args.device)
    if problem:
        print(f"selftest: {problem}", file=sys.stderr)
        return 2
    if args.check and args.device != "metalsim":
        print("selftest: --check is for --device metalsim", file=sys.stderr)
        return 2
    if args.json is not None and args.json.is_dir():  # found before the run, not when its report is written
        print(f"selftest: --json {args.json} is a folder; give the report's file name "
              f"(e.g. {args.json / 'selftest.json'})", file=sys.stderr)
        return 2
    if args.routes is not None:
        known = {r["route"] for r in json.loads(_ops._routes())}
        if args.routes - known:
            print(f"selftest: --routes: unknown {sorted(args.routes - known)}; routes are {sorted(known)}",
                  file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    todo = cases(args.bits, args.group_sizes, args.dtypes, args.routes, modes=args.modes)
    runner = _Runner(args.device, check=args.check)
    rows = [["route", "shape", "cell", "MxNxK", "kernel", "max err", "err/bound", "precision", ""]]
    done = []
    for i, case in enumerate(todo):
        done.append(run_case(case, runner, seed=i))
        if not (args.failures_only and case.ok):
            rows.append(format_row(case))
    from .bench.report import text_table

    failed = [c for c in done if not c.ok]
    seconds = time.perf_counter() - t0
    if len(rows) > 1:
        print(text_table(rows, "err/bound: worst |error| / allowed error (torch_qmm/tolerance.py) at the float32 "
                               "matmul precision shown (\"medium\": the CPU bfloat16 GEMM route); <= 1 passes"))
    for c in failed:
        print(f"FAIL {c.route} {c.variant} {c.label()} M={c.M} N={c.N} K={c.K}: {c.error}")
    print(f"selftest on {args.device}: {len(done)} cases, {len(failed)} failed, {seconds:.1f} s")
    if args.json:
        doc = {"environment": environment(args.device),
               "summary": {"cases": len(done), "failed": len(failed), "seconds": round(seconds, 2)},
               "cases": [dataclasses.asdict(c) for c in done]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"report: {args.json}")
    return 1 if failed else 0
