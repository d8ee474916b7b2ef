// Glue between staged MSL and the runtime: kernel entry points, builtin arguments,
// function constants and threadgroup variables declared in kernel bodies.
#pragma once

// Kernel parameter sources; the staging pass emits one code per parameter: kind * 1000 + index.
enum { __MSIM_K_BUF = 0, __MSIM_K_TGA = 1, __MSIM_K_BI = 2 };
enum {
  __MSIM_TPIG, __MSIM_TGPIG, __MSIM_TPITG, __MSIM_TPTG, __MSIM_TGPG, __MSIM_TPG, __MSIM_TIITG,
  __MSIM_LANE, __MSIM_SGITG, __MSIM_SGPTG, __MSIM_WIDTH, __MSIM_DTPTG, __MSIM_QGITG, __MSIM_TIIQG,
  __MSIM_QGPTG, __MSIM_ORIGIN
};

template <class A> MSIM_INLINE A __msim_bi3(const uint32_t *v) {
  using B = std::remove_cv_t<A>;
  using I = __msim_vinfo<B>;
  if constexpr (I::is_vec) {
    B r{};
    for (int i = 0; i < I::n && i < 3; i++) r[i] = static_cast<typename I::elem>(v[i]);
    return r;
  } else {
    return static_cast<B>(v[0]);
  }
}
template <class A> MSIM_INLINE A __msim_bi1(uint32_t v) {
  uint32_t w[3] = {v, 0, 0};
  return __msim_bi3<A>(w);
}

template <class A, int S> MSIM_INLINE A __msim_arg(const msim_launch *L, const msim_thread *t) {
  constexpr int kind = S / 1000, idx = S % 1000;
  if constexpr (kind == __MSIM_K_BUF || kind == __MSIM_K_TGA) {
    void *p = kind == __MSIM_K_BUF ? L->bufs[idx] : t->tgargs[idx];
    if constexpr (std::is_pointer<A>::value) return (A)p;
    else if constexpr (std::is_reference<A>::value) return *(std::remove_reference_t<A> *)p;
    else return *(std::remove_cv_t<A> *)p;
  } else {
    switch (idx) {
      case __MSIM_TPIG: return __msim_bi3<A>(t->tpig);
      case __MSIM_TGPIG: return __msim_bi3<A>(t->tgpig);
      case __MSIM_TPITG: return __msim_bi3<A>(t->tpitg);
      case __MSIM_TPTG: return __msim_bi3<A>(t->tptg);
      case __MSIM_TGPG: return __msim_bi3<A>(t->tgpg);
      case __MSIM_TPG: return __msim_bi3<A>(t->tpg);
      case __MSIM_DTPTG: return __msim_bi3<A>(t->dtptg);
      case __MSIM_TIITG: return __msim_bi1<A>(t->tiitg);
      case __MSIM_LANE: return __msim_bi1<A>(t->lane);
      case __MSIM_SGITG: return __msim_bi1<A>(t->sgitg);
      case __MSIM_SGPTG: return __msim_bi1<A>(t->sgptg);
      case __MSIM_WIDTH: return __msim_bi1<A>(t->width);
      case __MSIM_QGITG: return __msim_bi1<A>(t->tiitg / 4);
      case __MSIM_TIIQG: return __msim_bi1<A>(t->tiitg % 4);
      case __MSIM_QGPTG: return __msim_bi1<A>((t->tptg[0] * t->tptg[1] * t->tptg[2] + 3) / 4);
      default: return __msim_bi1<A>(0);
    }
  }
}

template <int... S, class R, class... A>
MSIM_INLINE void __msim_invoke(R (*f)(A...), const msim_launch *L, const msim_thread *t) {
  static_assert(sizeof...(S) == sizeof...(A), "metalsim: kernel parameter attributes do not match the signature");
  f(__msim_arg<A, S>(L, t)...);
}

#define MSIM_ENTRY extern "C" __attribute__((visibility("default"), flatten))

// Function constants are specialised as Metal does when it builds a pipeline: a build for a
// set of constant values defines __msim_fcv<I> for each value given (see _build.specialisation),
// so a constant reads as a compile-time value the optimizer folds, and code under a false
// constant is dead. As in MSL, a constant is not a C++ constant expression (no array sizes or
// template arguments): the conversion is an inline function, not constexpr.
template <int N> struct __msim_fcbytes { unsigned char b[N]; };
template <int I> struct __msim_fcv { static constexpr int size = 0; };  // not given
// `constant T name [[function_constant(i)]];` becomes a __msim_fc<T, i>
template <class T, int I> struct __msim_fc {
  MSIM_INLINE operator T() const {
    if constexpr (__msim_fcv<I>::size == 0) {
      msim_fault_fc_unset(I);
      return T();
    } else {
      static_assert(__msim_fcv<I>::size == sizeof(T), "metalsim: function constant value of the wrong size");
      return __builtin_bit_cast(T, __msim_fcv<I>::bytes);
    }
  }
  MSIM_INLINE T __get() const { return (T) * this; }
};
template <class T, int I> MSIM_INLINE bool is_function_constant_defined(const __msim_fc<T, I> &) {
  return __msim_fcv<I>::size != 0;
}

// `threadgroup T name[N];` in a kernel body becomes a reference into the group's arena
template <class A> MSIM_INLINE threadgroup A &__msim_tg(int id, const char *name) {
  return *(threadgroup A *)msim_tg_var(id, sizeof(A), alignof(A), name);
}

// Constructors overloaded on the address space of the object (`S(float) constant`): staging
// gives the device, constant and threadgroup variants a leading tag argument, and an object
// declared in constant memory (`constant S x = S(1.0f);`) is initialised through
// __msim_construct_in, which passes the tag when S has that variant (see _staging._tag_constructors)
struct __msim_in_device { explicit constexpr __msim_in_device() = default; };
struct __msim_in_constant { explicit constexpr __msim_in_constant() = default; };
struct __msim_in_threadgroup { explicit constexpr __msim_in_threadgroup() = default; };
template <class Tag, class T, class... A> MSIM_INLINE constexpr T __msim_construct_in(A &&...a) {
  if constexpr (std::is_constructible_v<T, Tag, A &&...>)
    return T(Tag{}, static_cast<A &&>(a)...);
  else
    return T(static_cast<A &&>(a)...);
}

// The result of a member function variant for an address space of `*this` whose return type
// names an address space (`device T& operator[](int) device`): the variant's body sees a
// generic `this` (see _staging._split_addrspace_variants), so its generic result is cast back
// to the declared type
template <class R, class G> MSIM_INLINE R __msim_as_result(G &&g) {
  if constexpr (std::is_reference_v<R>)
    return static_cast<R>(*(std::remove_reference_t<R> *)&g);
  else
    return (R)g;
}
