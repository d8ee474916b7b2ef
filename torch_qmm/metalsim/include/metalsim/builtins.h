// Apple's compiler-internal builtins that real Metal code calls directly (MLX's bf16_math.h:
// `__metal_exp(x, __METAL_MAYBE_FAST_MATH__)`, `__metal_simd_sum(x)`, ...). Each forwards to
// the metal:: function of the same name; the math mode argument is accepted and ignored
// (fast and precise math are the same code here).
#pragma once

#define __METAL_MAYBE_FAST_MATH__ ::__msim_math_mode::maybe_fast
#define __METAL_FAST_MATH__ ::__msim_math_mode::fast
#define __METAL_PRECISE_MATH__ ::__msim_math_mode::precise
enum class __msim_math_mode { maybe_fast, fast, precise };

// every arity with and without the trailing math-mode argument; partial ordering prefers the
// overload that takes the mode
#define MSIM_BUILTIN(name)                                                                     \
  template <class T> MSIM_INLINE auto __metal_##name(T x) { return metal::name(x); }             \
  template <class T> MSIM_INLINE auto __metal_##name(T x, __msim_math_mode) { return metal::name(x); } \
  template <class T, class U> MSIM_INLINE auto __metal_##name(T x, U y) { return metal::name(x, y); } \
  template <class T, class U> MSIM_INLINE auto __metal_##name(T x, U y, __msim_math_mode) {     \
    return metal::name(x, y);                                                                  \
  }                                                                                            \
  template <class T, class U, class V> MSIM_INLINE auto __metal_##name(T x, U y, V z) {         \
    return metal::name(x, y, z);                                                               \
  }                                                                                            \
  template <class T, class U, class V>                                                         \
  MSIM_INLINE auto __metal_##name(T x, U y, V z, __msim_math_mode) { return metal::name(x, y, z); }
MSIM_BUILTIN(fabs) MSIM_BUILTIN(acos) MSIM_BUILTIN(acosh) MSIM_BUILTIN(asin) MSIM_BUILTIN(asinh)
MSIM_BUILTIN(atan) MSIM_BUILTIN(atanh) MSIM_BUILTIN(ceil) MSIM_BUILTIN(cos) MSIM_BUILTIN(cosh)
MSIM_BUILTIN(cospi) MSIM_BUILTIN(exp) MSIM_BUILTIN(exp10) MSIM_BUILTIN(exp2) MSIM_BUILTIN(floor)
MSIM_BUILTIN(fract) MSIM_BUILTIN(log) MSIM_BUILTIN(log10) MSIM_BUILTIN(log2) MSIM_BUILTIN(rint)
MSIM_BUILTIN(round) MSIM_BUILTIN(rsqrt) MSIM_BUILTIN(sin) MSIM_BUILTIN(sinh) MSIM_BUILTIN(sinpi)
MSIM_BUILTIN(sqrt) MSIM_BUILTIN(tan) MSIM_BUILTIN(tanh) MSIM_BUILTIN(tanpi) MSIM_BUILTIN(trunc)
MSIM_BUILTIN(atan2) MSIM_BUILTIN(divide) MSIM_BUILTIN(fdim) MSIM_BUILTIN(fmax) MSIM_BUILTIN(fmin)
MSIM_BUILTIN(fmod) MSIM_BUILTIN(nextafter) MSIM_BUILTIN(pow) MSIM_BUILTIN(powr) MSIM_BUILTIN(ldexp)
MSIM_BUILTIN(fma) MSIM_BUILTIN(fmax3) MSIM_BUILTIN(fmin3) MSIM_BUILTIN(fmedian3)
template <class T> MSIM_INLINE auto __metal_frexp(T x, thread int *e) { return metal::frexp(x, *e); }

#define MSIM_SIMD_BUILTIN(name) \
  template <class... A> MSIM_COLL auto __metal_##name(A... a) { return metal::name(a...); }
MSIM_SIMD_BUILTIN(simd_sum) MSIM_SIMD_BUILTIN(simd_product) MSIM_SIMD_BUILTIN(simd_min)
MSIM_SIMD_BUILTIN(simd_max) MSIM_SIMD_BUILTIN(simd_and) MSIM_SIMD_BUILTIN(simd_or) MSIM_SIMD_BUILTIN(simd_xor)
MSIM_SIMD_BUILTIN(simd_prefix_inclusive_sum) MSIM_SIMD_BUILTIN(simd_prefix_exclusive_sum)
MSIM_SIMD_BUILTIN(simd_prefix_inclusive_product) MSIM_SIMD_BUILTIN(simd_prefix_exclusive_product)
MSIM_SIMD_BUILTIN(simd_shuffle) MSIM_SIMD_BUILTIN(simd_broadcast) MSIM_SIMD_BUILTIN(simd_shuffle_up)
MSIM_SIMD_BUILTIN(simd_shuffle_down) MSIM_SIMD_BUILTIN(simd_shuffle_xor) MSIM_SIMD_BUILTIN(simd_shuffle_rotate_up)
MSIM_SIMD_BUILTIN(simd_shuffle_rotate_down) MSIM_SIMD_BUILTIN(simd_shuffle_and_fill_up)
MSIM_SIMD_BUILTIN(simd_shuffle_and_fill_down) MSIM_SIMD_BUILTIN(simd_broadcast_first)

template <class T> MSIM_INLINE T __metal_get_simdgroup_size(T) { return (T)msim_current()->width; }
template <class T> MSIM_INLINE T __metal_get_thread_index_in_simdgroup(T) { return (T)msim_current()->lane; }
