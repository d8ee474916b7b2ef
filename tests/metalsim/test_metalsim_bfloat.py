"""bfloat conversions as the Metal Shading Language defines them (MSL 3.1, section 2.1,
scalar data types): "bfloat is an extended floating point type that only allows implicit
conversion to a type of greater floating point rank. While bfloat can be implicitly converted
to float, it cannot be implicitly converted to half, and neither float nor half can be
implicitly converted to bfloat." Explicit conversions are allowed in every spelling; the
expected values come from torch's bfloat16/float16 rounding (round to nearest even)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"

EXPLICIT_SRC = HEAD + r"""
typedef bfloat bf16_alias;
template <typename T> METAL_FUNC T functional(half h) { return T(h); }
template <typename T> METAL_FUNC T c_style(half h) { return (T)h; }
template <typename T, typename V> METAL_FUNC T functional_vec(V v) { return T(v); }
kernel void explicit_casts(device float* out [[buffer(0)]], device const half* h [[buffer(1)]],
                           device const bfloat* b [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  device float* o = out + i * 12;
  half x = h[i];
  bfloat y = b[i];
  o[0] = float(bfloat(x));                        // functional, bfloat named
  o[1] = float((bfloat)x);                        // C-style
  o[2] = float(static_cast<bfloat>(x));           // static_cast
  o[3] = float(functional<bfloat>(x));            // T(h), T a template parameter
  o[4] = float(c_style<bf16_alias>(x));           // (T)h, T an alias
  o[5] = float(half(y));                          // bfloat -> half, functional
  o[6] = float((half)y);                          // C-style
  half4 hv = half4(x, x, x, x);
  bfloat4 b1 = bfloat4(hv);                       // vectors: functional, C-style, static_cast, template
  bfloat4 b2 = (bfloat4)hv;
  bfloat4 b3 = static_cast<bfloat4>(hv);
  bfloat4 b4 = functional_vec<bfloat4>(hv);
  o[7] = float(b1.x);
  o[8] = float(b2.y);
  o[9] = float(b3.z);
  o[10] = float(b4.w);
  o[11] = float(half4(b4).x);                     // and back, bfloat4 -> half4
}
"""


def test_explicit_half_bfloat_conversions_in_every_spelling(metalsim):
    lib = metalsim.compile(EXPLICIT_SRC)
    h = np.array([1.5, 0.1, -3.0e4, 6.1e-5, 1.00390625, 65504.0], np.float16)
    b = torch.tensor([0.3, -2.5, 70000.0, 1e-6, 1.0e5, -1.5e-3], dtype=torch.bfloat16)
    out = np.zeros((len(h), 12), np.float32)
    lib.dispatch("explicit_casts", buffers={0: out, 1: h, 2: b.view(torch.int16).numpy().view(np.uint16)},
                 threadgroups=1, threads_per_threadgroup=len(h))
    h_to_b = torch.from_numpy(h).to(torch.bfloat16).float().numpy()  # one rounding, exact source
    b_to_h = b.to(torch.float16).float().numpy()
    for col in (0, 1, 2, 3, 4, 7, 8, 9, 10):
        np.testing.assert_array_equal(out[:, col], h_to_b, err_msg=f"column {col}")
    np.testing.assert_array_equal(out[:, 5], b_to_h)
    np.testing.assert_array_equal(out[:, 6], b_to_h)
    np.testing.assert_array_equal(out[:, 11], torch.from_numpy(h_to_b).to(torch.float16).float().numpy())


def test_bfloat_literal_suffix(metalsim):
    # `bf`/`BF` spells a bfloat literal (MLX's bf16_math.h writes `bfloat a = 5.0bf;`); the
    # value is the literal rounded once to bfloat. 1.00390625 is a tie between 1 and 1 + 2**-7
    # (to even: 1); 3.4e38 is above the largest bfloat and rounds to infinity
    lits = ["5.0bf", "0.1bf", "1e-3BF", "1.00390625bf", "-2.75e5bf", "3.4e38bf", "0x1.8p3bf"]
    body = " ".join(f"y[{k}] = float({lit});" for k, lit in enumerate(lits))
    src = HEAD + f"kernel void k(device float* y [[buffer(0)]]) {{ bfloat b = 5.0bf; {body} y[{len(lits)}] = float(b); }}\n"
    lib = metalsim.compile(src)
    y = np.zeros(len(lits) + 1, np.float32)
    lib.dispatch("k", buffers={0: y}, threadgroups=1, threads_per_threadgroup=1)
    values = [float.fromhex(s[:-2]) if s.startswith("0x") else float(s[:-2]) for s in lits]
    want = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(y[:-1], want)
    assert y[-1] == 5.0


def test_int_converts_implicitly_to_bfloat(metalsim):
    # the rule names float and half, not integers: `bfloat b = n;` is accepted and rounds to
    # nearest even (257 -> 256, 259 -> 260 with 8 significant bits)
    src = HEAD + ("kernel void k(device float* y [[buffer(0)]], device const int* n [[buffer(1)]],\n"
                  "              uint i [[thread_position_in_grid]]) { int v = n[i]; bfloat b = v; y[i] = float(b); }\n")
    lib = metalsim.compile(src)
    n = np.array([0, 1, -7, 257, 259, 1000001, -65535], np.int32)
    y = np.zeros(len(n), np.float32)
    lib.dispatch("k", buffers={0: y, 1: n}, threadgroups=1, threads_per_threadgroup=len(n))
    np.testing.assert_array_equal(y, torch.from_numpy(n).to(torch.bfloat16).float().numpy())


IMPLICIT = [
    ("float_var", "float f = y[i]; bfloat b = f; y[i] = float(b);", "to bfloat"),
    ("half_var", "half h = half(y[i]); bfloat b = h; y[i] = float(b);", "type 'bfloat'.* with an lvalue of type 'half'"),
    ("bfloat_to_half", "bfloat b = bfloat(y[i]); half h = b; y[i] = float(h);",
     "type 'half'.* with an lvalue of type 'bfloat'"),
    ("half_vector", "half4 h = half4(y[i]); bfloat4 b = h; y[i] = float(b.x);", "bfloat4"),
    ("float_vector", "float4 f = float4(y[i]); bfloat4 b = f; y[i] = float(b.x);", "bfloat4"),
    ("template_parameter", "y[i] = float(keep<bfloat>(half(y[i])));", "bfloat"),
    ("bfloat_literal_to_half", "half h = 5.0bf; y[i] = float(h);", "half"),
]


@pytest.mark.parametrize("name,stmt,match", IMPLICIT, ids=[c[0] for c in IMPLICIT])
def test_implicit_conversions_to_bfloat_stay_rejected(metalsim, name, stmt, match):
    src = HEAD + ("template <typename T> METAL_FUNC T keep(half h) { T r = h; return r; }\n"
                  f"kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {{ {stmt} }}\n")
    with pytest.raises(metalsim.CompileError, match=match):
        metalsim.compile(src)
