// Barriers and SIMD-group / quad-group collectives.
// A collective deposits this lane's value and suspends the fiber; the runtime resolves it
// once every non-exited lane of the SIMD-group that reached this call site is waiting,
// calling the combine function below once for all participating lanes (mask).
// Everything here is convergent (the kernel TU is also built with -fconvergent-functions)
// so the optimizer cannot duplicate or merge collective call sites between lanes.
#pragma once

#define MSIM_COLL inline __attribute__((always_inline, convergent))

namespace metal {

enum class mem_flags : int {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
MSIM_INLINE constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((int)a | (int)b); }
MSIM_INLINE constexpr mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((int)a & (int)b); }

enum memory_order { memory_order_relaxed = 0, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

MSIM_COLL void threadgroup_barrier(mem_flags f = mem_flags::mem_none) { msim_barrier((int)f); }
MSIM_INLINE void __msim_noop_combine(uint32_t, const void *const *, void *const *) {}
MSIM_COLL void simdgroup_barrier(mem_flags f = mem_flags::mem_none) {
  (void)f;
  msim_collective(MSIM_C_BARRIER, "simdgroup_barrier", nullptr, nullptr, &__msim_noop_combine);
}
MSIM_INLINE void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope::thread_scope_device) {}

template <class T> struct __msim_dep {
  T v;
  uint32_t a;
};

// ---- reductions and scans ----
struct __msim_add { template <class T> static MSIM_INLINE T f(T a, T b) { return a + b; } static constexpr int id = 0; };
struct __msim_mul { template <class T> static MSIM_INLINE T f(T a, T b) { return a * b; } static constexpr int id = 1; };
struct __msim_min { template <class T> static MSIM_INLINE T f(T a, T b) { return min(a, b); } };
struct __msim_max { template <class T> static MSIM_INLINE T f(T a, T b) { return max(a, b); } };
// bitwise reductions of floating-point values combine their bit patterns
template <class T> struct __msim_bits_of { using type = T; };
template <> struct __msim_bits_of<float> { using type = uint32_t; };
template <> struct __msim_bits_of<half> { using type = uint16_t; };
template <> struct __msim_bits_of<bfloat> { using type = uint16_t; };
#define MSIM_BITOP(name, op)                                                        \
  struct name {                                                                     \
    template <class T> static MSIM_INLINE T f(T a, T b) {                           \
      using U = typename __msim_bits_of<T>::type;                                   \
      return as_type<T>((U)(as_type<U>(a) op as_type<U>(b)));                       \
    }                                                                               \
  };
MSIM_BITOP(__msim_and, &)
MSIM_BITOP(__msim_or, |)
MSIM_BITOP(__msim_xor, ^)

// GROUP = 32 (SIMD-group) or 4 (quad-group)
template <class T, class Op, int GROUP>
void __msim_reduce(uint32_t mask, const void *const *ins, void *const *outs) {
  for (int g = 0; g < 32; g += GROUP) {
    T acc{};
    bool have = false;
    for (int l = g; l < g + GROUP; l++)
      if (mask >> l & 1u) {
        T v = *(const T *)ins[l];
        acc = have ? Op::f(acc, v) : v;
        have = true;
      }
    for (int l = g; l < g + GROUP; l++)
      if (mask >> l & 1u) *(T *)outs[l] = acc;
  }
}
template <class T, class Op, int GROUP, bool INCLUSIVE>
void __msim_scan(uint32_t mask, const void *const *ins, void *const *outs) {
  for (int g = 0; g < 32; g += GROUP) {
    T acc = (T)(Op::id == 1 ? 1 : 0);
    for (int l = g; l < g + GROUP; l++)
      if (mask >> l & 1u) {
        T v = *(const T *)ins[l];
        if (INCLUSIVE) { acc = Op::f(acc, v); *(T *)outs[l] = acc; }
        else { *(T *)outs[l] = acc; acc = Op::f(acc, v); }
      }
  }
}

#define MSIM_REDUCE(name, Op, G)                                                   \
  template <class T> MSIM_COLL T name(T x) {                                       \
    T out;                                                                         \
    msim_collective(MSIM_C_SIMD, #name, &x, &out, &__msim_reduce<T, Op, G>);       \
    return out;                                                                    \
  }
MSIM_REDUCE(simd_sum, __msim_add, 32)
MSIM_REDUCE(simd_product, __msim_mul, 32)
MSIM_REDUCE(simd_min, __msim_min, 32)
MSIM_REDUCE(simd_max, __msim_max, 32)
MSIM_REDUCE(simd_and, __msim_and, 32)
MSIM_REDUCE(simd_or, __msim_or, 32)
MSIM_REDUCE(simd_xor, __msim_xor, 32)
MSIM_REDUCE(quad_sum, __msim_add, 4)
MSIM_REDUCE(quad_product, __msim_mul, 4)
MSIM_REDUCE(quad_min, __msim_min, 4)
MSIM_REDUCE(quad_max, __msim_max, 4)
MSIM_REDUCE(quad_and, __msim_and, 4)
MSIM_REDUCE(quad_or, __msim_or, 4)
MSIM_REDUCE(quad_xor, __msim_xor, 4)

#define MSIM_SCAN(name, Op, G, INC)                                                \
  template <class T> MSIM_COLL T name(T x) {                                       \
    T out;                                                                         \
    msim_collective(MSIM_C_SIMD, #name, &x, &out, &__msim_scan<T, Op, G, INC>);    \
    return out;                                                                    \
  }
MSIM_SCAN(simd_prefix_inclusive_sum, __msim_add, 32, true)
MSIM_SCAN(simd_prefix_exclusive_sum, __msim_add, 32, false)
MSIM_SCAN(simd_prefix_inclusive_product, __msim_mul, 32, true)
MSIM_SCAN(simd_prefix_exclusive_product, __msim_mul, 32, false)
MSIM_SCAN(quad_prefix_inclusive_sum, __msim_add, 4, true)
MSIM_SCAN(quad_prefix_exclusive_sum, __msim_add, 4, false)
MSIM_SCAN(quad_prefix_inclusive_product, __msim_mul, 4, true)
MSIM_SCAN(quad_prefix_exclusive_product, __msim_mul, 4, false)

// ---- shuffles: each lane reads another lane's value ----
enum { __MSIM_IDX, __MSIM_UP, __MSIM_DOWN, __MSIM_XOR, __MSIM_ROT_UP, __MSIM_ROT_DOWN, __MSIM_FIRST };
template <class T, int MODE, int GROUP>
void __msim_shuffle(uint32_t mask, const void *const *ins, void *const *outs) {
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1u)) continue;
    const __msim_dep<T> *me = (const __msim_dep<T> *)ins[l];
    int g = l & ~(GROUP - 1), r = l - g, a = (int)me->a, src = -1;
    switch (MODE) {
      case __MSIM_IDX: src = a < GROUP ? g + a : -2; break;
      case __MSIM_UP: src = r - a >= 0 ? l - a : -1; break;
      case __MSIM_DOWN: src = r + a < GROUP ? l + a : -1; break;
      case __MSIM_XOR: src = (r ^ a) < GROUP ? g + (r ^ a) : -2; break;
      case __MSIM_ROT_UP: src = g + ((r - a) % GROUP + GROUP) % GROUP; break;
      case __MSIM_ROT_DOWN: src = g + (r + a) % GROUP; break;
      case __MSIM_FIRST: src = __builtin_ctz(mask); break;
    }
    if (src == -1) { *(T *)outs[l] = me->v; continue; }  // not shifted in: keep own value
    if (src < 0 || !(mask >> src & 1u)) {
      *(T *)outs[l] = me->v;
      msim_poison_shuffle(outs[l], sizeof(T),
                          MODE == __MSIM_IDX ? (GROUP == 4 ? "quad_shuffle/quad_broadcast" : "simd_shuffle/simd_broadcast")
                          : MODE == __MSIM_XOR ? "simd_shuffle_xor" : MODE == __MSIM_UP ? "simd_shuffle_up"
                          : MODE == __MSIM_DOWN ? "simd_shuffle_down" : "simd_shuffle_rotate",
                          (uint32_t)l, (uint32_t)(src < 0 ? a : src));
      continue;
    }
    *(T *)outs[l] = ((const __msim_dep<T> *)ins[src])->v;
  }
}
#define MSIM_SHUFFLE(name, MODE, G)                                                 \
  template <class T> MSIM_COLL T name(T x, ushort a) {                              \
    __msim_dep<T> d{x, a};                                                          \
    T out;                                                                          \
    msim_collective(MSIM_C_SHUFFLE, #name, &d, &out, &__msim_shuffle<T, MODE, G>);  \
    return out;                                                                     \
  }
MSIM_SHUFFLE(simd_shuffle, __MSIM_IDX, 32)
MSIM_SHUFFLE(simd_broadcast, __MSIM_IDX, 32)
MSIM_SHUFFLE(simd_shuffle_up, __MSIM_UP, 32)
MSIM_SHUFFLE(simd_shuffle_down, __MSIM_DOWN, 32)
MSIM_SHUFFLE(simd_shuffle_xor, __MSIM_XOR, 32)
MSIM_SHUFFLE(simd_shuffle_rotate_up, __MSIM_ROT_UP, 32)
MSIM_SHUFFLE(simd_shuffle_rotate_down, __MSIM_ROT_DOWN, 32)
MSIM_SHUFFLE(quad_shuffle, __MSIM_IDX, 4)
MSIM_SHUFFLE(quad_broadcast, __MSIM_IDX, 4)
MSIM_SHUFFLE(quad_shuffle_up, __MSIM_UP, 4)
MSIM_SHUFFLE(quad_shuffle_down, __MSIM_DOWN, 4)
MSIM_SHUFFLE(quad_shuffle_xor, __MSIM_XOR, 4)
MSIM_SHUFFLE(quad_shuffle_rotate_up, __MSIM_ROT_UP, 4)
MSIM_SHUFFLE(quad_shuffle_rotate_down, __MSIM_ROT_DOWN, 4)
// simd_shuffle_and_fill_{up,down}: within each group of `modulo` lanes, lane r reads data from
// lane r -/+ delta of its group, or filling_data from the lane that index wraps to (MSL).
template <class T> struct __msim_fill {
  T data, fill;
  uint32_t delta, modulo;
};
template <class T, bool UP>
void __msim_shuffle_fill(uint32_t mask, const void *const *ins, void *const *outs) {
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1u)) continue;
    const __msim_fill<T> *me = (const __msim_fill<T> *)ins[l];
    int m = (int)me->modulo, d = (int)me->delta;
    if (m < 1 || m > 32) m = 32;
    int g = l - l % m, r = l % m;
    int s = UP ? r - d : r + d;
    bool fill = UP ? s < 0 : s >= m;
    int src = g + (fill ? (UP ? s + m : s - m) : s);
    if (src < g || src >= g + m || !(mask >> src & 1u)) {
      *(T *)outs[l] = me->data;
      msim_poison_shuffle(outs[l], sizeof(T), UP ? "simd_shuffle_and_fill_up" : "simd_shuffle_and_fill_down",
                          (uint32_t)l, (uint32_t)src);
      continue;
    }
    const __msim_fill<T> *o = (const __msim_fill<T> *)ins[src];
    *(T *)outs[l] = fill ? o->fill : o->data;
  }
}
template <class T> MSIM_COLL T simd_shuffle_and_fill_down(T data, T filling_data, ushort delta, ushort modulo) {
  __msim_fill<T> d{data, filling_data, delta, modulo};
  T out;
  msim_collective(MSIM_C_SHUFFLE, "simd_shuffle_and_fill_down", &d, &out, &__msim_shuffle_fill<T, false>);
  return out;
}
template <class T> MSIM_COLL T simd_shuffle_and_fill_down(T data, T filling_data, ushort delta) {
  return simd_shuffle_and_fill_down(data, filling_data, delta, (ushort)32);
}
template <class T> MSIM_COLL T simd_shuffle_and_fill_up(T data, T filling_data, ushort delta, ushort modulo) {
  __msim_fill<T> d{data, filling_data, delta, modulo};
  T out;
  msim_collective(MSIM_C_SHUFFLE, "simd_shuffle_and_fill_up", &d, &out, &__msim_shuffle_fill<T, true>);
  return out;
}
template <class T> MSIM_COLL T simd_shuffle_and_fill_up(T data, T filling_data, ushort delta) {
  return simd_shuffle_and_fill_up(data, filling_data, delta, (ushort)32);
}
template <class T> MSIM_COLL T simd_broadcast_first(T x) {
  __msim_dep<T> d{x, 0};
  T out;
  msim_collective(MSIM_C_SHUFFLE, "simd_broadcast_first", &d, &out, &__msim_shuffle<T, __MSIM_FIRST, 32>);
  return out;
}

// ---- votes ----
typedef ulong __msim_vote_t;
struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  MSIM_INLINE constexpr explicit simd_vote(vote_t x = 0) : v(x) {}
  MSIM_INLINE constexpr explicit operator vote_t() const { return v; }
  MSIM_INLINE bool all() const { return v == 0xffffffffull; }
  MSIM_INLINE bool any() const { return v != 0; }
};
template <int GROUP>
void __msim_ballot(uint32_t mask, const void *const *ins, void *const *outs) {
  for (int g = 0; g < 32; g += GROUP) {
    uint64_t bits = 0;
    for (int l = g; l < g + GROUP; l++)
      if ((mask >> l & 1u) && *(const bool *)ins[l]) bits |= 1ull << (l - (GROUP == 32 ? 0 : g));
    for (int l = g; l < g + GROUP; l++)
      if (mask >> l & 1u) *(uint64_t *)outs[l] = bits;
  }
}
MSIM_INLINE void __msim_activemask(uint32_t mask, const void *const *, void *const *outs) {
  for (int l = 0; l < 32; l++)
    if (mask >> l & 1u) *(uint64_t *)outs[l] = mask;
}
MSIM_COLL simd_vote simd_ballot(bool b) {
  uint64_t out;
  msim_collective(MSIM_C_SIMD, "simd_ballot", &b, &out, &__msim_ballot<32>);
  return simd_vote(out);
}
MSIM_COLL simd_vote simd_active_threads_mask() {
  uint64_t out;
  msim_collective(MSIM_C_SIMD, "simd_active_threads_mask", nullptr, &out, &__msim_activemask);
  return simd_vote(out);
}
MSIM_COLL bool simd_all(bool b) {
  uint64_t out, act;
  msim_collective(MSIM_C_SIMD, "simd_all", &b, &out, &__msim_ballot<32>);
  act = (uint64_t)simd_active_threads_mask();
  return out == act;
}
MSIM_COLL bool simd_any(bool b) { return (uint64_t)simd_ballot(b) != 0; }
MSIM_COLL bool simd_is_first() {
  uint64_t act = (uint64_t)simd_active_threads_mask();
  return msim_current()->lane == (uint32_t)__builtin_ctzll(act);
}
MSIM_COLL bool quad_all(bool b) {
  uint64_t out;
  msim_collective(MSIM_C_SIMD, "quad_all", &b, &out, &__msim_ballot<4>);
  uint64_t act;
  msim_collective(MSIM_C_SIMD, "quad_all", nullptr, &act, &__msim_activemask);
  uint32_t g = msim_current()->lane & ~3u;
  return out == ((act >> g) & 0xfu);
}
MSIM_COLL bool quad_any(bool b) {
  uint64_t out;
  msim_collective(MSIM_C_SIMD, "quad_any", &b, &out, &__msim_ballot<4>);
  return out != 0;
}
}  // namespace metal
