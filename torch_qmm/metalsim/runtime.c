/* metalsim runtime: runs one dispatch of a kernel with Metal's execution model.
 *
 *   grid of threadgroups  -> claimed by worker OS threads (parallel when unchecked)
 *   threads of a group    -> cooperative fibers (hand-written x86-64 context switch)
 *   SIMD-group            -> 32 consecutive thread_index_in_threadgroup values
 *
 * A fiber runs until it blocks (threadgroup_barrier or a SIMD collective) or exits.
 * When no fiber can run, collectives resolve per SIMD-group (every non-exited lane
 * that reached the same call site takes part), then barriers resolve for the group.
 * Checked/counting mode: the kernel is compiled a second time with
 * -fsanitize-coverage=bb,trace-loads,trace-stores; the hooks below classify every
 * load/store (device buffer copy with red zones, threadgroup arena, or other).
 * Compiled by clang as C together with each kernel library (hidden visibility). */
#define _GNU_SOURCE
#include "metalsim/runtime.h"
#include <pthread.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if !defined(__x86_64__)
#error "metalsim runtime: only x86-64 is supported (fiber context switch)"
#endif

#define EXPORT __attribute__((visibility("default")))
#define STACK_SIZE (256u * 1024u)
#define TG_ARENA (64u * 1024u)
#define TG_LIMIT (32u * 1024u)
#define MAX_TG_VARS 128
#define GAP (1u << 20) /* red zone around each device buffer copy in checked mode */

/* ---- context switch: save callee-saved registers, swap stacks ---- */
void msim_switch(void **save_sp, void *new_sp);
__asm__(".text\n"
        ".p2align 4\n"
        ".hidden msim_switch\n"
        ".globl msim_switch\n"
        ".type msim_switch,@function\n"
        "msim_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size msim_switch, .-msim_switch\n");

typedef struct {
  uint32_t wep, rep;   /* barrier epoch of last write / read */
  uint16_t wtid, rtid; /* thread of last write / first read in epoch */
  uint16_t wsg, rsg;   /* SIMD-group collective epoch at that access */
  uint8_t init, rmany, watomic, pad;
} tgshadow;

typedef struct msim_tg {
  uint32_t n, nsg, id;
  uint32_t tgpig[3], tsz[3];
  char *arena;
  size_t used, high;
  struct { int id; size_t size, off; const char *name; } vars[MAX_TG_VARS];
  int nvars;
  void *tgarg[MSIM_MAX_TG_ARGS];
  uint32_t epoch;
  uint16_t sg_epoch[32];
} msim_tg;

typedef struct worker {
  msim_launch *L;
  msim_thread *threads;
  char *stacks;
  uint32_t cap; /* threads with stacks */
  void *sched_sp;
  msim_thread *cur;
  msim_tg tg;
  int abort;
  int instr; /* hooks active */
  tgshadow *shadow;
  jmp_buf jb;
} worker;

static __thread worker *tls_w;

/* checked/counting state for one launch (single worker in that mode) */
typedef struct {
  int nb;
  int idx[MSIM_MAX_BUFFERS];
  char *lo[MSIM_MAX_BUFFERS], *hi[MSIM_MAX_BUFFERS];
  uint32_t *stamp[MSIM_MAX_BUFFERS];
} bufmap;
static __thread bufmap *tls_bm;

/* ---- faults ---- */
static void thread_desc(char *out, size_t n, const msim_thread *t) {
  if (!t) { snprintf(out, n, "(no thread)"); return; }
  snprintf(out, n,
           "thread_position_in_grid=(%u,%u,%u) threadgroup_position_in_grid=(%u,%u,%u) "
           "thread_index_in_threadgroup=%u (simdgroup %u lane %u)",
           t->tpig[0], t->tpig[1], t->tpig[2], t->tgpig[0], t->tgpig[1], t->tgpig[2], t->tiitg,
           t->sgitg, t->lane);
}

static void record_fault(worker *w, const char *fmt, ...) {
  msim_launch *L = w->L;
  if (!L->fault) {
    int k = snprintf(L->fault_msg, sizeof L->fault_msg, "kernel '%s': ", L->kernel_name);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->fault_msg + k, sizeof L->fault_msg - k, fmt, ap);
    va_end(ap);
    L->fault = 1;
  }
  w->abort = 1;
}

/* abort the running fiber: never returns */
static void abort_fiber(worker *w) {
  if (w->L->use_fibers) {
    msim_thread *t = w->cur;
    msim_switch(&t->sp, w->sched_sp);
  }
  longjmp(w->jb, 1);
}

/* ---- builtins available to kernel code ---- */
EXPORT const msim_thread *msim_current(void) { return tls_w ? tls_w->cur : 0; }

/* a kernel read the value of a function constant its build was not given */
void msim_fault_fc_unset(int index) {
  worker *w = tls_w;
  char d[256];
  thread_desc(d, sizeof d, w->cur);
  record_fault(w, "function constant %d is read but not set (give it in function_constants=, or test "
                  "is_function_constant_defined first); by %s", index, d);
  abort_fiber(w);
}

void msim_barrier(int flags) {
  (void)flags;
  worker *w = tls_w;
  msim_thread *t = w->cur;
  if (!w->L->use_fibers) {
    record_fault(w, "internal: threadgroup_barrier reached on the fiber-less fast path");
    abort_fiber(w);
  }
  t->state = MSIM_BARRIER;
  t->site = __builtin_return_address(0);
  msim_switch(&t->sp, w->sched_sp);
}

void msim_collective(int kind, const char *what, const void *in, void *out, msim_combine_fn fn) {
  worker *w = tls_w;
  msim_thread *t = w->cur;
  if (!w->L->use_fibers) {
    record_fault(w, "internal: %s reached on the fiber-less fast path", what);
    abort_fiber(w);
  }
  t->state = MSIM_COLLECTIVE;
  t->site = __builtin_return_address(0);
  t->ckind = kind;
  t->cwhat = what;
  t->cin = in;
  t->cout = out;
  t->cfn = fn;
  msim_switch(&t->sp, w->sched_sp);
}

static __thread uint32_t resolving_lane_base;

/* ---- undefined values (checked mode) ----
 * The instrumented build is also compiled with -fsanitize=kernel-memory: clang's
 * MemorySanitizer pass (in its kernel flavour, which asks the runtime for every shadow address
 * instead of assuming a fixed memory layout, and keeps its argument shadows in a context
 * struct instead of static TLS, which a dlopen'ed library cannot have) gives every byte of
 * memory and every value a shadow (nonzero = undefined), propagates it through loads, stores
 * and arithmetic, and calls __msan_warning where an undefined value is used: a branch or
 * select condition, an address, or an argument or return value of a call that is not inlined.
 * A shuffle that reads an inactive lane marks its result undefined (msim_poison_shuffle);
 * nothing else does (stack poisoning is off, memory starts defined), so every report is a use
 * of such a value. A value stored to a device buffer is reported when the launch ends (the
 * buffer copies' shadow); one that is discarded, or left in thread or threadgroup memory, is not.
 * Shadow exists for the memory kernels write in checked mode: the device buffer copies, the
 * fiber stacks and the threadgroup arena; any other memory reads as defined. */
typedef struct { char *lo; size_t n; unsigned char *sh; } shregion;
enum { SH_BUFFERS, SH_STACKS, SH_ARENA, SH_N };
static __thread shregion shr[SH_N];
#define SH_SCRATCH 65536
static const unsigned char sh_defined[SH_SCRATCH]; /* shadow of memory without one: defined */
static unsigned char sh_sink[SH_SCRATCH];          /* where shadow stores to such memory go */
static unsigned char origin_sink[4 * SH_SCRATCH];  /* origins are not tracked */
static __thread char poison_msg[512]; /* the first undefined value of the launch: where it came from */
static __thread int poisoned;
/* MemorySanitizer's kernel context: shadows of arguments, return values and varargs */
typedef struct {
  unsigned long long param[100], retval[100], va_arg[100], va_arg_origin[100], va_arg_overflow_size;
  unsigned param_origin[200], retval_origin;
} msan_context;
static __thread msan_context msan_ctx;

static void shadow_map(int k, void *lo, size_t n) {
  void *sh = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  shr[k].lo = lo;
  shr[k].n = sh == MAP_FAILED ? 0 : n;
  shr[k].sh = sh == MAP_FAILED ? 0 : sh;
}
static void shadow_unmap(int k) {
  if (shr[k].sh) munmap(shr[k].sh, shr[k].n);
  memset(&shr[k], 0, sizeof shr[k]);
}
static void shadow_reset(int k) { /* every byte defined again */
  if (shr[k].sh) madvise(shr[k].sh, shr[k].n, MADV_DONTNEED);
}
static unsigned char *shadow_at(const void *p, size_t n, int store) {
  for (int k = 0; k < SH_N; k++)
    if (shr[k].sh && (const char *)p >= shr[k].lo && (const char *)p + n <= shr[k].lo + shr[k].n)
      return shr[k].sh + ((const char *)p - shr[k].lo);
  return store ? sh_sink : (unsigned char *)sh_defined;
}

typedef struct { void *shadow, *origin; } msan_meta;
#define MSAN_META(N)                                                                                 \
  msan_meta __msan_metadata_ptr_for_load_##N(void *p) { return (msan_meta){shadow_at(p, N, 0), origin_sink}; } \
  msan_meta __msan_metadata_ptr_for_store_##N(void *p) { return (msan_meta){shadow_at(p, N, 1), origin_sink}; }
MSAN_META(1)
MSAN_META(2)
MSAN_META(4)
MSAN_META(8)
msan_meta __msan_metadata_ptr_for_load_n(void *p, uint64_t n) {
  return (msan_meta){n <= SH_SCRATCH ? shadow_at(p, n, 0) : (void *)sh_defined, origin_sink};
}
msan_meta __msan_metadata_ptr_for_store_n(void *p, uint64_t n) {
  return (msan_meta){n <= SH_SCRATCH ? shadow_at(p, n, 1) : (void *)sh_sink, origin_sink};
}
msan_context *__msan_get_context_state(void) { return &msan_ctx; }
uint32_t __msan_chain_origin(uint32_t origin) { return origin; }
static void shadow_set(const void *p, size_t n, int v) {
  for (int k = 0; k < SH_N; k++)
    if (shr[k].sh && (const char *)p >= shr[k].lo && (const char *)p + n <= shr[k].lo + shr[k].n) {
      memset(shr[k].sh + ((const char *)p - shr[k].lo), v, n);
      return;
    }
}
void __msan_poison_alloca(void *p, uint64_t n, char *descr) { (void)descr; shadow_set(p, n, 0); }
void __msan_unpoison_alloca(void *p, uint64_t n) { shadow_set(p, n, 0); }
void __msan_instrument_asm_store(void *p, uint64_t n) { shadow_set(p, n, 0); }

void msim_poison_shuffle(void *out, size_t n, const char *what, uint32_t lane, uint32_t src_lane) {
  worker *w = tls_w;
  if (!w->L->check) return;
  shadow_set(out, n, 0xff);
  if (!poisoned) {
    msim_thread *t = &w->threads[resolving_lane_base + lane];
    char d[256];
    thread_desc(d, sizeof d, t);
    snprintf(poison_msg, sizeof poison_msg, "%s by %s read lane %u, which is inactive (exited or diverged) at "
             "this call, so the value is undefined", what, d, src_lane);
    poisoned = 1;
  }
}

void __msan_warning(uint32_t origin) {
  (void)origin;
  worker *w = tls_w;
  char d[256];
  thread_desc(d, sizeof d, w->cur);
  record_fault(w, "an undefined value is used (a branch, an address, or a call argument) by %s; %s", d,
               poisoned ? poison_msg : "(no shuffle from an inactive lane recorded)");
  abort_fiber(w);
}

void *msim_tg_var(int id, size_t size, size_t align, const char *name) {
  worker *w = tls_w;
  msim_tg *tg = &w->tg;
  for (int i = 0; i < tg->nvars; i++)
    if (tg->vars[i].id == id && tg->vars[i].size == size) return tg->arena + tg->vars[i].off;
  if (align < 16) align = 16;
  size_t off = (tg->used + align - 1) & ~(align - 1);
  if (tg->nvars >= MAX_TG_VARS || off + size > TG_ARENA ||
      (w->L->check && off + size > TG_LIMIT)) {
    record_fault(w, "threadgroup memory exhausted declaring '%s' (%zu bytes at offset %zu; limit %u)",
                 name, size, off, w->L->check ? TG_LIMIT : TG_ARENA);
    abort_fiber(w);
  }
  tg->vars[tg->nvars].id = id;
  tg->vars[tg->nvars].size = size;
  tg->vars[tg->nvars].off = off;
  tg->vars[tg->nvars].name = name;
  tg->nvars++;
  tg->used = off + size;
  if (tg->used > tg->high) tg->high = tg->used;
  return tg->arena + off;
}

/* ---- memory access hooks (instrumented build only) ---- */
static const char *tg_name(msim_tg *tg, size_t off, size_t *rel) {
  for (int i = 0; i < tg->nvars; i++)
    if (off >= tg->vars[i].off && off < tg->vars[i].off + tg->vars[i].size) {
      *rel = off - tg->vars[i].off;
      return tg->vars[i].name;
    }
  *rel = off;
  return "threadgroup memory";
}

static void tg_access(worker *w, size_t off, size_t n, int store, int atomic) {
  msim_tg *tg = &w->tg;
  msim_thread *t = w->cur;
  if (off + n > tg->used) {
    size_t rel;
    const char *nm = tg_name(tg, off, &rel);
    char d[256];
    thread_desc(d, sizeof d, t);
    record_fault(w, "out-of-bounds threadgroup %s of %zu bytes at arena offset %zu (in/after '%s'); by %s",
                 store ? "write" : "read", n, off, nm, d);
    abort_fiber(w);
  }
  uint16_t tid = (uint16_t)t->tiitg;
  uint32_t sg = t->sgitg;
  for (size_t i = 0; i < n; i++) {
    tgshadow *s = &w->shadow[off + i];
    const char *conflict = 0;
    uint16_t other = 0;
    if (s->wep == tg->epoch && s->wtid != tid && !(atomic && s->watomic)) {
      uint32_t osg = s->wtid / 32u;
      if (osg != sg || s->wsg == tg->sg_epoch[sg]) { conflict = "wrote"; other = s->wtid; }
    }
    if (!conflict && store && s->rep == tg->epoch && !atomic) {
      if (s->rmany) { conflict = "read"; other = s->rtid == tid ? 0xffff : s->rtid; }
      else if (s->rtid != tid) {
        uint32_t osg = s->rtid / 32u;
        if (osg != sg || s->rsg == tg->sg_epoch[sg]) { conflict = "read"; other = s->rtid; }
      }
    }
    if (conflict) {
      size_t rel;
      const char *nm = tg_name(tg, off + i, &rel);
      char d[256];
      thread_desc(d, sizeof d, t);
      char o[64];
      if (other == 0xffff) snprintf(o, sizeof o, "other threads");
      else snprintf(o, sizeof o, "thread_index_in_threadgroup=%u", other);
      record_fault(w,
                   "threadgroup memory race on '%s' byte %zu: %s %s it after %s %s it with no "
                   "threadgroup_barrier in between",
                   nm, rel, d, store ? "writes" : "reads", o, conflict);
      abort_fiber(w);
    }
    if (!store && !s->init) {
      size_t rel;
      const char *nm = tg_name(tg, off + i, &rel);
      char d[256];
      thread_desc(d, sizeof d, t);
      record_fault(w, "read of uninitialised threadgroup memory '%s' byte %zu (not written in this threadgroup before this read; "
                      "a write by another thread needs a threadgroup_barrier before the read) by %s",
                   nm, rel, d);
      abort_fiber(w);
    }
    if (store) {
      s->init = 1;
      s->wep = tg->epoch;
      s->wtid = tid;
      s->wsg = tg->sg_epoch[sg];
      s->watomic = (uint8_t)atomic;
    } else if (s->rep != tg->epoch) {
      s->rep = tg->epoch;
      s->rtid = tid;
      s->rsg = tg->sg_epoch[sg];
      s->rmany = 0;
    } else if (s->rtid != tid) {
      s->rmany = 1;
    }
  }
}

static void on_access(const void *p, size_t n, int store, int atomic) {
  worker *w = tls_w;
  if (!w || !w->instr) return;
  const char *a = (const char *)p;
  msim_tg *tg = &w->tg;
  if (a >= tg->arena && a < tg->arena + TG_ARENA) {
    if (w->L->check) tg_access(w, (size_t)(a - tg->arena), n, store, atomic);
    return;
  }
  bufmap *bm = tls_bm;
  for (int k = 0; k < bm->nb; k++) {
    if (a >= bm->lo[k] - GAP / 2 && a < bm->hi[k] + GAP / 2) {
      int i = bm->idx[k];
      msim_launch *L = w->L;
      if (a < bm->lo[k] || a + n > bm->hi[k]) {
        if (!L->check) return;
        char d[256];
        thread_desc(d, sizeof d, w->cur);
        long long rel = (long long)(a - (const char *)L->bufs[i]);
        if (L->unbound >> i & 1u) {
          record_fault(w, "device %s of %zu bytes through buffer(%d), which is not bound (Metal leaves an "
                          "unbound buffer undefined; bind it or do not access it) by %s",
                       store ? "write" : "read", n, i, d);
          abort_fiber(w);
        }
        record_fault(w,
                     "out-of-bounds device %s of %zu bytes at buffer(%d) byte offset %lld (bound "
                     "at offset %llu of a %llu-byte allocation, so %lld valid bytes) by %s",
                     store ? "write" : "read", n, i, rel, (unsigned long long)L->buf_offset[i],
                     (unsigned long long)L->buf_size[i],
                     (long long)L->buf_size[i] - (long long)L->buf_offset[i], d);
        abort_fiber(w);
      }
      if (L->count) {
        if (store) L->bytes_stored[i] += n;
        else L->bytes_loaded[i] += n;
        uint32_t *st = bm->stamp[k] + (a - bm->lo[k]);
        for (size_t j = 0; j < n; j++) {
          if (!st[j]) L->unique_bytes[i]++;
          if (st[j] != tg->id) { L->tg_footprint[i]++; st[j] = tg->id; }
        }
      }
      return;
    }
  }
}

void msim_access(const void *p, size_t n, int is_store, int is_atomic) { on_access(p, n, is_store, is_atomic); }

/* Memory intrinsics and odd-sized accesses of the instrumented build, routed here by
 * _trace_ir.py (sanitizer coverage sees only 1/2/4/8/16-byte loads and stores).  The ranges
 * are checked before the operation, so an out-of-bounds copy faults before it corrupts. */
void __msim_trace(const void *p, uint64_t n, int is_store) { on_access(p, n, is_store, 0); }
void __msim_memcpy(void *d, const void *s, uint64_t n) {
  if (!n) return;
  on_access(s, n, 0, 0);
  on_access(d, n, 1, 0);
  memcpy(d, s, n);
}
void __msim_memmove(void *d, const void *s, uint64_t n) {
  if (!n) return;
  on_access(s, n, 0, 0);
  on_access(d, n, 1, 0);
  memmove(d, s, n);
}
void __msim_memset(void *d, uint8_t v, uint64_t n) {
  if (!n) return;
  on_access(d, n, 1, 0);
  memset(d, v, n);
}
/* MemorySanitizer routes the memory intrinsics here: traced as above, shadow copied along */
static void shadow_copy(void *d, const void *s, uint64_t n) {
  unsigned char *ds = n <= SH_SCRATCH ? shadow_at(d, n, 1) : sh_sink;
  if (ds == sh_sink) {
    shadow_set(d, n, 0);
    return;
  }
  const unsigned char *ss = n <= SH_SCRATCH ? shadow_at(s, n, 0) : sh_defined;
  if (ss == sh_defined) memset(ds, 0, n);
  else memmove(ds, ss, n);
}
void *__msan_memcpy(void *d, const void *s, uint64_t n) {
  __msim_memcpy(d, s, n);
  if (n) shadow_copy(d, s, n);
  return d;
}
void *__msan_memmove(void *d, const void *s, uint64_t n) {
  __msim_memmove(d, s, n);
  if (n) shadow_copy(d, s, n);
  return d;
}
void *__msan_memset(void *d, int v, uint64_t n) {
  __msim_memset(d, (uint8_t)v, n);
  shadow_set(d, n, 0);
  return d;
}

#define HOOK(N)                                                                   \
  void __sanitizer_cov_load##N(void *p) { on_access(p, N, 0, 0); }              \
  void __sanitizer_cov_store##N(void *p) { on_access(p, N, 1, 0); }
HOOK(1)
HOOK(2)
HOOK(4)
HOOK(8)
HOOK(16)

/* ---- threadgroup execution ---- */
static void fiber_main(void) {
  worker *w = tls_w;
  msim_thread *t = w->cur;
  w->L->entry(w->L, t);
  t->state = MSIM_EXITED;
  msim_switch(&t->sp, w->sched_sp);
  __builtin_trap();
}

static void fiber_init(msim_thread *t) {
  uintptr_t top = ((uintptr_t)t->stack + STACK_SIZE) & ~(uintptr_t)15;
  void **sp = (void **)top;
  *--sp = 0;
  *--sp = (void *)fiber_main;
  for (int i = 0; i < 6; i++) *--sp = 0;
  t->sp = sp;
}

static int ensure_threads(worker *w, uint32_t n) {
  if (w->cap >= n) return 0;
  w->threads = realloc(w->threads, sizeof(msim_thread) * n);
  if (w->L->use_fibers) {
    if (w->stacks) munmap(w->stacks, (size_t)w->cap * STACK_SIZE);
    w->stacks = mmap(0, (size_t)n * STACK_SIZE, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (w->stacks == MAP_FAILED) { w->stacks = 0; return -1; }
    for (uint32_t i = 0; i < n; i++) mprotect(w->stacks + (size_t)i * STACK_SIZE, 4096, PROT_NONE);
  }
  w->cap = n;
  return 0;
}

static void fill_thread(msim_thread *t, msim_launch *L, msim_tg *tg, uint32_t i) {
  uint32_t tx = tg->tsz[0], ty = tg->tsz[1];
  t->tpitg[0] = i % tx;
  t->tpitg[1] = (i / tx) % ty;
  t->tpitg[2] = i / (tx * ty);
  for (int d = 0; d < 3; d++) {
    t->tgpig[d] = tg->tgpig[d];
    t->tptg[d] = tg->tsz[d];
    t->dtptg[d] = L->tptg[d];
    t->tgpg[d] = L->groups[d];
    t->tpg[d] = L->nonuniform ? L->threads[d] : L->groups[d] * L->tptg[d];
    t->tpig[d] = tg->tgpig[d] * L->tptg[d] + t->tpitg[d];
  }
  t->tiitg = i;
  t->lane = i % 32u;
  t->sgitg = i / 32u;
  t->sgptg = tg->nsg;
  t->width = 32;
  t->state = MSIM_RUNNABLE;
  t->tg = tg;
  t->tgargs = tg->tgarg;
}

static void resolve_collectives(worker *w, int *resolved) {
  msim_tg *tg = &w->tg;
  msim_thread *th = w->threads;
  for (uint32_t s = 0; s < tg->nsg; s++) {
    uint32_t base = s * 32u, end = base + 32u < tg->n ? base + 32u : tg->n;
    const void *site = 0;
    int found = 0;
    for (uint32_t i = base; i < end; i++)
      if (th[i].state == MSIM_COLLECTIVE && (!found || (uintptr_t)th[i].site < (uintptr_t)site)) {
        site = th[i].site;
        found = 1;
      }
    if (!found) continue;
    const void *ins[32] = {0};
    void *outs[32] = {0};
    uint32_t mask = 0;
    msim_thread *first = 0;
    for (uint32_t i = base; i < end; i++)
      if (th[i].state == MSIM_COLLECTIVE && th[i].site == site) {
        ins[i - base] = th[i].cin;
        outs[i - base] = th[i].cout;
        mask |= 1u << (i - base);
        if (!first) first = &th[i];
      }
    if (w->L->check && first->ckind == MSIM_C_MATRIX && mask != 0xffffffffu) {
      char d[256];
      thread_desc(d, sizeof d, first);
      record_fault(w, "%s entered by %d of 32 lanes of simdgroup %u (active mask 0x%08x); all 32 lanes "
                      "must execute it; first lane: %s",
                   first->cwhat, __builtin_popcount(mask), s, mask, d);
      return;
    }
    resolving_lane_base = base;
    first->cfn(mask, ins, outs);
    if (w->abort) return;
    for (uint32_t i = base; i < end; i++)
      if (mask >> (i - base) & 1u) th[i].state = MSIM_RUNNABLE;
    tg->sg_epoch[s]++;
    *resolved = 1;
  }
}

static void run_tg_fibers(worker *w) {
  msim_tg *tg = &w->tg;
  msim_thread *th = w->threads;
  for (uint32_t i = 0; i < tg->n; i++) {
    fill_thread(&th[i], w->L, tg, i);
    th[i].stack = w->stacks + (size_t)i * STACK_SIZE;
    fiber_init(&th[i]);
  }
  for (;;) {
    for (uint32_t i = 0; i < tg->n; i++) {
      if (th[i].state != MSIM_RUNNABLE) continue;
      w->cur = &th[i];
      msim_switch(&w->sched_sp, th[i].sp);
      if (w->abort) return;
    }
    int resolved = 0;
    resolve_collectives(w, &resolved);
    if (w->abort) return;
    if (resolved) continue;
    uint32_t nb = 0, ne = 0;
    const msim_thread *b0 = 0, *e0 = 0, *odd = 0;
    for (uint32_t i = 0; i < tg->n; i++) {
      if (th[i].state == MSIM_BARRIER) {
        if (!b0) b0 = &th[i];
        else if (th[i].site != b0->site && !odd) odd = &th[i];
        nb++;
      } else if (th[i].state == MSIM_EXITED) {
        if (!e0) e0 = &th[i];
        ne++;
      }
    }
    if (nb == 0) return;
    if (w->L->check && (ne > 0 || odd)) {
      char d1[256], d2[256];
      thread_desc(d1, sizeof d1, b0);
      if (ne > 0) {
        thread_desc(d2, sizeof d2, e0);
        record_fault(w, "barrier divergence: %u threads wait at threadgroup_barrier but %u threads of the "
                        "threadgroup have exited (e.g. %s); waiting: %s",
                     nb, ne, d2, d1);
      } else {
        thread_desc(d2, sizeof d2, odd);
        record_fault(w, "barrier divergence: threads wait at different threadgroup_barrier calls: %s and %s",
                     d1, d2);
      }
      return;
    }
    for (uint32_t i = 0; i < tg->n; i++)
      if (th[i].state == MSIM_BARRIER) th[i].state = MSIM_RUNNABLE;
    tg->epoch++;
  }
}

static void run_tg_fast(worker *w) {
  msim_tg *tg = &w->tg;
  msim_thread *t = &w->threads[0];
  if (setjmp(w->jb)) return;
  for (uint32_t i = 0; i < tg->n; i++) {
    fill_thread(t, w->L, tg, i);
    w->cur = t;
    w->L->entry(w->L, t);
  }
}

typedef struct {
  msim_launch *L;
  volatile uint64_t *next;
  volatile int *stop;
  bufmap *bm;
  char *errs;
} wargs;

static void *worker_main(void *arg) {
  wargs *a = (wargs *)arg;
  msim_launch *L = a->L;
  worker W;
  memset(&W, 0, sizeof W);
  W.L = L;
  W.instr = (L->check || L->count);
  tls_w = &W;
  tls_bm = a->bm;
  uint32_t n = L->tptg[0] * L->tptg[1] * L->tptg[2];
  W.tg.arena = aligned_alloc(64, TG_ARENA);
  memset(W.tg.arena, 0, TG_ARENA);
  if (L->check) W.shadow = calloc(TG_ARENA, sizeof(tgshadow));
  if (ensure_threads(&W, L->use_fibers ? n : 1)) {
    record_fault(&W, "could not allocate fiber stacks for %u threads", n);
    *a->stop = 1;
  } else if (L->check) {
    shadow_map(SH_ARENA, W.tg.arena, TG_ARENA);
    if (W.stacks) shadow_map(SH_STACKS, W.stacks, (size_t)W.cap * STACK_SIZE);
  }
  uint64_t total = (uint64_t)L->groups[0] * L->groups[1] * L->groups[2];
  while (!*a->stop) {
    uint64_t g = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
    if (g >= total) break;
    msim_tg *tg = &W.tg;
    tg->tgpig[0] = g % L->groups[0];
    tg->tgpig[1] = (g / L->groups[0]) % L->groups[1];
    tg->tgpig[2] = g / ((uint64_t)L->groups[0] * L->groups[1]);
    tg->n = 1;
    for (int d = 0; d < 3; d++) {
      uint32_t sz = L->tptg[d];
      if (L->nonuniform) {
        uint32_t start = tg->tgpig[d] * L->tptg[d];
        if (L->threads[d] - start < sz) sz = L->threads[d] - start;
      }
      tg->tsz[d] = sz;
      tg->n *= sz;
    }
    tg->nsg = (tg->n + 31) / 32;
    tg->id = (uint32_t)g + 1;
    tg->epoch = 1;
    memset(tg->sg_epoch, 0, sizeof tg->sg_epoch);
    /* reset the arena: zeros in plain mode (deterministic), poison (shadow) in checked mode */
    memset(tg->arena, 0, tg->high);
    if (W.shadow) memset(W.shadow, 0, tg->high * sizeof(tgshadow));
    if (poisoned) { /* undefined values left in thread and threadgroup memory by the last threadgroup */
      shadow_reset(SH_ARENA);
      shadow_reset(SH_STACKS);
    }
    tg->used = 0;
    tg->nvars = 0;
    for (int k = 0; k < MSIM_MAX_TG_ARGS; k++) {
      tg->tgarg[k] = 0;
      if (L->tg_arg_size[k]) {
        tg->tgarg[k] = msim_tg_var(-1 - k, L->tg_arg_size[k], 16, "[[threadgroup(n)]] argument");
      }
    }
    if (W.abort) { *a->stop = 1; break; }
    if (L->use_fibers) run_tg_fibers(&W);
    else run_tg_fast(&W);
    if (W.abort) { *a->stop = 1; break; }
  }
  shadow_unmap(SH_ARENA);
  shadow_unmap(SH_STACKS);
  free(W.tg.arena);
  free(W.shadow);
  free(W.threads);
  if (W.stacks) munmap(W.stacks, (size_t)W.cap * STACK_SIZE);
  tls_w = 0;
  return 0;
}

/* Run one dispatch.  Returns 0, or 1 with L->fault_msg set. */
EXPORT int msim_run(msim_launch *L) {
  volatile uint64_t next = 0;
  volatile int stop = 0;
  bufmap bm;
  memset(&bm, 0, sizeof bm);
  char *region = 0;
  size_t region_size = 0;
  int instr = L->check || L->count;
  poisoned = 0;
  if (instr) {
    /* copies of every bound buffer, each surrounded by a red zone, so an access can be
     * attributed to the buffer it belongs to (or falls just outside of) */
    L->nworkers = 1;
    for (int i = 0; i < MSIM_MAX_BUFFERS; i++)
      if (L->buf_base[i]) region_size += ((L->buf_size[i] + 4095) & ~(size_t)4095) + GAP;
    region_size += GAP;
    region = mmap(0, region_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) {
      snprintf(L->fault_msg, sizeof L->fault_msg, "could not map %zu bytes for checked mode", region_size);
      return 1;
    }
    if (L->check) shadow_map(SH_BUFFERS, region, region_size);
    char *p = region + GAP;
    for (int i = 0; i < MSIM_MAX_BUFFERS; i++) {
      if (!L->buf_base[i]) continue;
      int k = bm.nb++;
      bm.idx[k] = i;
      bm.lo[k] = p;
      bm.hi[k] = p + L->buf_size[i];
      memcpy(p, L->buf_base[i], L->buf_size[i]);
      if (L->count) bm.stamp[k] = calloc(L->buf_size[i] + 16, sizeof(uint32_t));
      L->bufs[i] = p + L->buf_offset[i];
      p += ((L->buf_size[i] + 4095) & ~(size_t)4095) + GAP;
    }
  }
  uint64_t total = (uint64_t)L->groups[0] * L->groups[1] * L->groups[2];
  int nw = L->nworkers < 1 ? 1 : L->nworkers;
  if ((uint64_t)nw > total) nw = (int)(total ? total : 1);
  wargs a = {L, &next, &stop, &bm, 0};
  if (nw == 1) {
    worker_main(&a);
  } else {
    pthread_t tids[64];
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 16u << 20);
    if (nw > 64) nw = 64;
    int started = 0;
    for (int i = 0; i < nw; i++)
      if (pthread_create(&tids[i], &attr, worker_main, &a) == 0) started++;
      else break;
    for (int i = 0; i < started; i++) pthread_join(tids[i], 0);
    pthread_attr_destroy(&attr);
    if (!started) worker_main(&a);
  }
  if (instr && poisoned && shr[SH_BUFFERS].sh) {
    /* an undefined value stored to a device buffer is observable: report it */
    for (int k = 0; k < bm.nb && !L->fault; k++) {
      const unsigned char *sh = shr[SH_BUFFERS].sh + (bm.lo[k] - region);
      for (size_t off = 0; off < (size_t)(bm.hi[k] - bm.lo[k]); off++)
        if (sh[off]) {
          int i = bm.idx[k];
          int c = snprintf(L->fault_msg, sizeof L->fault_msg, "kernel '%s': buffer(%d) byte offset %zu holds an "
                           "undefined value the kernel stored; ", L->kernel_name, i,
                           off - (size_t)L->buf_offset[i]);
          snprintf(L->fault_msg + c, sizeof L->fault_msg - c, "%s", poison_msg);
          L->fault = 1;
          break;
        }
    }
  }
  shadow_unmap(SH_BUFFERS);
  if (instr) {
    for (int k = 0; k < bm.nb; k++) {
      int i = bm.idx[k];
      memcpy(L->buf_base[i], bm.lo[k], L->buf_size[i]);
      L->bufs[i] = (char *)L->buf_base[i] + L->buf_offset[i];
      free(bm.stamp[k]);
    }
    munmap(region, region_size);
  }
  return L->fault;
}

EXPORT int msim_abi_version(void) { return 1; }
EXPORT size_t msim_launch_size(void) { return sizeof(msim_launch); }
