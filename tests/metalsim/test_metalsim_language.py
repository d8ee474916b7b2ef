"""metalsim runs MSL language features with Metal's semantics: types, rounding, builtins,
templates with [[host_name]], function constants, threadgroup memory, dispatch forms."""
import numpy as np
import pytest

SRC = r"""
#include <metal_stdlib>
#include <metal_simdgroup>
using namespace metal;

constant int SCALE = 3;
constexpr constant uint BLOCK = 4;
static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2 && sizeof(float4) == 16, "sizes");
static_assert(sizeof(packed_float3) == 12, "packed");

struct Params { uint n; float alpha; };

METAL_FUNC float helper(float x) { return x * SCALE; }
inline float helper(device const float* p) { return p[0]; }          // overload on address space
inline float helper(threadgroup const float* p) { return p[0] + 1000.0; }

kernel void builtins(device uint* out [[buffer(0)]],
                     uint3 tpig [[thread_position_in_grid]],
                     ushort2 tgpig [[threadgroup_position_in_grid]],
                     uint3 tpitg [[thread_position_in_threadgroup]],
                     uint tiitg [[thread_index_in_threadgroup]],
                     uint3 tptg [[threads_per_threadgroup]],
                     uint3 tgpg [[threadgroups_per_grid]],
                     uint3 tpg [[threads_per_grid]],
                     ushort lane [[thread_index_in_simdgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint nsg [[simdgroups_per_threadgroup]],
                     uint width [[thread_execution_width]]) {
  uint gid = tpig.x + tpg.x * (tpig.y + tpg.y * tpig.z);
  device uint* o = out + gid * 16;
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z; o[3] = tgpig.x; o[4] = tgpig.y;
  o[5] = tpitg.x; o[6] = tpitg.y; o[7] = tiitg; o[8] = tptg.x * tptg.y * tptg.z;
  o[9] = tgpg.x * tgpg.y * tgpg.z; o[10] = lane; o[11] = sg; o[12] = nsg; o[13] = width; o[14] = 7;
}

kernel void half_ops(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                     device half* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  half x = a[i], y = b[i];
  out[4 * i + 0] = x + y;
  out[4 * i + 1] = x * y;
  out[4 * i + 2] = x * y + x;          // two roundings: no contraction, no excess precision
  out[4 * i + 3] = half(float(x) / float(y));
}

kernel void bfloat_ops(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                       device bfloat* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  bfloat x = bfloat(a[i]), y = bfloat(b[i]);
  out[3 * i + 0] = x;
  out[3 * i + 1] = x + y;
  out[3 * i + 2] = x * y;
}

kernel void literals(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float x = 0.1;                 // a float literal in Metal, not a double
  out[0] = x * 3.0;
  out[1] = 1.0 / 3.0;
  half h = 0.5h;
  out[2] = float(h * 3.0h);
  out[3] = helper(2.0);
  out[4] = float(BLOCK);
}

kernel void vectors(device const half4* hv [[buffer(0)]], device const uint* u [[buffer(1)]],
                    device float4* out [[buffer(2)]], device const packed_float3* p3 [[buffer(3)]],
                    uint i [[thread_position_in_grid]]) {
  half4 h = hv[0];
  out[0] = float4(h);                      // value conversion, not a bitcast
  out[1] = float4(h.xy, 5, 6.0h);
  out[2] = (float4)(uint4(u[0], u[1], u[2], u[3]));
  out[3] = static_cast<float4>(int4(-1, -2, 3, 4)).wzyx;
  float3 v = p3[1];
  out[4] = float4(v, dot(v, v));
  out[5] = float4(as_type<float>(0x3f800000u), as_type<float>(u[4]), float(as_type<uint>(h.xy) & 0xffffu), 0);
  float2 s = float2(1.5);
  out[6] = float4(s.yx, max(s, float2(0.5, 2.0)));
  vec<float, 4> w = vec<float, 4>(1, 2, 3, 4);
  out[7] = select(w, float4(0), w > 2.0f);
}

kernel void bytes_loads(device const uint8_t* b [[buffer(0)]], device const uint16_t* s [[buffer(1)]],
                        device uint32_t* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const device uint32_t* w = (const device uint32_t*)b;
  out[i] = uint32_t(b[i]) + (uint32_t(s[i]) << 8) + (w[0] & 0xff000000u) + (extract_bits(w[1], 4u, 8u) << 16);
}

kernel void math_fns(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
  float v = x[i];
  device float* o = out + 12 * i;
  o[0] = metal::exp(v); o[1] = precise::exp2(v); o[2] = fast::log(abs(v) + 1);
  o[3] = sqrt(abs(v)); o[4] = rsqrt(abs(v) + 1); o[5] = clamp(v, -0.5f, 0.5f);
  o[6] = fma(v, 2.0f, 1.0f); o[7] = round(v * 3); o[8] = floor(v * 3); o[9] = metal::precise::tanh(v);
  o[10] = mix(0.0f, 10.0f, 0.25f); o[11] = select(1.0f, 2.0f, isnan(v) || isinf(v));
}

kernel void limits(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[0] = float(numeric_limits<half>::max());
  out[1] = float(numeric_limits<half>::lowest());
  out[2] = float(numeric_limits<bfloat>::max());
  out[3] = numeric_limits<float>::infinity();
  out[4] = float(metal::numeric_limits<half>::epsilon());
  out[5] = is_floating_point_v<half> && is_same_v<make_unsigned_t<int>, uint> ? 1 : 0;
  out[6] = is_same<conditional_t<true, int, float>, int>::value ? 1 : 0;
}

template <typename T, int N>
[[kernel]] void scale_t(const device T* x [[buffer(0)]], device T* y [[buffer(1)]],
                        constant Params& p [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i >= p.n) return;
  T acc = T(0);
#pragma clang loop unroll(full)
  for (int k = 0; k < N; k++) acc += x[i] * T(p.alpha);
  y[i] = acc;
}
#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#define instantiate_scale(type, n) instantiate_kernel("scale_" #type "_" #n, scale_t, type, n)
instantiate_scale(float, 2)
instantiate_scale(half, 3)
instantiate_scale(bfloat, 1)

constant bool has_bias [[function_constant(0)]];
constant int repeat [[function_constant(1)]];
constant bool no_bias = !has_bias;
constant bool repeat_defined = is_function_constant_defined(repeat);

kernel void fc_kernel(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      device const float* bias [[buffer(2), function_constant(has_bias)]],
                      uint i [[thread_position_in_grid]]) {
  float v = x[i] * (repeat_defined ? float(repeat) : -1.0f);
  if (has_bias) v += bias[i];
  if (no_bias) v += 1000;
  y[i] = v;
}

kernel void tg_reverse(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       threadgroup float* scratch [[threadgroup(0)]],
                       uint i [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]],
                       uint g [[threadgroup_position_in_grid]]) {
  threadgroup float local[64];
  threadgroup int counter;
  if (i == 0) counter = 0;
  local[i] = x[g * n + i];
  scratch[i] = 2 * x[g * n + i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[g * n + i] = local[n - 1 - i] + scratch[n - 1 - i] + helper(&local[0]) - 1000 - x[g * n];
}

kernel void grid_fill(device uint* out [[buffer(0)]], constant uint2& dims [[buffer(1)]],
                      uint2 pos [[thread_position_in_grid]], uint2 tptg [[threads_per_threadgroup]]) {
  out[pos.y * dims.x + pos.x] = 1 + tptg.x * 100 + tptg.y * 10000;
}

kernel void offsets(device float* y [[buffer(0)]], device const float* x [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  y[i] = helper(x + i) + 0.5f;
}

// derived structs without virtual functions (MLX's steel headers derive traits from
// integral_constant)
template <int N> struct Base {
  float v[N];
  float sum() const { float s = 0; for (int k = 0; k < N; k++) s += v[k]; return s; }
};
template <int N> struct Holder { float unused; };
template <> struct Holder<3> : Base<3> {
  float scaled(float a) const { return a * sum(); }
};
template <typename T, int N> struct Weighted : Base<N> {
  T w;
  T weighted() const { return w * T(this->sum()); }
};
struct Counter { int n; int next() { return ++n; } };
struct Named : Counter { float label; };
template <typename T> struct is_f32 : bool_constant<is_same_v<T, float>> {};
METAL_FUNC float first_of(thread const Base<3>& b) { return b.v[0]; }   // derived -> base reference

kernel void derived_structs(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  Holder<3> h;
  for (int k = 0; k < 3; k++) h.v[k] = x[3 * i + k];
  Weighted<half, 2> w;
  w.v[0] = x[3 * i]; w.v[1] = x[3 * i + 1]; w.w = 2.0h;
  Named c; c.n = int(i); c.label = 0.5f;
  c.next();
  device float* o = out + 6 * i;
  o[0] = h.sum(); o[1] = h.scaled(10.0f); o[2] = float(w.weighted()); o[3] = float(c.next()) + c.label;
  o[4] = first_of(h); o[5] = (is_f32<float>::value && !is_f32<half>::value && sizeof(Holder<3>) == 12) ? 1 : 0;
}
"""


@pytest.fixture(scope="module")
def lib(metalsim):
    return metalsim.compile(SRC)


def test_kernels_are_discovered_with_host_names(lib):
    for k in ["builtins", "half_ops", "scale_float_2", "scale_half_3", "scale_bfloat_1", "fc_kernel", "tg_reverse"]:
        assert k in lib.kernels
    assert lib.function_constants["has_bias"] == (0, "bool")


def test_thread_position_builtins_match_metal(lib):
    tg, tptg = (2, 3, 1), (40, 2, 1)
    grid = (80, 6, 1)
    out = np.zeros((grid[0] * grid[1], 16), np.uint32)
    st = lib.dispatch("builtins", buffers={0: out}, threadgroups=tg, threads_per_threadgroup=tptg)
    assert st.threads == 480
    ys, xs = np.divmod(np.arange(grid[0] * grid[1]), grid[0])
    o = out
    assert (o[:, 0] == xs).all() and (o[:, 1] == ys).all() and (o[:, 2] == 0).all()
    assert (o[:, 3] == xs // 40).all() and (o[:, 4] == ys // 2).all()
    assert (o[:, 5] == xs % 40).all() and (o[:, 6] == ys % 2).all()
    tiitg = (xs % 40) + 40 * (ys % 2)
    assert (o[:, 7] == tiitg).all()
    assert (o[:, 8] == 80).all() and (o[:, 9] == 6).all()
    assert (o[:, 10] == tiitg % 32).all() and (o[:, 11] == tiitg // 32).all()
    assert (o[:, 12] == 3).all() and (o[:, 13] == 32).all() and (o[:, 14] == 7).all()


def test_half_arithmetic_rounds_every_operation(lib):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(256) * 4).astype(np.float16)
    b = (rng.standard_normal(256) * 4).astype(np.float16)
    b[b == 0] = 1
    out = np.zeros(4 * 256, np.float16)
    lib.dispatch("half_ops", buffers={0: a, 1: b, 2: out}, threadgroups=(4, 1, 1), threads_per_threadgroup=(64, 1, 1))
    out = out.reshape(256, 4)
    np.testing.assert_array_equal(out[:, 0], a + b)
    np.testing.assert_array_equal(out[:, 1], a * b)
    np.testing.assert_array_equal(out[:, 2], (a * b) + a)
    np.testing.assert_array_equal(out[:, 3], (a.astype(np.float32) / b.astype(np.float32)).astype(np.float16))


def _bf16_rne(x):
    """float32 -> bfloat16 bits, round to nearest even (numpy reference)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def _bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_bfloat_rounds_to_nearest_even(lib):
    a = np.array([1.0, 1.00390625, 1.01171875, 3.14159, -2.5e-3, 1e30, 65504.0, 1.0 + 2 ** -8], np.float32)
    b = np.array([0.5, 1.00390625, -1.0, 2.71828, 7.0, 3e8, 1.5, 2 ** -9], np.float32)
    out = np.zeros(3 * len(a), np.uint16)
    lib.dispatch("bfloat_ops", buffers={0: a, 1: b, 2: out}, threadgroups=(1, 1, 1), threads_per_threadgroup=(len(a), 1, 1))
    out = out.reshape(-1, 3)
    xa, xb = _bf16_to_f32(_bf16_rne(a)), _bf16_to_f32(_bf16_rne(b))
    np.testing.assert_array_equal(out[:, 0], _bf16_rne(a))
    np.testing.assert_array_equal(out[:, 1], _bf16_rne(xa + xb))
    np.testing.assert_array_equal(out[:, 2], _bf16_rne(xa * xb))


def test_float_literals_are_float_not_double(lib):
    out = np.zeros(8, np.float32)
    lib.dispatch("literals", buffers={0: out}, threadgroups=1, threads_per_threadgroup=1)
    assert out[0] == np.float32(0.1) * np.float32(3.0)
    assert out[1] == np.float32(1.0) / np.float32(3.0)
    assert out[2] == 1.5 and out[3] == 6.0 and out[4] == 4.0


def test_vector_constructors_convert_values_and_swizzle(lib):
    hv = np.array([1.5, -2.25, 3.0, 4.0], np.float16)
    u = np.array([1, 2, 3, 4000000000, 0x40000000], np.uint32)
    p3 = np.arange(6, dtype=np.float32)
    out = np.zeros((8, 4), np.float32)
    lib.dispatch("vectors", buffers={0: hv, 1: u, 2: out, 3: p3}, threadgroups=1, threads_per_threadgroup=1)
    np.testing.assert_array_equal(out[0], hv.astype(np.float32))
    np.testing.assert_array_equal(out[1], [1.5, -2.25, 5, 6])
    np.testing.assert_array_equal(out[2], np.float32([1, 2, 3, 4000000000]))
    np.testing.assert_array_equal(out[3], [4, 3, -2, -1])
    np.testing.assert_array_equal(out[4], [3, 4, 5, 50])
    assert out[5, 0] == 1.0 and out[5, 1] == 2.0 and out[5, 2] == hv[:1].view(np.uint16)[0]
    np.testing.assert_array_equal(out[6], [1.5, 1.5, 1.5, 2.0])
    np.testing.assert_array_equal(out[7], [1, 2, 0, 0])


def test_uint8_uint16_loads_and_pointer_casts(lib):
    b = np.arange(8, dtype=np.uint8)
    b[3] = 0xAB
    s = np.arange(100, 108, dtype=np.uint16)
    out = np.zeros(4, np.uint32)
    lib.dispatch("bytes_loads", buffers={0: b, 1: s, 2: out}, threadgroups=1, threads_per_threadgroup=4)
    w = b.view(np.uint32)
    exp = b[:4].astype(np.uint32) + (s[:4].astype(np.uint32) << 8) + (w[0] & 0xFF000000) + (((w[1] >> 4) & 0xFF) << 16)
    np.testing.assert_array_equal(out, exp)


def test_metal_math_functions(lib):
    x = np.array([0.3, -1.7, 2.5, -0.5, np.inf, 0.0], np.float32)
    out = np.zeros((len(x), 12), np.float32)
    with np.errstate(all="ignore"):
        lib.dispatch("math_fns", buffers={0: x, 1: out}, threadgroups=1, threads_per_threadgroup=len(x))
        f = x[:4].astype(np.float64)
        np.testing.assert_allclose(out[:4, 0], np.exp(f), rtol=1e-6)
        np.testing.assert_allclose(out[:4, 1], np.exp2(f), rtol=1e-6)
        np.testing.assert_allclose(out[:4, 2], np.log(np.abs(f) + 1), rtol=1e-6)
        np.testing.assert_allclose(out[:4, 3], np.sqrt(np.abs(f)), rtol=1e-6)
        np.testing.assert_allclose(out[:4, 4], 1 / np.sqrt(np.abs(f) + 1), rtol=1e-6)
        np.testing.assert_array_equal(out[:4, 5], np.clip(x[:4], -0.5, 0.5))
        np.testing.assert_array_equal(out[:4, 6], x[:4] * 2 + 1)
        np.testing.assert_array_equal(out[:4, 7], [1, -5, 8, -2])  # round half away from zero
        np.testing.assert_array_equal(out[:4, 8], np.floor(x[:4] * 3))
        np.testing.assert_allclose(out[:4, 9], np.tanh(f), rtol=1e-6)
    assert (out[:, 10] == 2.5).all()
    np.testing.assert_array_equal(out[:, 11], [1, 1, 1, 1, 2, 1])


def test_numeric_limits_and_type_traits(lib):
    out = np.zeros(8, np.float32)
    lib.dispatch("limits", buffers={0: out}, threadgroups=1, threads_per_threadgroup=1)
    assert out[0] == 65504 and out[1] == -65504 and out[2] == np.float32(3.3895313892515355e38)
    assert np.isinf(out[3]) and out[4] == 2 ** -10 and out[5] == 1 and out[6] == 1


@pytest.mark.parametrize("name,dtype,n", [("scale_float_2", np.float32, 2), ("scale_half_3", np.float16, 3)])
def test_template_kernels_with_host_name_and_param_struct(lib, name, dtype, n):
    x = np.linspace(-2, 2, 37).astype(dtype)
    y = np.full(40, 99, dtype)
    params = np.array([(37, 0.5)], dtype=[("n", np.uint32), ("alpha", np.float32)])
    lib.dispatch(name, buffers={0: x, 1: y}, bytes={2: params}, threadgroups=(2, 1, 1), threads_per_threadgroup=(32, 1, 1))
    exp = np.zeros(37, dtype)
    for _ in range(n):
        exp = (exp + (x * dtype(0.5)).astype(dtype)).astype(dtype)
    np.testing.assert_array_equal(y[:37], exp)
    assert (y[37:] == 99).all()


def test_bfloat_template_instantiation(lib):
    x = np.array([1.0, 3.0], np.float32)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
    y = np.zeros(2, np.uint16)
    params = np.array([(2, 0.25)], dtype=[("n", np.uint32), ("alpha", np.float32)])
    lib.dispatch("scale_bfloat_1", buffers={0: xb, 1: y}, bytes={2: params}, threadgroups=1, threads_per_threadgroup=2)
    np.testing.assert_array_equal(_bf16_to_f32(y), [0.25, 0.75])


def test_function_constants(lib):
    x = np.arange(4, dtype=np.float32)
    bias = np.full(4, 0.5, np.float32)
    y = np.zeros(4, np.float32)
    lib.dispatch("fc_kernel", buffers={0: x, 1: y, 2: bias}, threadgroups=1, threads_per_threadgroup=4,
                 function_constants={"has_bias": True, "repeat": 3})
    np.testing.assert_array_equal(y, x * 3 + 0.5)
    lib.dispatch("fc_kernel", buffers={0: x, 1: y}, threadgroups=1, threads_per_threadgroup=4,
                 function_constants={0: False})
    np.testing.assert_array_equal(y, -x + 1000)


def test_threadgroup_arrays_and_threadgroup_arguments(lib):
    x = np.random.default_rng(1).standard_normal(128).astype(np.float32)
    y = np.zeros(128, np.float32)
    lib.dispatch("tg_reverse", buffers={0: x, 1: y}, threadgroups=2, threads_per_threadgroup=64,
                 threadgroup_memory={0: 64 * 4}, check=True)
    exp = (x.reshape(2, 64)[:, ::-1] * 3).reshape(-1)
    np.testing.assert_allclose(y, exp, atol=2e-4)  # + 1000 - 1000 in float


def test_dispatch_threads_nonuniform_grid(lib):
    dims = (37, 5)
    out = np.zeros(dims[1] * dims[0], np.uint32)
    st = lib.dispatch("grid_fill", buffers={0: out}, bytes={1: np.array(dims, np.uint32)}, threads=(37, 5, 1),
                      threads_per_threadgroup=(16, 4, 1), check=True)
    out = out.reshape(dims[1], dims[0])
    assert st.threads == 37 * 5
    # partial threadgroups at the edges report their actual size
    assert out[0, 0] == 1 + 16 * 100 + 4 * 10000
    assert out[0, 36] == 1 + 5 * 100 + 4 * 10000
    assert out[4, 0] == 1 + 16 * 100 + 1 * 10000
    assert out[4, 36] == 1 + 5 * 100 + 1 * 10000


def test_buffer_byte_offsets_and_torch_tensors(lib):
    torch = pytest.importorskip("torch")
    x = torch.arange(16, dtype=torch.float32)
    y = np.zeros(16, np.float32)
    lib.dispatch("offsets", buffers={0: (y, 16), 1: (x, 8)}, threadgroups=1, threads_per_threadgroup=8)
    np.testing.assert_array_equal(y[4:12], np.arange(2, 10) + 0.5)
    assert (y[:4] == 0).all() and (y[12:] == 0).all()
    yt = torch.zeros(8)
    lib.dispatch("offsets", buffers={0: yt, 1: x}, threadgroups=1, threads_per_threadgroup=8)
    assert yt.tolist() == [i + 0.5 for i in range(8)]


def test_derived_structs_without_virtual_functions(lib):
    # plain (non-virtual) derivation: a template specialization deriving from a template base,
    # a template deriving from a dependent base, a trait deriving from bool_constant
    x = np.array([1.0, 2.0, 4.0, -0.5, 3.0, 0.25], np.float32)
    out = np.zeros((2, 6), np.float32)
    lib.dispatch("derived_structs", buffers={0: x, 1: out}, threadgroups=1, threads_per_threadgroup=2, check=True)
    np.testing.assert_array_equal(out[0], [7.0, 70.0, 6.0, 2.5, 1.0, 1.0])
    np.testing.assert_array_equal(out[1], [2.75, 27.5, 5.0, 3.5, -0.5, 1.0])


def test_bad_arguments_raise_clear_errors(lib, metalsim):
    y = np.zeros(4, np.float32)
    # an unbound buffer the kernel reads: checked mode names it (Metal allows unbound buffers
    # only when the kernel does not access them)
    with pytest.raises(metalsim.KernelFault, match="buffer\\(1\\), which is not bound"):
        lib.dispatch("offsets", buffers={0: y}, threadgroups=1, threads_per_threadgroup=4, check=True)
    with pytest.raises(KeyError, match="no kernel"):
        lib.dispatch("nope", buffers={}, threadgroups=1)
    with pytest.raises(ValueError, match="1024"):
        lib.dispatch("offsets", buffers={0: y, 1: y}, threadgroups=1, threads_per_threadgroup=(2048, 1, 1))
    with pytest.raises(ValueError, match="contiguous"):
        lib.dispatch("offsets", buffers={0: y[::2], 1: y}, threadgroups=1, threads_per_threadgroup=1)
    with pytest.raises(metalsim.CompileError, match="undeclared|unknown"):
        metalsim.compile("kernel void k(device float* x [[buffer(0)]]) { x[0] = not_declared; }")


def test_missing_compiler_error_says_how_to_install(metalsim, monkeypatch):
    monkeypatch.setenv("TORCH_QMM_CLANG", "/nonexistent/clang-19")
    with pytest.raises(RuntimeError, match="apt-get install -y clang-19"):
        metalsim.compile("kernel void k(device float* x [[buffer(0)]]) { x[0] = 1; } // fresh source")


def test_source_from_file_with_includes_defines_and_namespaces(metalsim, tmp_path):
    (tmp_path / "helpers.h").write_text(
        "#pragma once\n#include <metal_stdlib>\nusing namespace metal;\n"
        "namespace ops { template <typename T> METAL_FUNC T twice(T x) { return x * T(FACTOR); } }\n")
    (tmp_path / "k.metal").write_text(
        '#include "helpers.h"\nnamespace ops {\n'
        "template <typename T> [[kernel]] void apply(device T* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
        "  x[i] = twice(x[i]) + simd_broadcast(x[i], 0);\n}\n"
        'template [[host_name("apply_f")]] [[kernel]] void apply<float>(device float*, uint);\n}\n')
    lib = metalsim.compile(tmp_path / "k.metal", defines={"FACTOR": 3})
    x = np.arange(1, 9, dtype=np.float32)
    lib.dispatch("apply_f", buffers={0: x}, threadgroups=1, threads_per_threadgroup=8)
    np.testing.assert_array_equal(x, np.arange(1, 9) * 3 + 1)


def test_source_text_builds_are_keyed_by_content(metalsim):
    # the same source text staged twice (as by two processes) has one cache key, so the disk
    # cache serves it; a different text has another
    import importlib
    build = importlib.import_module(metalsim.__name__ + "._build")
    src = "#include <metal_stdlib>\nusing namespace metal;\nkernel void k(device float* y [[buffer(0)]]) { y[0] = 1; }\n"
    a, b = build.stage(src, None, {}, ()), build.stage(src, None, {}, ())
    assert a.key == b.key
    assert build.stage(src.replace("= 1", "= 2"), None, {}, ()).key != a.key


def test_a_cached_whole_library_build_keeps_its_named_indices_when_another_process_stages_it(metalsim, tmp_path,
                                                                                              monkeypatch):
    # Two processes, one cache: A builds the whole library (its metadata: the attribute indices
    # written as named constants read back from the library); B, which checked the cache before
    # A finished, stages the same text and writes the staged metadata (those indices still names)
    # after it. A third load must still get A's resolved indices, not B's names.
    import importlib
    build = importlib.import_module(metalsim.__name__ + "._build")
    monkeypatch.setenv("TORCH_QMM_METALSIM_CACHE", str(tmp_path))
    src = ("#include <metal_stdlib>\nusing namespace metal;\nconstant constexpr int OUT = 2;\n"
           "kernel void k(device float* y [[buffer(OUT)]], uint i [[thread_position_in_grid]]) { y[i] = 5; }\n")
    staged = build.stage(src, None, {}, ())
    unresolved = (tmp_path / f"{staged.key}.json").read_text()
    assert '"index": "OUT"' in unresolved  # the staged metadata holds the name
    build.build(staged, None, False)
    (tmp_path / f"{staged.key}.json").write_text(unresolved)  # B's stage(), written after A's build
    _, meta = build.build(build.stage(src, None, {}, ()), None, False)
    assert [p["index"] for p in meta["kernels"][0]["params"] if p["kind"] == "buffer"] == [2]
    y = np.zeros(4, dtype=np.float32)
    metalsim.compile(src).dispatch("k", buffers={2: y}, threadgroups=1, threads_per_threadgroup=4)
    np.testing.assert_array_equal(y, 5)
