/* metalsim runtime ABI: shared by the runtime (runtime.c, plain C) and the kernel
 * translation unit (the metal_stdlib shim + staged MSL, C++).  Keep it C. */
#ifndef METALSIM_RUNTIME_H
#define METALSIM_RUNTIME_H
#include <stdint.h>
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif

#define MSIM_MAX_BUFFERS 32
#define MSIM_MAX_TG_ARGS 32
#define MSIM_SIMD_WIDTH 32

struct msim_launch;
struct msim_tg;

/* One Metal thread (a fiber).  The kernel entry reads its builtins from here. */
typedef struct msim_thread {
  void *sp;                      /* saved stack pointer while suspended */
  uint32_t tpig[3], tgpig[3], tpitg[3], tptg[3], tgpg[3], tpg[3], dtptg[3];
  uint32_t tiitg, lane, sgitg, sgptg, width;
  int state;                     /* MSIM_RUNNABLE, ... */
  const void *site;              /* barrier / collective call site */
  int ckind;                     /* collective kind (for messages) */
  const char *cwhat;             /* collective name (for messages) */
  const void *cin;               /* collective: this lane's input */
  void *cout;                    /* collective: where this lane's result goes */
  void (*cfn)(uint32_t mask, const void *const *ins, void *const *outs);
  struct msim_tg *tg;
  void *const *tgargs;           /* [[threadgroup(n)]] argument pointers */
  char *stack;
} msim_thread;

typedef void (*msim_entry_fn)(const struct msim_launch *, const msim_thread *);
typedef void (*msim_combine_fn)(uint32_t mask, const void *const *ins, void *const *outs);

typedef struct msim_launch {
  msim_entry_fn entry;
  const char *kernel_name;
  void *bufs[MSIM_MAX_BUFFERS];          /* bound pointer (base + offset) per index */
  void *buf_base[MSIM_MAX_BUFFERS];      /* caller's allocation start */
  uint64_t buf_size[MSIM_MAX_BUFFERS];   /* caller's allocation size */
  uint64_t buf_offset[MSIM_MAX_BUFFERS];
  uint64_t tg_arg_size[MSIM_MAX_TG_ARGS];
  uint32_t unbound;                      /* bit i: buffer index i is declared but not bound */
  uint32_t groups[3];                    /* threadgroups per grid */
  uint32_t tptg[3];                      /* threads per threadgroup */
  uint32_t threads[3];                   /* threads per grid (dispatch_threads) */
  int nonuniform;
  int use_fibers;
  int check;                             /* fault checks */
  int count;                             /* byte counters */
  int nworkers;
  /* outputs */
  int fault;
  char fault_msg[2048];
  uint64_t bytes_loaded[MSIM_MAX_BUFFERS], bytes_stored[MSIM_MAX_BUFFERS];
  uint64_t unique_bytes[MSIM_MAX_BUFFERS], tg_footprint[MSIM_MAX_BUFFERS];
} msim_launch;

enum { MSIM_RUNNABLE = 0, MSIM_BARRIER = 1, MSIM_COLLECTIVE = 2, MSIM_EXITED = 3 };
enum { MSIM_C_SIMD = 0, MSIM_C_SHUFFLE = 1, MSIM_C_MATRIX = 2, MSIM_C_BARRIER = 3 };

/* Called by kernel code (through the shim). */
#ifdef __cplusplus
#define MSIM_CONVERGENT __attribute__((convergent, nomerge, noinline))
#else
#define MSIM_CONVERGENT
#endif
MSIM_CONVERGENT void msim_barrier(int flags);
MSIM_CONVERGENT void msim_collective(int kind, const char *what, const void *in, void *out, msim_combine_fn fn);
void *msim_tg_var(int id, size_t size, size_t align, const char *name);
void msim_fault_fc_unset(int index);
/* the result `out` (n bytes) of a shuffle by `lane` read inactive lane `src_lane`: in checked
 * mode it becomes undefined (poisoned), and a fault is reported where it is used */
void msim_poison_shuffle(void *out, size_t n, const char *what, uint32_t lane, uint32_t src_lane);
void msim_access(const void *p, size_t n, int is_store, int is_atomic);
const msim_thread *msim_current(void);

#ifdef __cplusplus
}
#endif
#endif
