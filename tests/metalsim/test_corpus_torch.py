"""Fidelity corpus: PyTorch's own Metal code (the MSL headers of its MPS backend, from the
torch macOS wheel: c10/metal/*.h and ATen/native/mps/kernels/*.h), unmodified, on metalsim.

Every kernel header compiles (parsed, with all the instantiations it makes itself). Kernels
run against torch's CPU build in float64, dispatched as PyTorch's host code does:

* special functions (special_math.h) through c10/metal/indexing.h's unary kernels: the test
  writes only the functor and instantiation lines (DEFINE_UNARY_FLOATING_FUNCTOR,
  REGISTER_UNARY_OP), as PyTorch's SpecialOps.metal does; `<name>_dense_<out>_<in>` takes
  ILP_PER_THREAD = 4 elements a thread, so numel / 4 threads (rounded up).
* the decode attention kernel (DecodeAttention.h, sdpa_vector, adapted from MLX): grid
  (batch * heads, query length, 1) of 1024 threads (32 SIMD-groups), as MLX's host code
  dispatches it; mask buffers unbound for `_masknone`.
* the single-block merge sort (SortMerge.h, sort_block): one threadgroup of TPTG threads per
  segment (grid (1, segments, 1)), values and int64 indices out; the stable variant gives
  numpy's stable argsort.

Tolerances: special functions are float32 series and rational approximations (Cephes): 2e-6
relative to the largest value (the Bessel functions have zeros); half outputs one ulp of half (2**-10 relative); attention sums exp in float:
2e-6 relative.
"""
import numpy as np
import pytest

import metalsim_corpus as corpus

torch = pytest.importorskip("torch")

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"
# the ATen kernel headers are included by PyTorch's .metal files after these
PRELUDE = HEAD + "#include <c10/metal/utils.h>\n#include <c10/metal/reduction_utils.h>\n"
C10_HEADERS = ["utils.h", "special_math.h", "indexing.h", "reduction_utils.h", "atomic.h", "random.h",
               "igamma.h", "expm1f.h", "error.h"]
ATEN_HEADERS = ["DecodeAttention.h", "PrefillAttention.h", "SortMerge.h", "SortRadix.h", "SortTopK.h"]


@pytest.fixture(scope="module")
def inc():
    return corpus.torch_metal()


@pytest.mark.parametrize("header", C10_HEADERS + ATEN_HEADERS)
def test_torch_metal_header_compiles(metalsim, inc, header):
    """The header and every kernel it instantiates (lazy: parsed and checked by clang, each
    explicit instantiation included; a kernel is compiled to code at its first dispatch)."""
    if header in C10_HEADERS:
        src = HEAD + f"#include <c10/metal/{header}>\n"
    else:
        src = PRELUDE + f"#include <ATen/native/mps/kernels/{header}>\n"
    lib = metalsim.compile(src, include_dirs=[inc], lazy=True)
    if header in ATEN_HEADERS:
        assert lib.kernels


# name in special_math.h -> (torch reference, input range)
SPECIAL = {
    "bessel_j0_forward": (torch.special.bessel_j0, (-20, 20)),
    "bessel_j1_forward": (torch.special.bessel_j1, (-20, 20)),
    "bessel_y0_forward": (torch.special.bessel_y0, (0.5, 20)),
    "modified_bessel_i0_forward": (torch.special.modified_bessel_i0, (-8, 8)),
    "modified_bessel_i1_forward": (torch.special.modified_bessel_i1, (-8, 8)),
    "modified_bessel_k0_forward": (torch.special.modified_bessel_k0, (0.1, 8)),
    "digamma": (torch.special.digamma, (0.25, 30)),
    "erfinv": (torch.special.erfinv, (-0.99, 0.99)),
    "log_gamma": (torch.lgamma, (0.25, 30)),
    "erfcx": (torch.special.erfcx, (-2, 10)),
}
SPECIAL_SRC = (HEAD + "#include <c10/metal/indexing.h>\n#include <c10/metal/special_math.h>\n"
               "using namespace c10::metal;\n"
               + "".join(f"DEFINE_UNARY_FLOATING_FUNCTOR({n});\nREGISTER_UNARY_OP({n}, float, float);\n"
                         for n in SPECIAL)
               + "REGISTER_UNARY_OP(modified_bessel_i0_forward, half, half);\n")


@pytest.fixture(scope="module")
def special_lib(metalsim, inc):
    return metalsim.compile(SPECIAL_SRC, include_dirs=[inc], lazy=True)


def _unary(lib, name, x, out_dtype):
    y = np.zeros_like(x, dtype=out_dtype)
    lib.dispatch_threads(name, threads=-(-x.size // 4), threads_per_threadgroup=64,
                         buffers={0: y, 1: x}, bytes={2: np.uint32(x.size)})
    return y


@pytest.mark.parametrize("fn", list(SPECIAL))
def test_torch_special_function_matches_float64(special_lib, fn):
    ref_fn, (lo, hi) = SPECIAL[fn]
    rng = np.random.default_rng(len(fn))
    x = rng.uniform(lo, hi, 1001).astype(np.float32)  # not a multiple of 4: the tail loop runs
    y = _unary(special_lib, f"{fn}_dense_float_float", x, np.float32)
    ref = ref_fn(torch.from_numpy(x.astype(np.float64))).numpy()
    err = np.abs(y - ref) / np.abs(ref).max()  # relative to the largest value: the Bessel
    assert err.max() <= 2e-6, f"{fn}: max relative error {err.max():.3g} at x = {x[err.argmax()]}"  # functions have zeros


def test_torch_special_function_half(special_lib):
    x = np.linspace(-6, 6, 257).astype(np.float16)
    y = _unary(special_lib, "modified_bessel_i0_forward_dense_half_half", x, np.float16)
    ref = torch.special.modified_bessel_i0(torch.from_numpy(x.astype(np.float64))).numpy()
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=2.0 ** -10)


def _compiled(metalsim, inc, header):
    """The kernels one of the corpus's kernel headers instantiates, compiled lazily."""
    return metalsim.compile(PRELUDE + f"#include <{header}>\n", include_dirs=[inc], lazy=True)


@pytest.fixture(scope="module")
def attn_lib(metalsim, inc):
    return _compiled(metalsim, inc, "ATen/native/mps/kernels/DecodeAttention.h")


@pytest.mark.parametrize("causal", [False, True], ids=["masknone", "causal"])
def test_torch_sdpa_vector_matches_float64(attn_lib, causal):
    """Decode attention for float32, head dim 64, grouped queries (4 query heads on 2 key /
    value heads, gqa_factor 2), 2 queries against 45 keys (not a multiple of the 32
    SIMD-groups that stride over them)."""
    rng = np.random.default_rng(3 + causal)
    B, H, Hkv, qL, N, D = 1, 4, 2, 2, 45, 64
    q = rng.standard_normal((B, H, qL, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    out = np.zeros((B, H, qL, D), np.float32)
    scale = 1 / np.sqrt(D)
    name = f"sdpa_vector_float_64_64_masknone{'_causal' if causal else ''}"
    attn_lib.dispatch(name, buffers={0: q, 1: k, 2: v, 3: out},
                      bytes={4: np.uint32(H // Hkv), 5: np.uint32(N),
                             6: np.array([qL * D, N * D, N * D, 0], np.uint32),  # uint3: 16 bytes
                             7: np.array([D, D, D, 0], np.uint32), 8: np.float32(scale),
                             10: np.zeros(4, np.uint32),
                             11: np.array([H * qL * D, Hkv * N * D, Hkv * N * D, H], np.uint32)},
                      threadgroups=(B * H, qL, 1), threads_per_threadgroup=(1024, 1, 1))
    kk = np.repeat(k.astype(np.float64), H // Hkv, axis=1)
    vv = np.repeat(v.astype(np.float64), H // Hkv, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kk) * scale
    if causal:  # query i sees keys 0..i (the kernel compares the key index with the query index)
        s = np.where(np.arange(N)[None, None, None, :] <= np.arange(qL)[None, None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), vv)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 2e-6, f"max relative error {err:.3g}"


@pytest.fixture(scope="module")
def sort_lib(metalsim, inc):
    return _compiled(metalsim, inc, "ATen/native/mps/kernels/SortMerge.h")


@pytest.mark.parametrize("desc", [False, True], ids=["ascending", "descending"])
def test_torch_sort_block_matches_numpy(sort_lib, desc):
    """3 segments of 100 float32 values (with ties and a NaN) sorted by one threadgroup of 32
    threads each (4 elements a thread: up to 128 per segment)."""
    rng = np.random.default_rng(5)
    S, L = 3, 100
    x = rng.integers(-20, 20, (S, L)).astype(np.float32)
    x[1, 7] = np.nan
    vals = np.zeros((S, L), np.float32)
    idx = np.zeros((S, L), np.int64)
    sort_lib.dispatch("sort_block_float_tptg32_stable", buffers={0: x, 1: vals, 2: idx},
                      bytes={3: np.int32(L), 4: np.array([1, L], np.int64), 5: np.bool_(desc)},
                      threadgroups=(1, S, 1), threads_per_threadgroup=(32, 1, 1))
    ref = torch.sort(torch.from_numpy(x), dim=1, descending=desc, stable=True)
    np.testing.assert_array_equal(vals, ref.values.numpy())
    np.testing.assert_array_equal(idx, ref.indices.numpy())
