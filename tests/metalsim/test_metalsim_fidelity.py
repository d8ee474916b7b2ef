"""Real-world MSL that metalsim must accept unmodified (each test one construct that Apple's
compiler accepts and real kernels, MLX's and llama.cpp's, use)."""
import numpy as np
import pytest

SRC = r"""
#include <metal_stdlib>
using namespace metal;

// user bfloat overloads in namespace metal, as MLX's bf16_math.h adds them
namespace metal {
METAL_FUNC bfloat exp(bfloat x) { return static_cast<bfloat>(__metal_exp(static_cast<float>(x), __METAL_MAYBE_FAST_MATH__)); }
METAL_FUNC bfloat simd_shuffle(bfloat x, ushort lane) { return as_type<bfloat>(simd_shuffle(as_type<ushort>(x), lane)); }
METAL_FUNC float log1p(float x) { return metal::log(1.0f + x); }  // not an MSL function
}
template <typename T> struct is_empty { static constexpr bool value = false; };  // not an MSL name either

struct Acc {
  float v;
  Acc() thread : v(1) {}
  Acc() threadgroup : v(2) {}
  float get() const thread { return v; }
  float get() const device { return v + 100; }
};

METAL_FUNC int second(constant const int s[2]) { return s[1]; }
METAL_FUNC float take(const constant float& x) { return x; }

// implicit buffer indices: the first free index in order
kernel void implicit_idx(device float* out, device const float* in, constant float& k,
                         uint i [[thread_position_in_grid]]) {
  out[i] = in[i] * k;
}

kernel void builtins_and_overloads(device float* out [[buffer(0)]], device const half4* h [[buffer(1)]],
                                   constant int* s [[buffer(2)]], constant float& c [[buffer(3)]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  out[lane * 12 + 0] = __metal_fabs(-x, __METAL_MAYBE_FAST_MATH__);
  out[lane * 12 + 1] = __metal_simd_sum(x);
  out[lane * 12 + 2] = float(exp(bfloat(0.5f)));
  out[lane * 12 + 3] = float(simd_shuffle(static_cast<bfloat>(x), ushort(31 - lane)));
  out[lane * 12 + 4] = simd_shuffle_and_fill_down(x, x + 100.0f, ushort(2));
  out[lane * 12 + 5] = simd_shuffle_and_fill_up(x, x + 100.0f, ushort(3), ushort(8));
  Acc a;
  out[lane * 12 + 6] = a.get();
  out[lane * 12 + 7] = float(second(s));
  out[lane * 12 + 8] = float4(h[lane % 2]).y;                         // vector from a device lvalue
  out[lane * 12 + 9] = float(static_cast<bfloat>(half(1.5h)));          // half -> bfloat cast
  out[lane * 12 + 10] = take(c) + float(is_empty<int>::value) + log1p(0.0f);
  uniform<float> u = make_uniform(2.0f);
  out[lane * 12 + 11] = u * 3.0f + float(is_same_v<remove_addrspace_t<device float>, float>);
}

constant bool has_bias [[function_constant(200)]];
constant int scale [[function_constant(101)]];
kernel void optional_bias(device float* y [[buffer(0)]], device const float* bias [[buffer(1), function_constant(has_bias)]],
                          constant float& b2 [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] = float(scale) * float(i) + (has_bias ? bias[i] + b2 : 0.0f);
}
"""


@pytest.fixture(scope="module")
def lib(metalsim):
    return metalsim.compile(SRC)


def test_implicit_buffer_indices(lib):  # G1
    x = np.arange(8, dtype=np.float32)
    y = np.zeros(8, np.float32)
    lib.dispatch("implicit_idx", buffers={0: y, 1: x}, bytes={2: np.float32(3)}, threadgroups=1,
                 threads_per_threadgroup=8)
    np.testing.assert_array_equal(y, x * 3)


def test_builtins_overloads_and_conversions(lib):  # G2-G12, G17
    out = np.zeros((32, 12), np.float32)
    h = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float16)
    lane = np.arange(32, dtype=np.float32)
    lib.dispatch("builtins_and_overloads", buffers={0: out, 1: h, 2: np.array([7, 9], np.int32)},
                 bytes={3: np.float32(0.25)}, threadgroups=1, threads_per_threadgroup=32)
    np.testing.assert_array_equal(out[:, 0], lane)                                  # G3
    assert (out[:, 1] == lane.sum()).all()                                          # G3
    assert (out[:, 2] == np.float32(1.6484375)).all()  # bfloat(exp(0.5)) = 1.6484375 (8-bit mantissa), G2
    np.testing.assert_array_equal(out[:, 3], 31 - lane)                             # G7
    down = np.where(lane + 2 < 32, lane + 2, lane + 2 - 32 + 100)                   # G8: MSL semantics
    np.testing.assert_array_equal(out[:, 4], down)
    g, r = lane // 8 * 8, lane % 8
    up = np.where(r - 3 >= 0, lane - 3, g + (r - 3 + 8) + 100)
    np.testing.assert_array_equal(out[:, 5], up)
    assert (out[:, 6] == 1).all()                                                   # G4: thread variant
    assert (out[:, 7] == 9).all()                                                   # G9
    np.testing.assert_array_equal(out[:, 8], np.where(lane % 2 == 0, 2, 6))         # G12
    assert (out[:, 9] == 1.5).all()                                                 # G11
    assert (out[:, 10] == 0.25).all()                                               # G5, G6, G10
    assert (out[:, 11] == 7).all()                                                  # G5, G17


def test_high_function_constant_indices_and_unbound_optional_buffer(lib, metalsim):  # G14-G16
    y = np.zeros(8, np.float32)
    # has_bias false: buffers 1 and 2 unbound; not read, so no fault even in checked mode
    lib.dispatch("optional_bias", buffers={0: y}, function_constants={"has_bias": False, "scale": 3},
                 threadgroups=1, threads_per_threadgroup=8, check=True)
    np.testing.assert_array_equal(y, np.arange(8) * 3)
    bias = np.ones(8, np.float32)
    lib.dispatch("optional_bias", buffers={0: y, 1: bias}, bytes={2: np.float32(2)},
                 function_constants={200: True, 101: 1}, threadgroups=1, threads_per_threadgroup=8)
    np.testing.assert_array_equal(y, np.arange(8) + 3)
    # a true constant with the buffer left unbound: checked mode reports it, never crashes
    with pytest.raises(metalsim.KernelFault, match="not bound"):
        lib.dispatch("optional_bias", buffers={0: y}, bytes={2: np.float32(2)},
                     function_constants={200: True, 101: 1}, threadgroups=1, threads_per_threadgroup=8, check=True)
    # an unset constant that is read: a fault naming it
    with pytest.raises(metalsim.KernelFault, match="function constant 101"):
        lib.dispatch("optional_bias", buffers={0: y}, function_constants={200: False},
                     threadgroups=1, threads_per_threadgroup=8)


SPEC_SRC = r"""
#include <metal_stdlib>
using namespace metal;
struct Params { float alpha; };
constant bool use_src [[function_constant(100)]];
constant int offset [[function_constant(7)]];
constant bool has_offset = is_function_constant_defined(offset);
kernel void dead_read(device float* y [[buffer(0)]],
                      const constant Params* p [[buffer(1), function_constant(use_src)]],
                      uint i [[thread_position_in_grid]]) {
  // read unconditionally, used only under the constant (MLX's steel GEMM builds its
  // epilogue from addmm_params this way); dead when use_src is false
  const float a = p->alpha;
  y[i] = (use_src ? a * y[i] : float(i)) + (has_offset ? float(offset) : 0.0f);
}
"""


def test_function_constants_specialise(metalsim):  # G15
    lib = metalsim.compile(SPEC_SRC)
    y = np.ones(8, np.float32)
    # use_src false: the read of the unbound buffer(1) is dead code, as on Metal; no fault
    lib.dispatch("dead_read", buffers={0: y}, function_constants={"use_src": False},
                 threadgroups=1, threads_per_threadgroup=8, check=True)
    np.testing.assert_array_equal(y, np.arange(8))
    y[:] = 2
    lib.dispatch("dead_read", buffers={0: y}, bytes={1: np.float32(3)},
                 function_constants={"use_src": True, "offset": 5}, threadgroups=1, threads_per_threadgroup=8,
                 check=True)
    np.testing.assert_array_equal(y, np.full(8, 11))
    # use_src true and the buffer unbound: the read is live and checked mode reports it
    with pytest.raises(metalsim.KernelFault, match=r"buffer\(1\), which is not bound"):
        lib.dispatch("dead_read", buffers={0: y}, function_constants={100: True},
                     threadgroups=1, threads_per_threadgroup=8, check=True)


def test_function_constant_is_not_a_constant_expression(metalsim):  # G15
    # MSL resolves function constants when the pipeline is built, after the front end: an
    # array size or template argument needs a constant expression and cannot use one
    src = """#include <metal_stdlib>
using namespace metal;
constant int n [[function_constant(0)]];
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float t[n];
  t[0] = 1.0f;
  y[i] = t[0];
}
"""
    with pytest.raises(metalsim.CompileError, match="not a constant expression"):
        metalsim.compile(src).dispatch("k", buffers={0: np.zeros(1, np.float32)}, threadgroups=1,
                                       function_constants={0: 4})


AS_SRC = r"""
#include <metal_stdlib>
using namespace metal;
struct Cell {
  float v;
  // one variant per address space of *this, each with its own result
  float get() const thread { return v + 1000; }
  float get() const device { return v + 2000; }
  float get() const threadgroup { return v + 3000; }
  float get() const constant { return v + 4000; }
  float scaled(float k) const device { return v * k; }
  float scaled(float k) const thread { return -v * k; }
  // unqualified is the thread variant; a return type in the object's address space
  float bump() { return v + 7; }
  device float& at() device { return v; }
  thread float& at() { return v; }
  // operators and conversions overloaded the same way (MLX's gemv_masked.h _NoMask)
  float operator[](int i) const thread { return v + float(i); }
  float operator[](int i) const device { return v - float(i); }
  operator bool() const thread { return false; }
  operator bool() const device { return true; }
};
constant Cell kcell = {5.0f};
kernel void as_overloads(device float* out [[buffer(0)]], device Cell* d [[buffer(1)]],
                         constant Cell* c [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  threadgroup Cell t[1];
  t[0].v = 3;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  Cell a;
  a.v = 1;
  out[0] = a.get();
  out[1] = d->get();
  out[2] = t[0].get();
  out[3] = c->get();
  out[4] = kcell.get();
  out[5] = a.scaled(3.0f);
  out[6] = d->scaled(3.0f);
  out[7] = a.bump();
  device float& r = d->at();
  r += 10;                     // writes d[0].v through a device reference
  a.at() = 9;
  out[8] = a.v;
  out[9] = a[2] + (*d)[2];
  out[10] = float(bool(a)) + 10 * float(bool(*d));
}
"""


def test_member_functions_overloaded_on_the_address_space_of_this(metalsim):  # G4
    # MSL calls the variant whose address-space qualifier matches the object's address space
    # (a member function without one is the thread variant)
    lib = metalsim.compile(AS_SRC)
    out = np.zeros(11, np.float32)
    dev = np.array([2], np.float32)
    lib.dispatch("as_overloads", buffers={0: out, 1: dev, 2: np.array([4], np.float32)}, threadgroups=1,
                 threads_per_threadgroup=1)
    np.testing.assert_array_equal(out[:5], [1001, 2002, 3003, 4004, 4005])  # thread, device, threadgroup, constant x2
    np.testing.assert_array_equal(out[5:8], [-3, 6, 8])
    assert dev[0] == 12                          # the device variant of at() returned d[0].v
    assert out[8] == 9
    assert out[9] == (9 + 2) + (12 - 2)
    assert out[10] == 10


AS_TEMPLATE_SRC = r"""
#include <metal_stdlib>
using namespace metal;
struct Cell {
  float v;
  template <typename U> U as() const thread { return U(v) + U(1000); }
  template <typename U> U as() const device { return U(v) + U(2000); }
  template <typename U> float scaled(U k) const thread { return -v * float(k); }
  template <typename U> float scaled(U k) const device { return v * float(k); }
  template <int N> float plus() const thread { return v + N; }
  template <int N> float plus() const threadgroup { return v + 10 * N; }
  float get() const thread;
  float get() const device;
  float operator[](int i) const thread;
  float operator[](int i) const device;
};
float Cell::get() const thread { return v + 1; }
float Cell::get() const device { return v + 2; }
float Cell::operator[](int i) const thread { return v + float(i); }
float Cell::operator[](int i) const device { return v - float(i); }
template <typename T> struct Box {
  T v;
  T get() const thread;
  T get() const device;
};
template <typename T> T Box<T>::get() const thread { return v; }
template <typename T> T Box<T>::get() const device { return v * T(2); }
kernel void k(device float* out [[buffer(0)]], device Cell* d [[buffer(1)]], device Box<float>* bx [[buffer(2)]]) {
  threadgroup Cell t[1];
  t[0].v = 3;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  Cell a; a.v = 1;
  Box<float> b; b.v = 5;
  out[0] = a.as<float>();
  out[1] = d->as<float>();
  out[2] = float(d->as<int>());
  out[3] = a.scaled(2.0f);
  out[4] = d->scaled(3);
  out[5] = d->scaled<float>(0.5f);
  out[6] = a.plus<4>();
  out[7] = t[0].plus<4>();
  out[8] = a.get();
  out[9] = d->get();
  out[10] = a[3] + (*d)[3] * 100;
  out[11] = b.get() + 100 * bx->get();
}
"""


def test_member_templates_and_out_of_class_definitions_resolve_on_the_address_space(metalsim):  # G4
    # member templates (type and value parameters, explicit and deduced arguments) and members
    # declared in the class and defined outside it (also of a class template, also operators)
    # run the variant of the object's address space, as ordinary members do
    lib = metalsim.compile(AS_TEMPLATE_SRC)
    out = np.zeros(12, np.float32)
    lib.dispatch("k", buffers={0: out, 1: np.array([2], np.float32), 2: np.array([7], np.float32)},
                 threadgroups=1, threads_per_threadgroup=1)
    np.testing.assert_array_equal(out[:3], [1 + 1000, 2 + 2000, 2 + 2000])     # as<U>(): thread, device
    np.testing.assert_array_equal(out[3:6], [-1 * 2, 2 * 3, 2 * 0.5])          # deduced U, explicit U
    np.testing.assert_array_equal(out[6:8], [1 + 4, 3 + 10 * 4])               # template <int N>: thread, threadgroup
    np.testing.assert_array_equal(out[8:10], [1 + 1, 2 + 2])                   # defined outside the class
    assert out[10] == (1 + 3) + 100 * (2 - 3)                                  # operator[] outside the class
    assert out[11] == 5 + 100 * (7 * 2)                                        # Box<T>::get outside Box<T>


AS_CTOR_SRC = r"""
#include <metal_stdlib>
using namespace metal;
struct Tagged {
  float v;
  Tagged(float x) thread : v(x + 1) {}
  constexpr Tagged(float x) constant : v(x + 2) {}
  Tagged(float x) threadgroup : v(x + 3) {}
  Tagged(const constant Tagged&) constant = default;
  float get() const thread { return v; }
  float get() const constant { return v + 1000; }
};
struct Outside {
  float v;
  Outside(float x) thread;
  constexpr Outside(float x) constant;
};
Outside::Outside(float x) thread : v(x * 2) {}
constexpr Outside::Outside(float x) constant : v(x * 3) {}
constant Tagged kt = Tagged(10.0f);
constant bfloat kb = bfloat(1.5h);      // scalars and vectors in constant memory as before
constant float4 kf = float4(1, 2, 3, 4);
constant half kh(2.0f);
constant Tagged kt2(20.0f);
constant Outside ko = Outside(4.0f);
kernel void k(device float* out [[buffer(0)]]) {
  Tagged a(5.0f);
  Tagged b = Tagged(6.0f);
  Outside o(4.0f);
  out[0] = a.get();
  out[1] = b.get();
  out[2] = kt.get();
  out[3] = kt2.get();
  out[4] = o.v;
  out[5] = ko.v + float(kb) + kf.w + float(kh);
}
"""


def test_constructors_resolve_on_the_address_space_of_the_object(metalsim):  # G4
    # an object in constant memory is built by the constructor's constant variant (also one
    # defined outside the class); a thread object by the thread variant (MLX's complex_t has
    # one per address space; `constant complex64_t v = complex64_t(...)` in its sort.h)
    lib = metalsim.compile(AS_CTOR_SRC)
    out = np.zeros(6, np.float32)
    lib.dispatch("k", buffers={0: out}, threadgroups=1, threads_per_threadgroup=1)
    np.testing.assert_array_equal(out[:2], [5 + 1, 6 + 1])                   # thread variant
    np.testing.assert_array_equal(out[2:4], [10 + 2 + 1000, 20 + 2 + 1000])  # constant variant, get() constant
    np.testing.assert_array_equal(out[4:], [4 * 2, 4 * 3 + 1.5 + 4 + 2])     # defined outside: thread, constant


CAST_SRC = r"""
#include <metal_stdlib>
using namespace metal;
template <typename T, typename U> METAL_FUNC T convert(U x) { return static_cast<T>(x); }
typedef bfloat bf16_alias;
kernel void casts(device float* out [[buffer(0)]], device const half* h [[buffer(1)]],
                  device const bfloat* b [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[i * 4 + 0] = float(convert<bfloat>(h[i]));        // half -> bfloat, T a template parameter
  out[i * 4 + 1] = float(convert<half>(b[i]));          // bfloat -> half
  out[i * 4 + 2] = float(static_cast<bf16_alias>(h[i])); // through an alias
  int4 n = int4(int(i), 2, 3, 4);
  float4 f = convert<float4>(n);                        // a vector conversion converts values
  out[i * 4 + 3] = f.x + f.y + f.z + f.w;
}
"""


def test_static_cast_half_bfloat_through_a_template_parameter(metalsim):  # G11
    # MSL allows explicit conversions between half and bfloat whatever names the type
    # (static_cast<T>(h) with T = bfloat); the value is rounded once to the target (half and
    # bfloat values are exact in float, so through float is the same rounding)
    import torch
    lib = metalsim.compile(CAST_SRC)
    h = np.array([1.5, 0.1, -3.0e4, 6.1e-5], np.float16)
    b = torch.tensor([0.3, -2.5, 70000.0, 1e-6], dtype=torch.bfloat16)
    bbits = b.view(torch.int16).numpy().view(np.uint16)
    out = np.zeros((4, 4), np.float32)
    lib.dispatch("casts", buffers={0: out, 1: h, 2: bbits}, threadgroups=1, threads_per_threadgroup=4)
    h_to_b = torch.from_numpy(h).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(out[:, 0], h_to_b)
    np.testing.assert_array_equal(out[:, 1], b.to(torch.float16).float().numpy())
    np.testing.assert_array_equal(out[:, 2], h_to_b)
    np.testing.assert_array_equal(out[:, 3], np.arange(4) + 9)


# ---- constructs of PyTorch's Metal kernels (c10/metal/*.h, ATen/native/mps/kernels/*.h) ----
STDLIB_SRC = r"""
#include <metal_stdlib>
using namespace metal;
kernel void rel_math(device const float* x [[buffer(0)]], device const float* y [[buffer(1)]],
                     device float* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float c, ip;
  out[i * 8 + 0] = ::metal::isunordered(x[i], y[i]) ? 1.0f : 0.0f;
  out[i * 8 + 1] = isordered(x[i], y[i]) ? 1.0f : 0.0f;
  out[i * 8 + 2] = ::metal::precise::sincos(x[i], c);
  out[i * 8 + 3] = c;
  out[i * 8 + 4] = modf(x[i], ip);
  out[i * 8 + 5] = ip;
  half hc;
  out[i * 8 + 6] = float(sincos(half(x[i]), hc)) + float(hc);
  float2 c2;
  float2 s2 = sincos(float2(x[i], y[i]), c2);
  out[i * 8 + 7] = s2.y + c2.y;
}
"""


def test_relational_and_sincos_modf_functions(metalsim):
    # MSL relational functions isordered / isunordered, math functions sincos (sine returned,
    # cosine through a thread reference) and modf (fraction returned, integral part stored);
    # PyTorch's c10/metal/utils.h and special_math.h call ::metal::isunordered and ::metal::sincos
    lib = metalsim.compile(STDLIB_SRC)
    x = np.array([0.5, np.nan, -2.25, 3.0], np.float32)
    y = np.array([1.0, 2.0, np.nan, -1.5], np.float32)
    out = np.zeros((4, 8), np.float32)
    lib.dispatch("rel_math", buffers={0: x, 1: y, 2: out}, threadgroups=1, threads_per_threadgroup=4)
    np.testing.assert_array_equal(out[:, 0], [0, 1, 1, 0])
    np.testing.assert_array_equal(out[:, 1], [1, 0, 0, 1])
    ok = ~np.isnan(x)
    np.testing.assert_allclose(out[ok, 2], np.sin(x[ok]), rtol=1e-6)
    np.testing.assert_allclose(out[ok, 3], np.cos(x[ok]), rtol=1e-6)
    frac, whole = np.modf(x[ok])
    np.testing.assert_array_equal(out[ok, 4], frac)
    np.testing.assert_array_equal(out[ok, 5], whole)
    h = x[ok].astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(out[ok, 6], np.sin(h) + np.cos(h), rtol=2e-3, atol=2e-3)
    oky = ~np.isnan(y)
    np.testing.assert_allclose(out[oky, 7], np.sin(y[oky]) + np.cos(y[oky]), rtol=1e-6)


CTOR_SRC = r"""
#include <metal_stdlib>
using namespace metal;
struct Pair { float a, b; Pair(float a_, float b_) : a(a_), b(b_) {} };
// T(a, b) with T a template parameter: a vector built from its components (PyTorch's complex
// multiply in c10/metal/utils.h, T = float2) or a class constructed as written
template <typename T> T make2(float a, float b) { return T(a * 2, b + 1); }
template <typename V> using same_t = V;
kernel void ctor2(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float2 v = make2<float2>(float(i), 3.0f);
  Pair p = make2<Pair>(float(i), 5.0f);
  half4 h = make2<same_t<half2>>(1.5f, 2.0f).xyxy;
  out[i * 6 + 0] = v.x; out[i * 6 + 1] = v.y; out[i * 6 + 2] = p.a; out[i * 6 + 3] = p.b;
  out[i * 6 + 4] = float(h.z); out[i * 6 + 5] = float(h.w);
}
"""


def test_template_parameter_constructed_from_several_arguments(metalsim):
    lib = metalsim.compile(CTOR_SRC)
    out = np.zeros((2, 6), np.float32)
    lib.dispatch("ctor2", buffers={0: out}, threadgroups=1, threads_per_threadgroup=2)
    np.testing.assert_array_equal(out, [[0, 4, 0, 6, 3, 3], [2, 4, 2, 6, 3, 3]])


BOOLVEC_SRC = r"""
#include <metal_stdlib>
using namespace metal;
static_assert(sizeof(bool2) == 2 && alignof(bool2) == 2, "bool2");
static_assert(sizeof(bool3) == 4 && alignof(bool3) == 4 && sizeof(bool4) == 4, "bool3/bool4");
union bool4_or_uint { bool4 b; unsigned int i; };  // MLX's reduction/ops.h
kernel void boolvec(constant bool2& flags [[buffer(0)]], device const float4* v [[buffer(1)]],
                    device uint* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  bool2 f = flags;
  bool4 m = v[i] > 0.0f;                       // a comparison mask converts to bool4
  bool4 n = isnan(v[i]);
  bool4_or_uint u;
  u.b = m;
  bool3 t = bool3(true, f.y, m.z);
  out[i * 8 + 0] = flags.x;
  out[i * 8 + 1] = f.y;
  out[i * 8 + 2] = u.i;
  out[i * 8 + 3] = any(n) + 2 * all(m);
  out[i * 8 + 4] = select(float4(1), float4(2), m).y;
  out[i * 8 + 5] = t.x + 2 * t.y + 4 * t.z;
  out[i * 8 + 6] = (!m)[3] + 2 * (m && bool4(true)).w;
  out[i * 8 + 7] = bool2(false).r + 2 * bool2(m.x, true).g;
}
"""


def test_bool_vectors_have_one_byte_per_element(metalsim):
    # MSL's bool2 is 2 bytes (bool3 and bool4: 4), like char vectors: a `constant bool2&`
    # argument holds one byte per flag (PyTorch's radix sort passes its flags so) and MLX's
    # reduction ops read a bool4 as a uint through a union; components as for other vectors
    lib = metalsim.compile(BOOLVEC_SRC)
    v = np.array([[1, -1, np.nan, 2], [-1, -2, -3, -4]], np.float32)
    out = np.zeros((2, 8), np.uint32)
    lib.dispatch("boolvec", buffers={1: v, 2: out}, bytes={0: np.array([0, 1], np.uint8)},
                 threadgroups=1, threads_per_threadgroup=2)
    np.testing.assert_array_equal(out[:, 0], [0, 0])
    np.testing.assert_array_equal(out[:, 1], [1, 1])
    np.testing.assert_array_equal(out[:, 2], [0x01000001, 0])
    np.testing.assert_array_equal(out[:, 3], [1, 0])
    np.testing.assert_array_equal(out[:, 4], [1, 1])
    np.testing.assert_array_equal(out[:, 5], [3, 3])
    np.testing.assert_array_equal(out[:, 6], [2, 1])
    np.testing.assert_array_equal(out[:, 7], [2 * 1, 2 * 1])
