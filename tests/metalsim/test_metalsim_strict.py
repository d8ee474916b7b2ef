"""Strictness: constructs Apple's Metal compiler rejects are rejected by metalsim too, with a
message (one test per rule of the README's "Strictness" list)."""
import pytest

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"


def _body(stmt):
    return HEAD + f"kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {{ {stmt} }}\n"


REJECTED = [
    ("implicit_float_to_bfloat", _body("float f = y[i]; bfloat b = f; y[i] = float(b);"), "to bfloat"),
    ("implicit_int_to_bfloat", _body("int n = int(i); bfloat b = n; y[i] = float(b);"), "to bfloat"),
    ("bfloat_returned_from_float_math", _body("bfloat b = bfloat(y[i]); bfloat e = exp(b); y[i] = float(e);"),
     "to bfloat"),
    ("goto", _body("if (i) goto done; y[i] = 1; done: ;"), "goto"),
    ("virtual", HEAD + "struct B { virtual float f() { return 1; } };\n" + _body("y[i] = 0;"), "virtual"),
    ("new", _body("float* p = new float[4]; y[i] = p[0];"), "dynamic allocation"),
    ("double", _body("double d = y[i]; y[i] = float(d);"), "double"),
    ("exceptions", _body("try { y[i] = 1; } catch (...) { }"), "exceptions"),
    ("throw", _body("if (i) throw 1;"), "exceptions"),
    ("rtti", HEAD + "struct A { int x; };\n" + _body("A a; y[i] = float(typeid(a) == typeid(a));"), "rtti|typeid"),
    ("malloc", _body("float* p = (float*)malloc(16); y[i] = p[0];"), "undeclared|malloc"),
]


@pytest.mark.parametrize("name,src,match", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_with_a_message(metalsim, name, src, match):
    with pytest.raises(metalsim.CompileError, match=match):
        metalsim.compile(src)


def test_what_metal_allows_stays_allowed(metalsim):
    # explicit conversions to bfloat, implicit float -> half, `= delete`, bfloat -> float
    src = HEAD + ("struct NoCopy { NoCopy() = default; NoCopy(const thread NoCopy&) = delete; };\n"
                  + _body("float f = y[i]; bfloat b = static_cast<bfloat>(f); bfloat c = bfloat(f); "
                          "half h = f; float g = b; y[i] = g + float(c) + float(h);"))
    lib = metalsim.compile(src)
    assert lib.kernels == ["k"]
