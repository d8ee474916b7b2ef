"""Strictness: constructs Apple's Metal compiler rejects are rejected by metalsim too, with a
message (one test per rule of the README's "Strictness" list)."""
import pytest

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"


def _body(stmt):
    return HEAD + f"kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {{ {stmt} }}\n"


# bfloat: "an extended floating point type that only allows implicit conversion to a type of
# greater floating point rank ... it cannot be implicitly converted to half, and neither float
# nor half can be implicitly converted to bfloat" (Metal Shading Language Specification 3.1,
# scalar data types; quoted in MLX's kernels/bf16_math.h in the corpus). No exception is made
# for constants: Apple's compiler rejects `bfloat x = 0.0;` ("cannot initialize a variable of
# type 'bfloat' with an rvalue of type 'float'").
REJECTED = [
    ("implicit_float_to_bfloat", _body("float f = y[i]; bfloat b = f; y[i] = float(b);"), "to bfloat"),
    ("bfloat_returned_from_float_math", _body("bfloat b = bfloat(y[i]); bfloat e = exp(b); y[i] = float(e);"),
     "to bfloat"),
    ("bfloat_from_float_constant", _body("bfloat b = 0.5f; y[i] = float(b);"), "float constant to bfloat"),
    ("bfloat_from_unsuffixed_constant", _body("bfloat b = -2.0, c = bfloat(1); y[i] = float(b) + float(c);"),
     "float constant to bfloat"),
    ("bfloat_returned_float_constant", HEAD + "METAL_FUNC bfloat half_of(float x) { if (x > 0) return 0.5f; "
     "return bfloat(x); }\n" + _body("y[i] = float(half_of(y[i]));"), "float constant to bfloat"),
    ("implicit_half_to_bfloat", _body("half h = half(y[i]); bfloat b = h; y[i] = float(b);"),
     "type 'bfloat'.* with an lvalue of type 'half'"),
    ("implicit_bfloat_to_half", _body("bfloat b = bfloat(y[i]); half h = b; y[i] = float(h);"),
     "type 'half'.* with an lvalue of type 'bfloat'"),
    ("goto", _body("if (i) goto done; y[i] = 1; done: ;"), "goto"),
    ("virtual", HEAD + "struct B { virtual float f() { return 1; } };\n" + _body("y[i] = 0;"), "virtual"),
    ("new", _body("float* p = new float[4]; y[i] = p[0];"), "dynamic allocation"),
    ("double", _body("double d = y[i]; y[i] = float(d);"), "double"),
    ("exceptions", _body("try { y[i] = 1; } catch (...) { }"), "exceptions"),
    ("throw", _body("if (i) throw 1;"), "exceptions"),
    ("rtti", HEAD + "struct A { int x; };\n" + _body("A a; y[i] = float(typeid(a) == typeid(a));"), "rtti|typeid"),
    ("malloc", _body("float* p = (float*)malloc(16); y[i] = p[0];"), "undeclared|malloc"),
    # a call through a function pointer chosen at run time (not a [[visible]] function)
    ("function_pointer_call", HEAD + "float twice(float x) { return 2 * x; }\nfloat thrice(float x) { return 3 * x; }\n"
     + _body("float (*f)(float) = y[i] > 0 ? &twice : &thrice; y[i] = f(y[i]);"), "through a function pointer"),
    # 64-bit atomics: only fetch_min / fetch_max, on device memory
    ("atomic64_threadgroup", HEAD + "kernel void k(device ulong* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
     "  threadgroup atomic_ulong m;\n  atomic_fetch_max_explicit(&m, ulong(i), memory_order_relaxed);\n  y[i] = 0; }\n",
     "64-bit atomics"),
    ("atomic64_add", HEAD + "kernel void k(device atomic_long* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
     "  atomic_fetch_add_explicit(y, long(i), memory_order_relaxed); }\n", "64-bit atomics"),
    # "The constant address space name refers to buffer memory objects allocated from the
    # device memory pool but that are read-only." (Metal Shading Language Specification,
    # address spaces: constant)
    ("constant_pointer_write", HEAD + "kernel void k(constant float* c [[buffer(0)]], device float* y [[buffer(1)]]) "
     "{ c[0] = 1; y[0] = c[0]; }\n", "read-only variable is not assignable"),
    ("constant_reference_write", HEAD + "kernel void k(constant float& c [[buffer(0)]], device float* y [[buffer(1)]]) "
     "{ c = 1; y[0] = c; }\n", "const-qualified"),
    # "All arguments to a graphics or kernel function that are a pointer or reference to a type
    # must be declared with an address space attribute." (specification, address spaces)
    ("kernel_pointer_without_address_space", HEAD + "kernel void k(float* y [[buffer(0)]]) { y[0] = 1; }\n",
     "without an address space"),
    ("kernel_reference_without_address_space", HEAD + "kernel void k(float& c [[buffer(0)]], "
     "device float* y [[buffer(1)]]) { y[0] = c; }\n", "without an address space"),
    # "Variables in program scope must be declared in the constant address space."
    # (specification, address spaces)
    ("threadgroup_at_program_scope", HEAD + "threadgroup float g[4];\n" + _body("y[i] = g[0];"), "program scope"),
    ("device_at_program_scope", HEAD + "namespace ns { device float g = 1; }\n" + _body("y[i] = ns::g;"),
     "program scope"),
]


@pytest.mark.parametrize("name,src,match", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_with_a_message(metalsim, name, src, match):
    with pytest.raises(metalsim.CompileError, match=match):
        metalsim.compile(src)


def test_what_metal_allows_stays_allowed(metalsim):
    # explicit conversions to bfloat (also of constants), implicit float -> half (also of a
    # constant), `= delete`, bfloat -> float (greater rank)
    src = HEAD + ("struct NoCopy { NoCopy() = default; NoCopy(const thread NoCopy&) = delete; };\n"
                  + _body("float f = y[i]; bfloat b = static_cast<bfloat>(f); bfloat c = bfloat(f); "
                          "bfloat d = bfloat(0.5f); bfloat e = static_cast<bfloat>(2.0); half k = 0.25f; "
                          "half h = f; float g = b; y[i] = g + float(c) + float(h) + float(d) + float(e) + float(k);"))
    # a float constant returned where the return type is float, or from a class or lambda
    # inside a bfloat function, and an explicit conversion of a returned constant
    src += ("METAL_FUNC bfloat pick(float x) { struct P { float f() { return 0.5f; } }; "
            "if (x > 0) return bfloat(0.5f); return static_cast<bfloat>(P().f()); }\n"
            "METAL_FUNC float other() { return 0.5f; }\n")
    lib = metalsim.compile(src)
    assert lib.kernels == ["k"]


def test_what_metal_allows_stays_allowed_calls_and_atomics(metalsim):
    # a function pointer as a template argument (resolved at compile time: llama.cpp's and
    # MLX's kernels use this), non-recursive helpers, 64-bit atomic max on device memory
    import numpy as np
    src = HEAD + ("float twice(float x) { return 2 * x; }\n"
                  "template <float (*F)(float)> float apply(float x) { return F(x); }\n"
                  "kernel void k(device float* y [[buffer(0)]], device atomic_ulong* m [[buffer(1)]],\n"
                  "              uint i [[thread_position_in_grid]]) {\n"
                  "  y[i] = apply<twice>(y[i]);\n"
                  "  atomic_fetch_max_explicit(m, ulong(i) << 40, memory_order_relaxed);\n}\n")
    lib = metalsim.compile(src)
    y, m = np.arange(4, dtype=np.float32), np.zeros(1, np.uint64)
    lib.dispatch("k", buffers={0: y, 1: m}, threadgroups=1, threads_per_threadgroup=4)
    np.testing.assert_array_equal(y, np.arange(4) * 2)
    assert m[0] == 3 << 40


def test_recursion_is_allowed(metalsim):
    # compute functions may call themselves (Metal 2.4 and later): PyTorch's MPS kernels do
    # (c10/metal/special_math.h, bessel_j1_forward(-x) for a negative argument); direct, tail
    # and mutual recursion run
    import numpy as np
    src = HEAD + ("int fact(int n) { return n <= 1 ? 1 : n * fact(n - 1); }\n"
                  "int count(int n, int acc) { return n == 0 ? acc : count(n - 1, acc + 2); }\n"
                  "int odd(int n);\n"
                  "__attribute__((noinline)) int even(int n) { return n == 0 ? 1 : odd(n - 1); }\n"
                  "__attribute__((noinline)) int odd(int n) { return n == 0 ? 0 : even(n - 1); }\n"
                  + _body("y[i] = float(fact(int(i))) + 100 * float(count(int(i), 0)) + 1000 * float(even(int(i)));"))
    lib = metalsim.compile(src)
    y = np.zeros(6, np.float32)
    lib.dispatch("k", buffers={0: y}, threadgroups=1, threads_per_threadgroup=6)
    np.testing.assert_array_equal(y, [1 + 0 + 1000, 1 + 200, 2 + 400 + 1000, 6 + 600, 24 + 800 + 1000, 120 + 1000])


def test_address_spaces_metal_allows_stay_allowed(metalsim):
    # functions returning pointers into an address space at program scope, constant program-scope
    # variables, threadgroup arrays in a kernel, kernel arguments in each address space
    src = HEAD + ("constant float table[2] = {1, 2};\n"
                  "device float* at(device float* p, uint i) { return p + i; }\n"
                  "template <typename T> threadgroup T* tg(threadgroup T* p) { return p; }\n"
                  "kernel void k(device float* y [[buffer(0)]], constant float& c [[buffer(1)]],\n"
                  "              threadgroup float* s [[threadgroup(0)]], uint i [[thread_position_in_grid]]) {\n"
                  "  threadgroup float t[4];\n  t[i % 4] = c; tg(s)[0] = 0;\n"
                  "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  *at(y, i) = t[i % 4] + table[1];\n}\n")
    assert metalsim.compile(src).kernels == ["k"]
