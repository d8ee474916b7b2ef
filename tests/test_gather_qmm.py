"""gather_qmm (mlx.core.gather_qmm) on CPU: values against the float64 reference (each expert
dequantized in float64 by torch_qmm/reference.py or reference_fp.py, the pairs gathered here) with
the tolerance of tests/tolerance.py, and against mlx[cpu]'s gather_qmm on the same packed weights;
index broadcasting and shapes against MLX; sorted_indices; index dtypes; autograd in x; opcheck;
torch.compile without recompiles as the token count changes; and a clear error for every argument.

Tolerances (tests/tolerance.py, per dtype): y is the float32 sum rounded once to x's dtype, so
|y - y_ref| <= u * |y_ref| + (1 + u) * 2e-5 * sum|x w| + atol with u = 2^-24 (float32), 2^-11
(float16), 2^-8 (bfloat16). MLX's own result is held to the same rule with twice the room
(MLX_SLACK) for float32 x. For float16 / bfloat16 x MLX's CPU kernels round partial results to
x's dtype, so its rule is MLX_HALF_ULPS * u * (|y_ref| + sum|x w|) (measured: up to 4 on these
problems); a wrong expert for any pair is off by at least 19 such units here (bfloat16), 150
(float16). MLX's role is to pin the semantics (which pairs, which shapes), which a wrong index or
broadcast breaks by far more than any rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_qmm
from torch_qmm import reference, reference_fp
from torch_qmm.formats import FORMATS
from torch_qmm.tolerance import OUT_ATOL, OUT_RTOL, error_bound

from cpu_features import bf16_precision
from tolerance import assert_matches_reference

mx = pytest.importorskip("mlx.core")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
FP_MODES = tuple(m for m, f in FORMATS.items() if not f.has_biases)
# (mode, bits, group_size): affine at several bits and group sizes, every fp mode at its defaults.
CONFIGS = [("affine", 4, 64), ("affine", 2, 32), ("affine", 3, 128), ("affine", 8, 32), ("affine", 6, 64)] + [
    (m, FORMATS[m].default_bits, FORMATS[m].default_group_size) for m in FP_MODES
]
MLX_SLACK = 2.0
MLX_HALF_ULPS = 8.0


def to_mx(t: torch.Tensor):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    if t.dtype == torch.uint32:
        return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
    return mx.array(t.numpy())


def from_mx(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


class Experts:
    """E quantized matrices (MLX's layout: wq [E, rows, words]) and, per expert, the float64
    operator A [K, N] with y = x @ A and its magnitude |terms| [K, N] (reference.py / reference_fp.py
    applied to the identity), so the reference never calls the code under test's gather."""

    def __init__(self, E, N, K, mode, bits, group_size, dtype, transpose=True, seed=0):
        g = torch.Generator().manual_seed(seed)
        rows, cols = (N, K) if transpose else (K, N)
        w = torch.randn(E, rows, cols, generator=g).to(dtype)
        self.mode, self.bits, self.group_size, self.transpose = mode, bits, group_size, transpose
        packed = torch_qmm.quantize(w, group_size=group_size, bits=bits, mode=mode)
        self.wq, self.scales = packed[0], packed[1]
        self.biases = packed[2] if len(packed) == 3 else None
        eye = torch.eye(K, dtype=torch.float64)
        ops, mags = [], []
        for e in range(E):
            if mode == "affine":
                args = (self.wq[e], self.scales[e], self.biases[e], bits, group_size, transpose)
                ops.append(reference.qmm(eye, *args))
                mags.append(reference.qmm_magnitude(eye, *args))
            else:
                args = (self.wq[e], self.scales[e], mode, group_size, bits, transpose)
                ops.append(reference_fp.qmm_fp(eye, *args))
                mags.append(reference_fp.qmm_fp_magnitude(eye, *args))
        self.A, self.B = torch.stack(ops), torch.stack(mags)  # [E, K, N]

    def ours(self, x, lhs=None, rhs=None, sorted_indices=False):
        return torch_qmm.gather_qmm(x, self.wq, self.scales, self.biases, lhs, rhs, transpose=self.transpose,
                                    group_size=self.group_size, bits=self.bits, mode=self.mode,
                                    sorted_indices=sorted_indices)

    def mlx(self, x, lhs=None, rhs=None, sorted_indices=False):
        idx = lambda t: None if t is None else mx.array(t.numpy().astype(np.uint32))  # noqa: E731
        y = mx.gather_qmm(to_mx(x), to_mx(self.wq), to_mx(self.scales),
                          None if self.biases is None else to_mx(self.biases), idx(lhs), idx(rhs),
                          transpose=self.transpose, group_size=self.group_size, bits=self.bits, mode=self.mode,
                          sorted_indices=sorted_indices)
        return from_mx(y)

    def reference(self, x, lhs=None, rhs=None):
        """(y_ref, magnitude) in float64 by the gather_mm rule, written out here: flat indices into
        x's and W's batch dimensions (None: all), broadcast, one product per pair."""
        xb, wb = x.shape[:-2], self.A.shape[:-2]
        li = torch.arange(xb.numel()).reshape(xb) if lhs is None else lhs.long()
        ri = torch.arange(wb.numel()).reshape(wb) if rhs is None else rhs.long()
        li, ri = torch.broadcast_tensors(li, ri)
        xf = x.reshape(-1, *x.shape[-2:]).to(torch.float64)
        y = torch.stack([xf[a] @ self.A[b] for a, b in zip(li.reshape(-1).tolist(), ri.reshape(-1).tolist())])
        m = torch.stack([xf[a].abs() @ self.B[b] for a, b in zip(li.reshape(-1).tolist(), ri.reshape(-1).tolist())])
        shape = tuple(li.shape) + tuple(y.shape[-2:])
        return y.reshape(shape), m.reshape(shape)


def assert_mlx_agrees(theirs, y_ref, mag, dtype, what):
    """MLX's result within MLX_SLACK times our own tolerance of the float64 reference."""
    assert theirs.shape == y_ref.shape, f"{what}: MLX's shape {tuple(theirs.shape)} != {tuple(y_ref.shape)}"
    err = (theirs.to(torch.float64) - y_ref).abs()
    if dtype == torch.float32:
        bound, limit = error_bound(y_ref, mag, dtype), MLX_SLACK
    else:
        bound, limit = OUT_RTOL[dtype] * (y_ref.abs() + mag) + OUT_ATOL[dtype], MLX_HALF_ULPS
    ratio = (err / bound).max().item() if err.numel() else 0.0
    assert ratio <= limit, f"{what}: MLX is {ratio:.2f} bounds from the float64 reference (limit {limit})"


def gather_precision(x, rhs, bits, mode, transpose=True) -> str:
    """The tolerance precision of a CPU gather_qmm result: each matrix's rows go through qmm's route
    for that many rows (x rows per pair times its pairs), so "medium" where the largest group takes
    the bfloat16 GEMM (cpu_features), else "highest"."""
    rows = int(torch.bincount(rhs.reshape(-1).long()).max()) * x.shape[-2]
    return bf16_precision(rows, x.dtype, transpose, bits=bits, k=x.shape[-1], mode=mode)


def moe_indices(T, k, E, seed, sort=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if sort:  # MLX-LM's sorted path: flattened pairs sorted by expert
        idx = idx.reshape(-1).sort().values.reshape(T, k)
    return idx.to(torch.int32)


@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode,bits,group_size", CONFIGS, ids=lambda v: str(v))
def test_moe_decode_and_prefill_match_reference_and_mlx(mode, bits, group_size, dtype, transpose):
    """MLX-LM's SwitchGLU call: x [T, 1, 1, K], rhs [T, k] -> y [T, k, 1, N]; T=1 (decode, one row
    per expert: the chunk kernels) and T=24 top-3 of 4 experts (~18 rows per expert: the GEMM or
    fused route)."""
    E, N, K = 4, 128, 256
    ex = Experts(E, N, K, mode, bits, group_size, dtype, transpose)
    for T, k in ((1, 2), (24, 3)):
        x = torch.randn(T, 1, 1, K, generator=torch.Generator().manual_seed(T)).to(dtype)
        rhs = moe_indices(T, k, E, seed=T)
        y_ref, mag = ex.reference(x, rhs=rhs)
        what = f"{mode} {bits}/{group_size} {dtype} transpose={transpose} T={T}"
        assert_matches_reference(ex.ours(x, rhs=rhs), y_ref, mag, dtype, what, gather_precision(x, rhs, bits, mode, transpose))
        assert_mlx_agrees(ex.mlx(x, rhs=rhs), y_ref, mag, dtype, what)


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_rows_of_w_split_across_threads(mode):
    """N = 576 with one to three experts: the CPU kernel splits each expert's rows into slices
    (the last one shorter); every slice lands in its columns."""
    f = FORMATS[mode]
    ex = Experts(3, 576, 128, mode, f.default_bits, f.default_group_size, torch.bfloat16)
    for T, k in ((1, 1), (20, 1), (20, 3)):
        x = torch.randn(T, 1, 1, 128, generator=torch.Generator().manual_seed(T)).bfloat16()
        rhs = moe_indices(T, k, 3, seed=T)
        y_ref, mag = ex.reference(x, rhs=rhs)
        assert_matches_reference(ex.ours(x, rhs=rhs), y_ref, mag, torch.bfloat16, f"{mode} T={T} k={k}",
                                 gather_precision(x, rhs, ex.bits, mode))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_sorted_indices(mode, dtype):
    """sorted_indices=True with sorted indices matches MLX and the reference; with unsorted indices
    the flag is only a hint: the result is the same as without it."""
    f = FORMATS[mode]
    ex = Experts(8, 96, 128, mode, f.default_bits, f.default_group_size, dtype)
    x = torch.randn(16, 1, 1, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    rhs = moe_indices(16, 4, 8, seed=4, sort=True)
    y_ref, mag = ex.reference(x, rhs=rhs)
    y = ex.ours(x, rhs=rhs, sorted_indices=True)
    assert_matches_reference(y, y_ref, mag, dtype, f"{mode} sorted")
    assert_mlx_agrees(ex.mlx(x, rhs=rhs, sorted_indices=True), y_ref, mag, dtype, f"{mode} sorted")
    assert torch.equal(y, ex.ours(x, rhs=rhs))
    unsorted = moe_indices(16, 4, 8, seed=5)
    assert torch.equal(ex.ours(x, rhs=unsorted, sorted_indices=True), ex.ours(x, rhs=unsorted))


# (x batch shape, M, lhs shape or None, rhs shape or None); W has 4 experts.
BROADCASTS = [
    ((3,), 1, None, (3,)),
    ((3,), 1, None, (3, 1)),
    ((5, 1), 1, None, (5, 2)),
    ((), 2, None, (3,)),
    ((), 1, None, ()),
    ((3,), 2, (4,), (4,)),
    ((3,), 2, (4, 1), (3,)),
    ((2, 3), 2, (4,), (4,)),
    ((3,), 2, (4,), None),
    ((1,), 2, None, None),
    ((4,), 3, None, None),
    ((2, 1), 2, None, (2, 3)),
]


@pytest.mark.parametrize("case", BROADCASTS, ids=str)
def test_broadcasting_matches_mlx(case):
    xb, M, lhs_shape, rhs_shape = case
    E, N, K = 4, 32, 64
    ex = Experts(E, N, K, "affine", 4, 32, torch.float32)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*xb, M, K, generator=g)
    n_x = int(np.prod(xb)) if xb else 1
    lhs = None if lhs_shape is None else torch.randint(0, n_x, lhs_shape, generator=g, dtype=torch.int64)
    rhs = None if rhs_shape is None else torch.randint(0, E, rhs_shape, generator=g, dtype=torch.int64)
    y_ref, mag = ex.reference(x, lhs, rhs)
    assert_matches_reference(ex.ours(x, lhs, rhs), y_ref, mag, torch.float32, str(case))
    assert_mlx_agrees(ex.mlx(x, lhs, rhs), y_ref, mag, torch.float32, str(case))


def test_no_indices_with_2d_x_is_one_product_per_matrix():
    """Both indices None and x [M, K]: the broadcast product with every matrix ([E, M, N]). MLX
    hands this case to quantized_matmul, which multiplies by the first matrix only ([M, N])."""
    ex = Experts(3, 32, 64, "affine", 4, 64, torch.float32)
    x = torch.randn(2, 64)
    y_ref, mag = ex.reference(x)
    assert y_ref.shape == (3, 2, 32)
    assert_matches_reference(ex.ours(x), y_ref, mag, torch.float32, "2-D x, no indices")
    assert tuple(ex.mlx(x).shape) == (2, 32)


def test_broadcast_mismatch_matches_mlx_refusal():
    ex = Experts(4, 32, 64, "affine", 4, 32, torch.float32)
    x = torch.randn(3, 2, 64)
    with pytest.raises(ValueError):
        ex.mlx(x)
    with pytest.raises(ValueError, match=r"lhs_indices.*None: the batch shape of 'x'.*rhs_indices.*3 vs 4"):
        ex.ours(x)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64, torch.uint32], ids=str)
def test_index_dtypes_give_one_answer(index_dtype):
    ex = Experts(6, 64, 128, "affine", 4, 64, torch.float32)
    x = torch.randn(5, 1, 1, 128)
    rhs = moe_indices(5, 2, 6, seed=1)
    lhs = torch.tensor([[4], [3], [2], [1], [0]], dtype=torch.int64)
    y_ref, mag = ex.reference(x.reshape(5, 1, 128), lhs, rhs)
    y = ex.ours(x.reshape(5, 1, 128), lhs.to(index_dtype), rhs.to(index_dtype))
    assert_matches_reference(y, y_ref, mag, torch.float32, str(index_dtype))


def test_non_contiguous_x_and_empty_calls():
    ex = Experts(4, 32, 64, "affine", 4, 64, torch.float32)
    x = torch.randn(64, 3, 1).transpose(0, 2)  # [1, 3, 64], strided
    rhs = torch.tensor([2, 0, 3])
    y_ref, mag = ex.reference(x.reshape(3, 1, 64), rhs=rhs)
    assert_matches_reference(ex.ours(x.reshape(3, 1, 64), rhs=rhs), y_ref, mag, torch.float32, "strided")
    assert ex.ours(torch.randn(3, 0, 64), rhs=rhs).shape == (3, 0, 32)
    assert ex.ours(torch.randn(0, 1, 64), rhs=torch.zeros(0, dtype=torch.int32)).shape == (0, 1, 32)


@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
def test_gradient_in_x_matches_float64(transpose):
    ex = Experts(4, 64, 96, "affine", 4, 32, torch.float32, transpose)
    x = torch.randn(3, 2, 96, requires_grad=True)
    lhs = torch.tensor([[0], [2], [2]])
    rhs = torch.tensor([[1, 3], [0, 1], [3, 3]])
    dy = torch.randn(3, 2, 2, 64)
    torch_qmm.gather_qmm(x, ex.wq, ex.scales, ex.biases, lhs, rhs, transpose=transpose,
                         group_size=32, bits=4).backward(dy)
    x64 = x.detach().double().requires_grad_()
    li, ri = torch.broadcast_tensors(lhs, rhs)
    y64 = torch.stack([x64[a] @ ex.A[b] for a, b in zip(li.reshape(-1).tolist(), ri.reshape(-1).tolist())])
    y64.backward(dy.reshape(y64.shape).double())
    # within float32 accumulation of the terms dx adds: |dy| @ |W|.T per pair, summed per x row
    pairs = [(a, b) for a, b in zip(li.reshape(-1).tolist(), ri.reshape(-1).tolist())]
    mag = torch.zeros_like(x64)
    for p, (a, b) in enumerate(pairs):
        mag[a] += dy.reshape(y64.shape)[p].double().abs() @ ex.B[b].T
    err = (x.grad.double() - x64.grad).abs()
    assert bool((err <= 2e-5 * mag + 2**-126).all()), f"max error {err.max().item():.3e}"


def test_gradient_into_weights_is_refused():
    ex = Experts(2, 32, 64, "affine", 4, 64, torch.float32)
    scales = ex.scales.clone().requires_grad_()
    y = torch_qmm.gather_qmm(torch.randn(1, 1, 64), ex.wq, scales, ex.biases, rhs_indices=torch.tensor([1]))
    with pytest.raises(RuntimeError, match="gather_qmm: no gradient with respect to 'w', 'scales' or 'biases'"):
        y.sum().backward()


@pytest.mark.parametrize("lhs", [False, True], ids=["rhs-only", "lhs-and-rhs"])
@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
def test_opcheck(transpose, lhs):
    ex = Experts(3, 32, 64, "affine", 4, 32, torch.float32, transpose)
    K = 64
    x = torch.randn(2, 2, K)
    args = (x, ex.wq, ex.scales, ex.biases, torch.tensor([1, 0, 1]) if lhs else None,
            torch.tensor([[2], [0], [1]], dtype=torch.int32), "affine", 4, 32, transpose, False)
    if not lhs:
        args = (torch.randn(3, 1, 2, K),) + args[1:]
    torch.library.opcheck(torch.ops.torch_qmm.gather_qmm.default, args)


def test_opcheck_fp_mode():
    ex = Experts(3, 32, 64, "mxfp4", 4, 32, torch.bfloat16)
    args = (torch.randn(4, 1, 1, 64).bfloat16(), ex.wq, ex.scales, None, None, moe_indices(4, 2, 3, seed=0),
            "mxfp4", 4, 32, True, False)
    torch.library.opcheck(torch.ops.torch_qmm.gather_qmm.default, args)


def test_compiled_moe_layer_does_not_recompile_as_tokens_change():
    E, N, K, k = 8, 64, 128, 2
    ex = Experts(E, N, K, "affine", 4, 64, torch.float32)

    def layer(x, logits):
        experts = logits.topk(k, dim=-1).indices
        y = torch_qmm.gather_qmm(x[:, None, None, :], ex.wq, ex.scales, ex.biases, rhs_indices=experts,
                                 group_size=64, bits=4)
        return y.squeeze(-2).sum(-2)

    frames = {"n": 0}

    def counting_backend(gm, example_inputs):
        frames["n"] += 1
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counting_backend)
    # T starts at 3: T=2 would equal k and Dynamo's duck sizing would give both one symbol.
    for T in (3, 5, 9, 17, 33):
        x, logits = torch.randn(T, K), torch.randn(T, E)
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=0, atol=0)
    assert frames["n"] == 1, f"compiled {frames['n']} graphs for 5 token counts"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ---- bad input: each argument named, with what was expected and what came ----------------------


def _call(**over):
    ex = _call.ex
    kw = dict(x=torch.randn(2, 1, 64), w=ex.wq, scales=ex.scales, biases=ex.biases, lhs=None,
              rhs=torch.tensor([0, 2]), mode="affine", bits=4, group_size=32, transpose=True)
    kw.update(over)
    return torch.ops.torch_qmm.gather_qmm(kw["x"], kw["w"], kw["scales"], kw["biases"], kw["lhs"], kw["rhs"],
                                          kw["mode"], kw["bits"], kw["group_size"], kw["transpose"], False)


_call.ex = Experts(3, 32, 64, "affine", 4, 32, torch.float32)
_W = _call.ex

BAD = [
    ("x-dtype", dict(x=torch.zeros(2, 1, 64, dtype=torch.int32)), TypeError, "argument 'x' must be float32"),
    ("x-vs-scales", dict(x=torch.randn(2, 1, 64).half()), TypeError, "argument 'x' must have the dtype of 'scales'"),
    ("x-1d", dict(x=torch.randn(64)), ValueError, r"argument 'x' must have at least 2 dimensions \[..., M, K\]"),
    ("x-K", dict(x=torch.randn(2, 1, 63)), ValueError, "argument 'x' must have last dimension K=64"),
    ("w-dtype", dict(w=_W.wq.view(torch.int32)), TypeError, "argument 'w' must be uint32"),
    ("w-1d", dict(w=_W.wq[0, 0]), ValueError, "argument 'w' must have at least 2 dimensions"),
    ("w-words", dict(w=_W.wq[..., :3]), ValueError, "argument 'w' has 3 words per row"),
    ("scales-shape", dict(scales=_W.scales[:2]), ValueError, r"argument 'scales' must have shape \[3, 32, 2\]"),
    ("scales-dtype", dict(scales=_W.scales.half()), TypeError, "argument 'biases' must have the dtype of 'scales'"),
    ("biases-missing", dict(biases=None), ValueError, "argument 'biases' is required for mode 'affine'"),
    ("biases-shape", dict(biases=_W.biases[:, :, :1]), ValueError, "argument 'biases' must have shape"),
    ("biases-for-fp", dict(mode="mxfp4", bits=4, group_size=32), ValueError, "argument 'biases' must be None"),
    ("mode", dict(mode="int4"), ValueError, "argument 'mode' must be one of"),
    ("bits", dict(bits=7), ValueError, "argument 'bits' must be one of"),
    ("group_size", dict(group_size=48), ValueError, "argument 'group_size' must be one of"),
    ("rhs-dtype", dict(rhs=torch.tensor([0.0, 1.0])), TypeError,
     "argument 'rhs_indices' must be int32, int64 or uint32, got Float"),
    ("lhs-dtype", dict(lhs=torch.tensor([0, 1], dtype=torch.int16)), TypeError,
     "argument 'lhs_indices' must be int32, int64 or uint32, got Short"),
    ("rhs-range", dict(rhs=torch.tensor([0, 3])), ValueError,
     r"argument 'rhs_indices' must hold indices in \[0, 3\) \(the matrices of 'w' of shape \[3, 32, 8\]\), got 3"),
    ("rhs-negative", dict(rhs=torch.tensor([-1, 0])), ValueError, r"argument 'rhs_indices'.*got -1"),
    ("rhs-uint32-high", dict(rhs=torch.tensor([0, 2**32 - 1], dtype=torch.int64).to(torch.uint32)), ValueError,
     r"argument 'rhs_indices'.*got 4294967295"),
    ("lhs-range", dict(lhs=torch.tensor([0, 2])), ValueError,
     r"argument 'lhs_indices' must hold indices in \[0, 2\) \(the matrices of 'x' of shape \[2, 1, 64\]\), got 2"),
    ("broadcast", dict(lhs=torch.tensor([0, 1, 1])), ValueError,
     r"'lhs_indices' \(shape \[3\]\) and 'rhs_indices' \(shape \[2\]\) differ in dimension -1 \(3 vs 2\)"),
]


@pytest.mark.parametrize("name,over,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_clearly(name, over, exc, message):
    with pytest.raises(exc, match=message):
        _call(**over)


@pytest.mark.parametrize("name,over,exc,message", [b for b in BAD if "range" not in b[0] and "negative" not in b[0]
                                                    and "high" not in b[0]], ids=lambda v: v if isinstance(v, str) else "")
def test_meta_tensors_are_refused_identically(name, over, exc, message):
    """The Meta kernel runs the same checks (all but the data-dependent index range)."""
    ex = _call.ex
    meta = lambda t: None if t is None else t.to("meta")  # noqa: E731
    kw = dict(x=torch.randn(2, 1, 64), w=ex.wq, scales=ex.scales, biases=ex.biases, lhs=None, rhs=torch.tensor([0, 2]))
    kw.update({k: v for k, v in over.items() if k in kw})
    rest = {k: v for k, v in over.items() if k not in kw}
    with pytest.raises(exc, match=message):
        _call(**{k: meta(v) for k, v in kw.items()}, **rest)


@pytest.mark.parametrize("mode, bits, gs", [("affine", 3, 32), ("mxfp4", 4, 32)])
@pytest.mark.parametrize("indices", ["rhs-only", "none", "lhs-only"])
@pytest.mark.parametrize("transpose", [True, False], ids=["T", "N"])
def test_gradient_in_x_with_default_indices(transpose, indices, mode, bits, gs):
    # None indices are an arange over x's / w's batch (broadcast against the other): the backward
    # must scatter every pair's gradient to the x row it read.
    ex = Experts(3, 64, 96, mode, bits, gs, torch.float32, transpose, seed=2)
    x_batch = {"rhs-only": (4, 1), "none": (3,), "lhs-only": (2,)}[indices]
    x = torch.randn(*x_batch, 2, 96, requires_grad=True)
    lhs = torch.tensor([1, 1, 0]) if indices == "lhs-only" else None
    rhs = torch.tensor([2, 0, 2]) if indices == "rhs-only" else None
    y = torch_qmm.gather_qmm(x, ex.wq, ex.scales, ex.biases, lhs, rhs, transpose=transpose, group_size=gs,
                             bits=bits, mode=mode)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    xs = x64.reshape(-1, 2, 96)
    li = torch.arange(xs.shape[0]).reshape(x_batch) if lhs is None else lhs
    ri = torch.arange(3) if rhs is None else rhs
    li, ri = torch.broadcast_tensors(li, ri)
    y64 = torch.stack([xs[a] @ ex.A[b] for a, b in zip(li.reshape(-1).tolist(), ri.reshape(-1).tolist())])
    assert y64.reshape(y.shape).shape == y.shape
    y64.backward(dy.reshape(y64.shape).double())
    # dx sums float32 products of |dy| and |W|: the accumulation bound of the other-transpose product
    mag = torch.stack([dy.reshape(y64.shape)[p].double().abs() @ ex.B[b].T
                       for p, b in enumerate(ri.reshape(-1).tolist())])
    bound = torch.zeros_like(x64).reshape(-1, 2, 96)
    bound.index_add_(0, li.reshape(-1), mag)
    err = (x.grad.double() - x64.grad).abs().reshape(-1, 2, 96)
    assert bool((err <= 2e-5 * bound + 2**-126).all()), f"max error {err.max().item():.3e}"
