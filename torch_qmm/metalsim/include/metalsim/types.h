// Scalar, vector and packed types; value conversions; as_type; numeric_limits; traits.
#pragma once

typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));

#define MSIM_VEC_TYPES(T)       \
  typedef vec<T, 2> T##2;       \
  typedef vec<T, 3> T##3;       \
  typedef vec<T, 4> T##4;       \
  typedef vec<T, 8> T##8;       \
  typedef vec<T, 16> T##16;
MSIM_VEC_TYPES(char)
MSIM_VEC_TYPES(uchar)
MSIM_VEC_TYPES(short)
MSIM_VEC_TYPES(ushort)
MSIM_VEC_TYPES(int)
MSIM_VEC_TYPES(uint)
MSIM_VEC_TYPES(long)
MSIM_VEC_TYPES(ulong)
MSIM_VEC_TYPES(half)
MSIM_VEC_TYPES(float)
MSIM_VEC_TYPES(bfloat)

// ---- bool vectors: one byte per element with the size and alignment of the char vectors
// (MSL: bool2 is 2 bytes, bool3 and bool4 are 4), components .x .y .z .w / .r .g .b .a and [i].
// clang's own bool vectors (vec<bool, N>) pack one bit per element, so they are not used.
template <int N> struct alignas(N) __msim_bool_elems { bool __e[N]; };
template <> struct alignas(2) __msim_bool_elems<2> {
  union { bool __e[2]; struct { bool x, y; }; struct { bool r, g; }; };
};
template <> struct alignas(4) __msim_bool_elems<3> {
  union { bool __e[4]; struct { bool x, y, z; }; struct { bool r, g, b; }; };
};
template <> struct alignas(4) __msim_bool_elems<4> {
  union { bool __e[4]; struct { bool x, y, z, w; }; struct { bool r, g, b, a; }; };
};
template <int N> struct __msim_boolvec : __msim_bool_elems<N> {
  MSIM_INLINE __msim_boolvec() = default;
  MSIM_INLINE __msim_boolvec(bool b) { for (int i = 0; i < N; i++) this->__e[i] = b; }
  // comparison masks (clang's vector comparisons give intN) and other vectors: nonzero is true
  template <class T> MSIM_INLINE __msim_boolvec(vec<T, N> v) {
    for (int i = 0; i < N; i++) this->__e[i] = v[i] != 0;
  }
  template <class A0, class A1, class... A, std::enable_if_t<2 + sizeof...(A) == N, int> = 0>
  MSIM_INLINE __msim_boolvec(A0 a0, A1 a1, A... a) {
    bool v[N] = {bool(a0), bool(a1), bool(a)...};
    for (int i = 0; i < N; i++) this->__e[i] = v[i];
  }
  MSIM_INLINE bool &operator[](int i) { return this->__e[i]; }
  MSIM_INLINE const bool &operator[](int i) const { return this->__e[i]; }
  MSIM_INLINE __msim_boolvec operator!() const { __msim_boolvec r; for (int i = 0; i < N; i++) r[i] = !(*this)[i]; return r; }
#define MSIM_BOOLVEC_OP(op)                                                                                 \
  friend MSIM_INLINE __msim_boolvec operator op(__msim_boolvec p, __msim_boolvec q) {                      \
    __msim_boolvec r; for (int i = 0; i < N; i++) r[i] = p[i] op q[i]; return r;                           \
  }
  MSIM_BOOLVEC_OP(&&) MSIM_BOOLVEC_OP(||) MSIM_BOOLVEC_OP(==) MSIM_BOOLVEC_OP(!=) MSIM_BOOLVEC_OP(&)
  MSIM_BOOLVEC_OP(|) MSIM_BOOLVEC_OP(^)
#undef MSIM_BOOLVEC_OP
};
typedef __msim_boolvec<2> bool2;
typedef __msim_boolvec<3> bool3;
typedef __msim_boolvec<4> bool4;
typedef __msim_boolvec<8> bool8;
typedef __msim_boolvec<16> bool16;
static_assert(sizeof(bool2) == 2 && sizeof(bool3) == 4 && alignof(bool3) == 4 && sizeof(bool4) == 4, "bool vectors");

// ---- matrices: C columns of R-element vectors (MSL's floatCxR / halfCxR) ----
template <class T, int C, int R> struct matrix {
  vec<T, R> columns[C];
  MSIM_INLINE vec<T, R> &operator[](int i) { return columns[i]; }
  MSIM_INLINE const vec<T, R> &operator[](int i) const { return columns[i]; }
};
#define MSIM_MATRIX_TYPES(T)                                                                   \
  typedef matrix<T, 2, 2> T##2x2; typedef matrix<T, 2, 3> T##2x3; typedef matrix<T, 2, 4> T##2x4; \
  typedef matrix<T, 3, 2> T##3x2; typedef matrix<T, 3, 3> T##3x3; typedef matrix<T, 3, 4> T##3x4; \
  typedef matrix<T, 4, 2> T##4x2; typedef matrix<T, 4, 3> T##4x3; typedef matrix<T, 4, 4> T##4x4;
MSIM_MATRIX_TYPES(float)
MSIM_MATRIX_TYPES(half)

// ---- element info for scalars, vectors and packed types ----
template <class T> struct __msim_vinfo { using elem = T; static constexpr int n = 1; static constexpr bool is_vec = false; };
template <class T, int N> struct __msim_vinfo<vec<T, N>> { using elem = T; static constexpr int n = N; static constexpr bool is_vec = true; };
template <class T> struct __msim_vinfo<const T> : __msim_vinfo<T> {};
template <int N> struct __msim_vinfo<__msim_boolvec<N>> { using elem = bool; static constexpr int n = N; static constexpr bool is_vec = true; };

// packed 3-vectors: 3 elements, element alignment (packed 2/4-vectors are aligned typedefs)
template <class T> struct __msim_packed3 {
  T x, y, z;
  MSIM_INLINE T &operator[](int i) { return (&x)[i]; }
  MSIM_INLINE const T &operator[](int i) const { return (&x)[i]; }
  MSIM_INLINE operator vec<T, 3>() const { return vec<T, 3>{x, y, z}; }
  MSIM_INLINE __msim_packed3 &operator=(vec<T, 3> v) { x = v.x; y = v.y; z = v.z; return *this; }
  MSIM_INLINE vec<T, 2> xy() const { return vec<T, 2>{x, y}; }
};
template <class T> struct __msim_vinfo<__msim_packed3<T>> { using elem = T; static constexpr int n = 3; static constexpr bool is_vec = true; };

#define MSIM_PACKED(T)                                                                 \
  typedef T packed_##T##2 __attribute__((ext_vector_type(2), aligned(sizeof(T))));    \
  typedef T packed_##T##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));    \
  typedef __msim_packed3<T> packed_##T##3;
MSIM_PACKED(char)
MSIM_PACKED(uchar)
MSIM_PACKED(short)
MSIM_PACKED(ushort)
MSIM_PACKED(int)
MSIM_PACKED(uint)
MSIM_PACKED(half)
MSIM_PACKED(float)
MSIM_PACKED(bfloat)
static_assert(sizeof(packed_float3) == 12 && alignof(packed_float4) == 4, "packed types");

// ---- value conversions: Metal's float4(h4), float4(a, b, c, d), float4(v.xy, 0, 1) ----
// Staging rewrites T(...), (T)x and static_cast<T>(x) for vector types T into __msim_make<T>(...)
// because a clang C-style vector cast is a bitcast while Metal's converts values.
// Arguments are taken by value: a device/threadgroup lvalue (`float4(p[i])`) is loaded first.
// half <-> bfloat goes through float (exact), which clang's own cast does not allow.
template <class E, class A> MSIM_INLINE E __msim_cvt(A a) {
  if constexpr ((std::is_same<E, bfloat>::value && std::is_same<A, half>::value) ||
                (std::is_same<E, half>::value && std::is_same<A, bfloat>::value))
    return static_cast<E>(static_cast<float>(a));
  else
    return static_cast<E>(a);
}
template <class E, class A> MSIM_INLINE void __msim_put(E *dst, int &k, A a) {
  using I = __msim_vinfo<A>;
  if constexpr (I::is_vec) {
    for (int j = 0; j < I::n; j++) dst[k++] = __msim_cvt<E>(a[j]);
  } else {
    dst[k++] = __msim_cvt<E>(a);
  }
}
template <class V, class... A> MSIM_INLINE V __msim_make(A... a) {
  using I = __msim_vinfo<V>;
  using E = typename I::elem;
  if constexpr (!I::is_vec) {
    static_assert(sizeof...(A) == 1, "scalar conversion takes one argument");
    return __msim_cvt<V>((a, ...));
  } else if constexpr (sizeof...(A) == 0) {
    V r{};
    return r;
  } else {
    constexpr int given = (0 + ... + __msim_vinfo<A>::n);
    E tmp[I::n > given ? I::n : given];
    int k = 0;
    (__msim_put<E>(tmp, k, a), ...);
    if constexpr (given == 1) {
      for (int i = 1; i < I::n; i++) tmp[i] = tmp[0];
    } else {
      static_assert(given == I::n, "vector constructor: wrong number of components");
    }
    V r;
    for (int i = 0; i < I::n; i++) r[i] = tmp[i];
    return r;
  }
}

// Casts whose type is a name (a template parameter, an alias) or the scalar `bfloat`/`half`:
// Metal converts half <-> bfloat explicitly and vectors by value, whatever spells the type.
// static_cast<T>(x) becomes __msim_cast<T>(x); the functional and C-style casts T(x) and (T)x
// become __msim_ccast<T>(x), which otherwise keeps the C-style cast's meaning (it may also
// reinterpret a pointer).
template <class T> struct __msim_unqual { using type = std::remove_cv_t<T>; };
template <class T> struct __msim_unqual<device T> : __msim_unqual<T> {};
template <class T> struct __msim_unqual<constant T> : __msim_unqual<T> {};
template <class T> struct __msim_unqual<threadgroup T> : __msim_unqual<T> {};
template <class To, bool CStyle, class F> MSIM_INLINE constexpr To __msim_cast_value(F f) {
  using T = typename __msim_unqual<To>::type;
  if constexpr (!std::is_reference_v<To> && __msim_vinfo<T>::is_vec &&
                (__msim_vinfo<F>::is_vec || std::is_arithmetic_v<F> || std::is_same_v<F, half> ||
                 std::is_same_v<F, bfloat>))
    return __msim_make<T>(f);
  else if constexpr ((std::is_same_v<T, bfloat> && std::is_same_v<F, half>) ||
                     (std::is_same_v<T, half> && std::is_same_v<F, bfloat>))
    return static_cast<To>(static_cast<float>(f));
  else if constexpr (CStyle)
    return (To)f;
  else
    return static_cast<To>(f);
}
// scalars, vectors (whose elements cannot bind to references), enums and pointers by value;
// class objects forwarded as they are
template <class From> inline constexpr bool __msim_is_class_arg =
    std::is_class_v<typename __msim_unqual<std::remove_reference_t<From>>::type>;
template <class To, class From>
MSIM_INLINE constexpr std::enable_if_t<!__msim_is_class_arg<From>, To> __msim_cast(From f) {
  return __msim_cast_value<To, false, typename __msim_unqual<From>::type>(f);
}
template <class To, class From>
MSIM_INLINE constexpr std::enable_if_t<__msim_is_class_arg<From>, To> __msim_cast(From &&f) {
  return static_cast<To>(static_cast<From &&>(f));
}
// a reference type is cast on the object itself, as the C-style cast does
template <class To, class From>
MSIM_INLINE constexpr std::enable_if_t<!__msim_is_class_arg<From> && !std::is_reference_v<To>, To>
__msim_ccast(From f) {
  return __msim_cast_value<To, true, typename __msim_unqual<From>::type>(f);
}
template <class To, class From>
MSIM_INLINE constexpr std::enable_if_t<__msim_is_class_arg<From> || std::is_reference_v<To>, To>
__msim_ccast(From &&f) {
  return (To)(static_cast<From &&>(f));
}

// T(a, b, ...) with T a name the source declares as a type (template parameter, alias)
// becomes __msim_ctor<T>(a, b, ...): a vector is built like float2(a, b), anything else is
// constructed as written.
template <class T, class... A> MSIM_INLINE constexpr T __msim_ctor(A &&...a) {
  if constexpr (__msim_vinfo<T>::is_vec)
    return __msim_make<T>(a...);
  else
    return T(static_cast<A &&>(a)...);
}

// ---- as_type: reinterpret the bits ----
template <class T, class U> MSIM_INLINE T as_type(const U &u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T t;
  __builtin_memcpy(&t, &u, sizeof(T));
  return t;
}

// bfloat conversion helper missing from Debian's libgcc 12 (round to nearest even)
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  uint16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) h = (uint16_t)((u >> 16) | 0x40u);
  else h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  __bf16 r;
  __builtin_memcpy(&r, &h, 2);
  return r;
}

namespace metal {
using ::half;
using ::bfloat;
using ::as_type;
using ::vec;
using ::matrix;

// ---- type traits: std's, with half and bfloat added where std lacks them ----
using std::integral_constant;
using std::true_type;
using std::false_type;
using std::bool_constant;
using std::is_same;
using std::enable_if;
using std::enable_if_t;
using std::conditional;
using std::conditional_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_const;
using std::remove_const_t;
using std::remove_reference;
using std::remove_reference_t;
using std::remove_pointer;
using std::remove_pointer_t;
using std::decay;
using std::decay_t;
using std::is_integral;
using std::is_integral_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::is_pointer;
using std::is_pointer_v;
using std::is_convertible;
using std::is_convertible_v;
using std::make_unsigned;
using std::make_unsigned_t;
using std::make_signed;
using std::make_signed_t;
using std::is_class;
using std::is_void;
using std::is_const;
using std::declval;
using std::is_trivially_copyable;
template <class T, class U> inline constexpr bool is_same_v = std::is_same<T, U>::value;
template <class T> struct is_floating_point : std::is_floating_point<T> {};
template <> struct is_floating_point<half> : true_type {};
template <> struct is_floating_point<bfloat> : true_type {};
template <class T> struct is_floating_point<const T> : is_floating_point<T> {};
template <class T> inline constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_arithmetic : bool_constant<std::is_arithmetic<T>::value || is_floating_point<T>::value> {};
template <class T> inline constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_scalar : bool_constant<std::is_scalar<T>::value || is_floating_point<T>::value> {};
template <class T> inline constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_signed : bool_constant<std::is_signed<T>::value || is_floating_point<T>::value> {};
template <class T> inline constexpr bool is_signed_v = is_signed<T>::value;
template <class T> struct is_vector : bool_constant<__msim_vinfo<T>::is_vec> {};
template <class T> inline constexpr bool is_vector_v = is_vector<T>::value;
template <class T> struct vec_elements : integral_constant<int, __msim_vinfo<T>::n> {};
template <class T> inline constexpr int vec_elements_v = vec_elements<T>::value;
template <class T> struct make_scalar { using type = typename __msim_vinfo<T>::elem; };
template <class T> using make_scalar_t = typename make_scalar<T>::type;
// remove_addrspace: the type with its address space qualifier removed
template <class T> struct remove_addrspace { using type = T; };
template <class T> struct remove_addrspace<device T> { using type = T; };
template <class T> struct remove_addrspace<constant T> { using type = T; };
template <class T> struct remove_addrspace<threadgroup T> { using type = T; };
template <class T> using remove_addrspace_t = typename remove_addrspace<T>::type;

// ---- numeric_limits ----
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true,
                        has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half denorm_min() { return (half)5.9604644775390625e-08f; }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true,
                        has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return (bfloat)1.17549435e-38f; }
  static constexpr bfloat max() { return (bfloat)3.38953139e38f; }
  static constexpr bfloat lowest() { return (bfloat)-3.38953139e38f; }
  static constexpr bfloat epsilon() { return (bfloat)0.0078125f; }
  static constexpr bfloat infinity() { return (bfloat)__builtin_inff(); }
  static constexpr bfloat quiet_NaN() { return (bfloat)__builtin_nanf(""); }
  static constexpr bfloat denorm_min() { return (bfloat)9.18354962e-41f; }
};
template <class T> struct numeric_limits<const T> : numeric_limits<T> {};

// small utilities some kernels use
template <class T, size_t N> struct array {
  T _v[N];
  MSIM_INLINE T &operator[](size_t i) { return _v[i]; }
  MSIM_INLINE const T &operator[](size_t i) const { return _v[i]; }
  static constexpr size_t size() { return N; }
};
template <class A, class B> struct pair { A first; B second; };

// uniform<T>: a value the same in every thread (a hint to Apple's compiler; a plain value here)
template <class T> struct uniform {
  T value;
  MSIM_INLINE constexpr uniform() = default;
  MSIM_INLINE constexpr uniform(T v) : value(v) {}
  MSIM_INLINE constexpr operator T() const { return value; }
  template <class U> MSIM_INLINE uniform &operator=(U v) { value = static_cast<T>(v); return *this; }
  template <class U> MSIM_INLINE uniform &operator+=(U v) { value += v; return *this; }
  template <class U> MSIM_INLINE uniform &operator-=(U v) { value -= v; return *this; }
  template <class U> MSIM_INLINE uniform &operator*=(U v) { value *= v; return *this; }
  MSIM_INLINE uniform &operator++() { ++value; return *this; }
  MSIM_INLINE T operator++(int) { return value++; }
};
template <class T> MSIM_INLINE constexpr uniform<T> make_uniform(T v) { return uniform<T>(v); }
}  // namespace metal
