// metal:: math, common, integer, relational and geometric functions, plus the
// precise:: and fast:: namespaces (both map to the same correctly rounded code here).
// half functions evaluate in float and round once, like Metal's precise forms.
// Metal's library has float and half overloads only: a bfloat argument converts to float
// and the result is a float (so `bfloat y = exp(x);` is an implicit float -> bfloat
// conversion, which Metal rejects). The bfloat overloads here are templates that model this:
// they return float, and a user's own non-template bfloat overload (as MLX's bf16_math.h
// defines in namespace metal) is preferred over them instead of colliding.
#pragma once

namespace metal {

#define MSIM_FLOATS(X) X(float) X(half)
// template parameter list of the bfloat overloads
#define MSIM_BF template <class T, std::enable_if_t<std::is_same<T, bfloat>::value, int> = 0>
#define MSIM_INTS(X) X(char) X(signed char) X(uchar) X(short) X(ushort) X(int) X(uint) X(long) X(ulong) X(long long) X(unsigned long long)
#define MSIM_ALL(X) MSIM_FLOATS(X) MSIM_INTS(X)

// elementwise lifting to vectors
#define MSIM_VEC1(name)                                                                   \
  template <class T, int N> MSIM_INLINE vec<T, N> name(vec<T, N> x) {                     \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; i++) r[i] = static_cast<T>(name(static_cast<T>(x[i])));           \
    return r;                                                                             \
  }
#define MSIM_VEC2(name)                                                                   \
  template <class T, int N> MSIM_INLINE vec<T, N> name(vec<T, N> x, vec<T, N> y) {        \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; i++) r[i] = static_cast<T>(name(static_cast<T>(x[i]), static_cast<T>(y[i]))); \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N> MSIM_INLINE vec<T, N> name(vec<T, N> x, T y) {                \
    return name(x, vec<T, N>(y));                                                         \
  }
#define MSIM_VEC3(name)                                                                           \
  template <class T, int N> MSIM_INLINE vec<T, N> name(vec<T, N> x, vec<T, N> y, vec<T, N> z) {   \
    vec<T, N> r;                                                                                  \
    for (int i = 0; i < N; i++)                                                                   \
      r[i] = static_cast<T>(name(static_cast<T>(x[i]), static_cast<T>(y[i]), static_cast<T>(z[i]))); \
    return r;                                                                                     \
  }                                                                                               \
  template <class T, int N> MSIM_INLINE vec<T, N> name(vec<T, N> x, T y, T z) {                   \
    return name(x, vec<T, N>(y), vec<T, N>(z));                                                   \
  }                                                                                               \
  template <class T, int N> MSIM_INLINE vec<T, N> name(vec<T, N> x, vec<T, N> y, T z) {           \
    return name(x, y, vec<T, N>(z));                                                              \
  }

// float functions: float via libm, half/bfloat through float with one rounding
#define MSIM_F1(name, fn)                                                        \
  MSIM_INLINE float name(float x) { return fn(x); }                             \
  MSIM_INLINE half name(half x) { return (half)fn((float)x); }                  \
  MSIM_BF MSIM_INLINE float name(T x) { return fn((float)x); }                   \
  MSIM_VEC1(name)
#define MSIM_F2(name, fn)                                                                  \
  MSIM_INLINE float name(float x, float y) { return fn(x, y); }                           \
  MSIM_INLINE half name(half x, half y) { return (half)fn((float)x, (float)y); }          \
  MSIM_BF MSIM_INLINE float name(T x, T y) { return fn((float)x, (float)y); }            \
  MSIM_VEC2(name)

MSIM_INLINE float __rsqrtf(float x) { return 1.0f / __builtin_sqrtf(x); }
MSIM_INLINE float __fractf(float x) { return __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f); }
MSIM_INLINE float __exp10f(float x) { return __builtin_powf(10.0f, x); }
MSIM_INLINE float __sinpif(float x) { return __builtin_sinf(x * 3.14159265358979323846f); }
MSIM_INLINE float __cospif(float x) { return __builtin_cosf(x * 3.14159265358979323846f); }
MSIM_INLINE float __tanpif(float x) { return __builtin_tanf(x * 3.14159265358979323846f); }
MSIM_INLINE float __saturatef(float x) { return __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f); }
MSIM_INLINE float __signf(float x) { return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : (x != x ? 0.0f : x); }
MSIM_INLINE float __divf(float x, float y) { return x / y; }
MSIM_INLINE float __stepf(float e, float x) { return x < e ? 0.0f : 1.0f; }
MSIM_INLINE float __powrf(float x, float y) { return __builtin_powf(x, y); }

MSIM_F1(exp, __builtin_expf)
MSIM_F1(exp2, __builtin_exp2f)
MSIM_F1(exp10, __exp10f)
MSIM_F1(log, __builtin_logf)
MSIM_F1(log2, __builtin_log2f)
MSIM_F1(log10, __builtin_log10f)
MSIM_F1(sqrt, __builtin_sqrtf)
MSIM_F1(rsqrt, __rsqrtf)
MSIM_F1(sin, __builtin_sinf)
MSIM_F1(cos, __builtin_cosf)
MSIM_F1(tan, __builtin_tanf)
MSIM_F1(asin, __builtin_asinf)
MSIM_F1(acos, __builtin_acosf)
MSIM_F1(atan, __builtin_atanf)
MSIM_F1(sinh, __builtin_sinhf)
MSIM_F1(cosh, __builtin_coshf)
MSIM_F1(tanh, __builtin_tanhf)
MSIM_F1(asinh, __builtin_asinhf)
MSIM_F1(acosh, __builtin_acoshf)
MSIM_F1(atanh, __builtin_atanhf)
MSIM_F1(sinpi, __sinpif)
MSIM_F1(cospi, __cospif)
MSIM_F1(tanpi, __tanpif)
MSIM_F1(floor, __builtin_floorf)
MSIM_F1(ceil, __builtin_ceilf)
MSIM_F1(trunc, __builtin_truncf)
MSIM_F1(round, __builtin_roundf)
MSIM_F1(rint, __builtin_rintf)
MSIM_F1(fract, __fractf)
MSIM_F1(fabs, __builtin_fabsf)
MSIM_F1(saturate, __saturatef)
MSIM_F1(sign, __signf)
MSIM_F2(pow, __builtin_powf)
MSIM_F2(powr, __powrf)
MSIM_F2(atan2, __builtin_atan2f)
MSIM_F2(fmod, __builtin_fmodf)
MSIM_F2(fmin, __builtin_fminf)
MSIM_F2(fmax, __builtin_fmaxf)
MSIM_F2(copysign, __builtin_copysignf)
MSIM_F2(divide, __divf)
MSIM_F2(step, __stepf)
MSIM_F2(fdim, __builtin_fdimf)
MSIM_F2(nextafter, __builtin_nextafterf)

MSIM_INLINE float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
MSIM_INLINE half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
MSIM_BF MSIM_INLINE float fma(T a, T b, T c) { return __builtin_fmaf((float)a, (float)b, (float)c); }
MSIM_VEC3(fma)
MSIM_INLINE float mad(float a, float b, float c) { return a * b + c; }
MSIM_INLINE half mad(half a, half b, half c) { return a * b + c; }
MSIM_VEC3(mad)
MSIM_INLINE float ldexp(float x, int e) { return __builtin_ldexpf(x, e); }
MSIM_INLINE half ldexp(half x, int e) { return (half)__builtin_ldexpf((float)x, e); }
MSIM_BF MSIM_INLINE float ldexp(T x, int e) { return __builtin_ldexpf((float)x, e); }

// abs / min / max / clamp for every scalar type
#define MSIM_ABS(T) MSIM_INLINE T abs(T x) { return x < (T)0 ? (T)-x : x; }
MSIM_FLOATS(MSIM_ABS)
MSIM_BF MSIM_INLINE float abs(T x) { return __builtin_fabsf((float)x); }
MSIM_ABS(char) MSIM_ABS(signed char) MSIM_ABS(short) MSIM_ABS(int) MSIM_ABS(long) MSIM_ABS(long long)
#define MSIM_UABS(T) MSIM_INLINE T abs(T x) { return x; }
MSIM_UABS(uchar) MSIM_UABS(ushort) MSIM_UABS(uint) MSIM_UABS(ulong) MSIM_UABS(unsigned long long)
MSIM_VEC1(abs)
// Metal's min/max on floats behave like fmin/fmax (a NaN operand yields the other one)
#define MSIM_MINMAX(T)                                                                \
  MSIM_INLINE T min(T a, T b) {                                                       \
    if constexpr (is_floating_point<T>::value) { if (a != a) return b; if (b != b) return a; } \
    return b < a ? b : a;                                                             \
  }                                                                                   \
  MSIM_INLINE T max(T a, T b) {                                                       \
    if constexpr (is_floating_point<T>::value) { if (a != a) return b; if (b != b) return a; } \
    return a < b ? b : a;                                                             \
  }                                                                                   \
  MSIM_INLINE T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }               \
  MSIM_INLINE T min3(T a, T b, T c) { return min(min(a, b), c); }                    \
  MSIM_INLINE T max3(T a, T b, T c) { return max(max(a, b), c); }                    \
  MSIM_INLINE T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
MSIM_ALL(MSIM_MINMAX)
MSIM_BF MSIM_INLINE float min(T a, T b) { return min((float)a, (float)b); }
MSIM_BF MSIM_INLINE float max(T a, T b) { return max((float)a, (float)b); }
MSIM_BF MSIM_INLINE float clamp(T x, T lo, T hi) { return clamp((float)x, (float)lo, (float)hi); }
MSIM_BF MSIM_INLINE float min3(T a, T b, T c) { return min3((float)a, (float)b, (float)c); }
MSIM_BF MSIM_INLINE float max3(T a, T b, T c) { return max3((float)a, (float)b, (float)c); }
MSIM_BF MSIM_INLINE float median3(T a, T b, T c) { return median3((float)a, (float)b, (float)c); }
#define MSIM_F3(name, fn)                                                                \
  MSIM_INLINE float name(float a, float b, float c) { return fn(a, b, c); }             \
  MSIM_INLINE half name(half a, half b, half c) { return (half)fn((float)a, (float)b, (float)c); } \
  MSIM_BF MSIM_INLINE float name(T a, T b, T c) { return fn((float)a, (float)b, (float)c); } \
  MSIM_VEC3(name)
MSIM_INLINE float __fmax3f(float a, float b, float c) { return __builtin_fmaxf(__builtin_fmaxf(a, b), c); }
MSIM_INLINE float __fmin3f(float a, float b, float c) { return __builtin_fminf(__builtin_fminf(a, b), c); }
MSIM_INLINE float __fmedian3f(float a, float b, float c) {
  return __builtin_fmaxf(__builtin_fminf(a, b), __builtin_fminf(__builtin_fmaxf(a, b), c));
}
MSIM_F3(fmax3, __fmax3f)
MSIM_F3(fmin3, __fmin3f)
MSIM_F3(fmedian3, __fmedian3f)
MSIM_INLINE float frexp(float x, thread int &e) { return __builtin_frexpf(x, &e); }
MSIM_INLINE half frexp(half x, thread int &e) { return (half)__builtin_frexpf((float)x, &e); }
MSIM_BF MSIM_INLINE float frexp(T x, thread int &e) { return __builtin_frexpf((float)x, &e); }
// sincos returns the sine and stores the cosine; modf returns the fractional part and stores
// the integral part (both in thread memory, as MSL declares them)
MSIM_INLINE float sincos(float x, thread float &c) { c = __builtin_cosf(x); return __builtin_sinf(x); }
MSIM_INLINE half sincos(half x, thread half &c) {
  c = (half)__builtin_cosf((float)x);
  return (half)__builtin_sinf((float)x);
}
template <class T, int N> MSIM_INLINE vec<T, N> sincos(vec<T, N> x, thread vec<T, N> &c) {
  vec<T, N> s;
  for (int i = 0; i < N; i++) { T ci; s[i] = sincos(static_cast<T>(x[i]), ci); c[i] = ci; }
  return s;
}
MSIM_INLINE float modf(float x, thread float &ip) { return __builtin_modff(x, &ip); }
MSIM_INLINE half modf(half x, thread half &ip) {
  float f;
  float r = __builtin_modff((float)x, &f);
  ip = (half)f;
  return (half)r;
}
template <class T, int N> MSIM_INLINE vec<T, N> modf(vec<T, N> x, thread vec<T, N> &ip) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) { T p; r[i] = modf(static_cast<T>(x[i]), p); ip[i] = p; }
  return r;
}
MSIM_VEC2(min)
MSIM_VEC2(max)
MSIM_VEC3(clamp)

// mix, smoothstep
#define MSIM_MIX(T) MSIM_INLINE T mix(T x, T y, T a) { return x + (y - x) * a; }
MSIM_FLOATS(MSIM_MIX)
MSIM_BF MSIM_INLINE float mix(T x, T y, T a) { return mix((float)x, (float)y, (float)a); }
MSIM_VEC3(mix)
#define MSIM_SMOOTH(T)                                                                   \
  MSIM_INLINE T smoothstep(T e0, T e1, T x) {                                            \
    float t = __saturatef(((float)x - (float)e0) / ((float)e1 - (float)e0));            \
    return (T)(t * t * (3.0f - 2.0f * t));                                               \
  }
MSIM_FLOATS(MSIM_SMOOTH)
MSIM_VEC3(smoothstep)

// relational
#define MSIM_REL(T)                                                                    \
  MSIM_INLINE bool isnan(T x) { return x != x; }                                       \
  MSIM_INLINE bool isinf(T x) { return __builtin_isinf((float)x); }                    \
  MSIM_INLINE bool isfinite(T x) { return __builtin_isfinite((float)x); }              \
  MSIM_INLINE bool isnormal(T x) { return __builtin_isnormal(x); }                     \
  MSIM_INLINE bool signbit(T x) { return __builtin_signbit((float)x); }
MSIM_FLOATS(MSIM_REL)
MSIM_BF MSIM_INLINE bool isnan(T x) { return x != x; }
MSIM_BF MSIM_INLINE bool isinf(T x) { return __builtin_isinf((float)x); }
MSIM_BF MSIM_INLINE bool isfinite(T x) { return __builtin_isfinite((float)x); }
MSIM_BF MSIM_INLINE bool signbit(T x) { return __builtin_signbit((float)x); }
#define MSIM_RELV(name)                                                        \
  template <class T, int N> MSIM_INLINE __msim_boolvec<N> name(vec<T, N> x) { \
    __msim_boolvec<N> r;                                                      \
    for (int i = 0; i < N; i++) r[i] = name(static_cast<T>(x[i]));           \
    return r;                                                                 \
  }
// isordered / isunordered: both operands are numbers / at least one is NaN
#define MSIM_ORD(T)                                                                      \
  MSIM_INLINE bool isordered(T x, T y) { return x == x && y == y; }                      \
  MSIM_INLINE bool isunordered(T x, T y) { return x != x || y != y; }
MSIM_FLOATS(MSIM_ORD)
MSIM_BF MSIM_INLINE bool isordered(T x, T y) { return x == x && y == y; }
MSIM_BF MSIM_INLINE bool isunordered(T x, T y) { return x != x || y != y; }
#define MSIM_ORDV(name)                                                           \
  template <class T, int N> MSIM_INLINE __msim_boolvec<N> name(vec<T, N> x, vec<T, N> y) { \
    __msim_boolvec<N> r;                                                          \
    for (int i = 0; i < N; i++) r[i] = name(static_cast<T>(x[i]), static_cast<T>(y[i])); \
    return r;                                                                     \
  }
MSIM_ORDV(isordered)
MSIM_ORDV(isunordered)
MSIM_RELV(isnan)
MSIM_RELV(isinf)
MSIM_RELV(isfinite)
MSIM_RELV(signbit)
MSIM_INLINE bool all(bool b) { return b; }
MSIM_INLINE bool any(bool b) { return b; }
template <class T, int N> MSIM_INLINE bool all(vec<T, N> v) {
  for (int i = 0; i < N; i++) if (!v[i]) return false;
  return true;
}
template <class T, int N> MSIM_INLINE bool any(vec<T, N> v) {
  for (int i = 0; i < N; i++) if (v[i]) return true;
  return false;
}
template <int N> MSIM_INLINE bool all(__msim_boolvec<N> v) {
  for (int i = 0; i < N; i++) if (!v[i]) return false;
  return true;
}
template <int N> MSIM_INLINE bool any(__msim_boolvec<N> v) {
  for (int i = 0; i < N; i++) if (v[i]) return true;
  return false;
}
template <class T> MSIM_INLINE T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> MSIM_INLINE vec<T, N> select(vec<T, N> a, vec<T, N> b, __msim_boolvec<N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <int N> MSIM_INLINE __msim_boolvec<N> select(__msim_boolvec<N> a, __msim_boolvec<N> b, __msim_boolvec<N> c) {
  __msim_boolvec<N> r;
  for (int i = 0; i < N; i++) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N, class C> MSIM_INLINE vec<T, N> select(vec<T, N> a, vec<T, N> b, vec<C, N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = c[i] ? b[i] : a[i];
  return r;
}

// geometric
template <class T, int N> MSIM_INLINE T dot(vec<T, N> a, vec<T, N> b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; i++) s += a[i] * b[i];
  return s;
}
template <class T, int N> MSIM_INLINE T length_squared(vec<T, N> a) { return dot(a, a); }
template <class T, int N> MSIM_INLINE T length(vec<T, N> a) { return sqrt(dot(a, a)); }
template <class T, int N> MSIM_INLINE T distance(vec<T, N> a, vec<T, N> b) { return length(a - b); }
template <class T, int N> MSIM_INLINE vec<T, N> normalize(vec<T, N> a) { return a * rsqrt(dot(a, a)); }
template <class T> MSIM_INLINE vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) {
  return vec<T, 3>{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}

// integer
template <class T> MSIM_INLINE T popcount(T x) {
  if constexpr (__msim_vinfo<T>::is_vec) { T r; for (int i = 0; i < __msim_vinfo<T>::n; i++) r[i] = popcount(x[i]); return r; }
  else return (T)__builtin_popcountll((unsigned long long)(std::make_unsigned_t<T>)x);
}
template <class T> MSIM_INLINE T clz(T x) {
  using U = std::make_unsigned_t<T>;
  if (!x) return (T)(sizeof(T) * 8);
  return (T)(__builtin_clzll((unsigned long long)(U)x) - (64 - sizeof(T) * 8));
}
template <class T> MSIM_INLINE T ctz(T x) { return x ? (T)__builtin_ctzll((unsigned long long)x) : (T)(sizeof(T) * 8); }
template <class T> MSIM_INLINE T reverse_bits(T x) {
  using U = std::make_unsigned_t<T>;
  U u = (U)x, r = 0;
  for (unsigned i = 0; i < sizeof(T) * 8; i++) { r = (U)((r << 1) | (u & 1)); u >>= 1; }
  return (T)r;
}
template <class T> MSIM_INLINE T extract_bits(T x, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return 0;
  U v = (U)((U)x >> offset);
  if (bits < sizeof(T) * 8) v &= (U)((U(1) << bits) - 1);
  if constexpr (std::is_signed<T>::value) {
    if (bits < sizeof(T) * 8 && (v >> (bits - 1)) & 1) v |= (U)(~U(0) << bits);
  }
  return (T)v;
}
template <class T> MSIM_INLINE T insert_bits(T base, T insert, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  U mask = bits >= sizeof(T) * 8 ? ~U(0) : (U)((U(1) << bits) - 1);
  return (T)(((U)base & ~(U)(mask << offset)) | (((U)insert & mask) << offset));
}
template <class T> MSIM_INLINE T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 8) return (T)(((__int128)a * (__int128)b) >> 64);
  else return (T)(((long long)a * (long long)b) >> (sizeof(T) * 8));
}
template <class T> MSIM_INLINE T absdiff(T a, T b) { return a > b ? a - b : b - a; }
template <class T> MSIM_INLINE T hadd(T a, T b) { return (T)(((long long)a + (long long)b) >> 1); }
template <class T> MSIM_INLINE T rotate(T v, T i) {
  using U = std::make_unsigned_t<T>;
  unsigned s = (unsigned)i % (sizeof(T) * 8);
  return s ? (T)(((U)v << s) | ((U)v >> (sizeof(T) * 8 - s))) : v;
}

// precise:: and fast:: declare the math functions themselves (using-declarations), so that a
// user's overload added to one of them (MLX's bfloat ones) joins the set instead of hiding it
#define MSIM_MATH_NAMES(X)                                                                         \
  X(exp) X(exp2) X(exp10) X(log) X(log2) X(log10) X(sqrt) X(rsqrt) X(sin) X(cos) X(tan) X(asin)    \
  X(acos) X(atan) X(sinh) X(cosh) X(tanh) X(asinh) X(acosh) X(atanh) X(sinpi) X(cospi) X(tanpi)    \
  X(floor) X(ceil) X(trunc) X(round) X(rint) X(fract) X(fabs) X(saturate) X(sign) X(pow) X(powr)   \
  X(atan2) X(fmod) X(fmin) X(fmax) X(copysign) X(divide) X(step) X(fdim) X(nextafter) X(fma)       \
  X(ldexp) X(frexp) X(fmax3) X(fmin3) X(fmedian3) X(abs) X(min) X(max) X(clamp) X(mix)             \
  X(smoothstep) X(isnan) X(isinf) X(isfinite) X(signbit) X(dot) X(length) X(distance) X(normalize) \
  X(sincos) X(modf)
#define MSIM_USING(name) using ::metal::name;
namespace precise { MSIM_MATH_NAMES(MSIM_USING) }
namespace fast { MSIM_MATH_NAMES(MSIM_USING) }
}  // namespace metal
