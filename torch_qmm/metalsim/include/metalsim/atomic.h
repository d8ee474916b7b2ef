// Atomics on device and threadgroup memory (relaxed order is all Metal offers; we use
// real atomic instructions because threadgroups run in parallel on OS threads).
// In checked/counting builds each atomic reports its access to the runtime explicitly
// (the coverage hooks do not see atomic read-modify-write instructions).
#pragma once

namespace metal {

template <class T> struct atomic {
  T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

#ifdef __MSIM_INSTRUMENTED
#define MSIM_ATOMIC_HOOK(p, store) msim_access((const void *)(p), sizeof(*(p)), store, 1)
#else
#define MSIM_ATOMIC_HOOK(p, store) ((void)0)
#endif

// Every address space converts to a generic pointer here, so one overload set serves all.
template <class T> MSIM_INLINE T *__msim_av(const volatile atomic<T> *o) { return (T *)&((atomic<T> *)o)->__v; }

#define MSIM_ATOMIC_FUNCS(T)                                                                       \
  MSIM_INLINE void atomic_store_explicit(volatile atomic<T> *o, T v, memory_order) {                \
    MSIM_ATOMIC_HOOK(__msim_av(o), 1);                                                             \
    __atomic_store(__msim_av(o), &v, __ATOMIC_RELAXED);                                               \
  }                                                                                                \
  MSIM_INLINE T atomic_load_explicit(const volatile atomic<T> *o, memory_order) {                   \
    MSIM_ATOMIC_HOOK(__msim_av(o), 0);                                                             \
    T r;                                                \
    __atomic_load(__msim_av(o), &r, __ATOMIC_RELAXED);                                             \
    return r;                                      \
  }                                                                                                \
  MSIM_INLINE T atomic_exchange_explicit(volatile atomic<T> *o, T v, memory_order) {                \
    MSIM_ATOMIC_HOOK(__msim_av(o), 1);                                                             \
    T r;                                                \
    __atomic_exchange(__msim_av(o), &v, &r, __ATOMIC_RELAXED);                                     \
    return r;                                 \
  }                                                                                                \
  MSIM_INLINE bool atomic_compare_exchange_weak_explicit(volatile atomic<T> *o, thread T *expected, T desired, \
                                                         memory_order, memory_order) {             \
    MSIM_ATOMIC_HOOK(__msim_av(o), 1);                                                             \
    return __atomic_compare_exchange(__msim_av(o), expected, &desired, false, __ATOMIC_RELAXED,   \
                                       __ATOMIC_RELAXED);                                          \
  }                                                                                                \
  MSIM_INLINE bool atomic_compare_exchange_strong_explicit(volatile atomic<T> *o, thread T *expected, T desired, \
                                                           memory_order a, memory_order b) {       \
    return atomic_compare_exchange_weak_explicit(o, expected, desired, a, b);                      \
  }

#define MSIM_ATOMIC_RMW(T, name, builtin)                                                          \
  MSIM_INLINE T atomic_fetch_##name##_explicit(volatile atomic<T> *o, T v, memory_order) {         \
    MSIM_ATOMIC_HOOK(__msim_av(o), 1);                                                             \
    return builtin(__msim_av(o), v, __ATOMIC_RELAXED);                                             \
  }
#define MSIM_ATOMIC_INT(T)                                                                         \
  MSIM_ATOMIC_FUNCS(T)                                                                             \
  MSIM_ATOMIC_RMW(T, add, __atomic_fetch_add)                                                      \
  MSIM_ATOMIC_RMW(T, sub, __atomic_fetch_sub)                                                      \
  MSIM_ATOMIC_RMW(T, and, __atomic_fetch_and)                                                      \
  MSIM_ATOMIC_RMW(T, or, __atomic_fetch_or)                                                        \
  MSIM_ATOMIC_RMW(T, xor, __atomic_fetch_xor)                                                      \
  MSIM_ATOMIC_RMW(T, max, __atomic_fetch_max)                                                      \
  MSIM_ATOMIC_RMW(T, min, __atomic_fetch_min)
MSIM_ATOMIC_INT(int)
MSIM_ATOMIC_INT(uint)

// 64-bit atomics: MSL (2.4 and later, on Apple8/Apple9-class GPUs) has only atomic_fetch_min /
// atomic_fetch_max on atomic_ulong / atomic_long in device memory; every other operation, and
// any in threadgroup memory, is rejected like Apple's compiler rejects it (strictness).
template <class> inline constexpr bool __msim_false_v = false;
#define MSIM_ATOMIC64_MSG                                                                          \
  "metalsim strictness (Apple's compiler rejects this): 64-bit atomics support only "              \
  "atomic_fetch_min_explicit / atomic_fetch_max_explicit, on device memory"
#define MSIM_ATOMIC64_MINMAX(T, name, builtin)                                                     \
  MSIM_INLINE T atomic_fetch_##name##_explicit(volatile device atomic<T> *o, T v, memory_order) {  \
    MSIM_ATOMIC_HOOK(__msim_av(o), 1);                                                             \
    return builtin(__msim_av(o), v, __ATOMIC_RELAXED);                                             \
  }                                                                                                \
  template <class D = void>                                                                        \
  MSIM_INLINE T atomic_fetch_##name##_explicit(volatile threadgroup atomic<T> *, T v, memory_order) { \
    static_assert(__msim_false_v<D>, MSIM_ATOMIC64_MSG);                                              \
    return v;                                                                                      \
  }
#define MSIM_ATOMIC64_REJECT(T, fn)                                                                \
  template <class D = void, class... A> MSIM_INLINE T fn(const volatile atomic<T> *, A...) {       \
    static_assert(__msim_false_v<D>, MSIM_ATOMIC64_MSG);                                              \
    return T();                                                                                    \
  }
#define MSIM_ATOMIC64(T)                                                                           \
  MSIM_ATOMIC64_MINMAX(T, max, __atomic_fetch_max)                                                 \
  MSIM_ATOMIC64_MINMAX(T, min, __atomic_fetch_min)                                                 \
  MSIM_ATOMIC64_REJECT(T, atomic_store_explicit)                                                   \
  MSIM_ATOMIC64_REJECT(T, atomic_load_explicit)                                                    \
  MSIM_ATOMIC64_REJECT(T, atomic_exchange_explicit)                                                \
  MSIM_ATOMIC64_REJECT(T, atomic_compare_exchange_weak_explicit)                                   \
  MSIM_ATOMIC64_REJECT(T, atomic_compare_exchange_strong_explicit)                                 \
  MSIM_ATOMIC64_REJECT(T, atomic_fetch_add_explicit)                                               \
  MSIM_ATOMIC64_REJECT(T, atomic_fetch_sub_explicit)                                               \
  MSIM_ATOMIC64_REJECT(T, atomic_fetch_and_explicit)                                               \
  MSIM_ATOMIC64_REJECT(T, atomic_fetch_or_explicit)                                                \
  MSIM_ATOMIC64_REJECT(T, atomic_fetch_xor_explicit)
MSIM_ATOMIC64(long)
MSIM_ATOMIC64(ulong)
MSIM_ATOMIC_FUNCS(bool)
MSIM_ATOMIC_FUNCS(float)

template <class F> MSIM_INLINE float __msim_float_rmw(volatile atomic<float> *o, F f) {
  MSIM_ATOMIC_HOOK(__msim_av(o), 1);
  uint32_t *p = (uint32_t *)__msim_av(o);
  uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    float cur = as_type<float>(old);
    uint32_t nv = as_type<uint32_t>(f(cur));
    if (__atomic_compare_exchange_n(p, &old, nv, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return cur;
  }
}
MSIM_INLINE float atomic_fetch_add_explicit(volatile atomic<float> *o, float v, memory_order) {
  return __msim_float_rmw(o, [v](float c) { return c + v; });
}
MSIM_INLINE float atomic_fetch_sub_explicit(volatile atomic<float> *o, float v, memory_order) {
  return __msim_float_rmw(o, [v](float c) { return c - v; });
}
MSIM_INLINE float atomic_fetch_max_explicit(volatile atomic<float> *o, float v, memory_order) {
  return __msim_float_rmw(o, [v](float c) { return max(c, v); });
}
MSIM_INLINE float atomic_fetch_min_explicit(volatile atomic<float> *o, float v, memory_order) {
  return __msim_float_rmw(o, [v](float c) { return min(c, v); });
}
}  // namespace metal
