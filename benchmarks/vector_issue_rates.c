// Issue rates of 512-bit instructions on this CPU: cycles per instruction of the multiply-add
// family alone (12 independent accumulators), and the cycles a block of 12 FMAs takes with 4
// other instructions beside it (does the other instruction take an FMA pipe's turn?).
// Cycles are counted in TSC ticks and scaled by a dependent chain of 64-bit integer adds
// (one cycle each), so the result is in core cycles whatever the TSC frequency.
//   gcc -O2 -o /tmp/vector_issue_rates benchmarks/vector_issue_rates.c && /tmp/vector_issue_rates
#include <stdio.h>
#include <x86intrin.h>

#define ITERS 20000000L
#define REP(S) S S S S
#define FMA12                                                                                             \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm0\n vfmadd231ps %%zmm30, %%zmm31, %%zmm1\n"                          \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm2\n vfmadd231ps %%zmm30, %%zmm31, %%zmm3\n"                          \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm4\n vfmadd231ps %%zmm30, %%zmm31, %%zmm5\n"                          \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm6\n vfmadd231ps %%zmm30, %%zmm31, %%zmm7\n"                          \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm8\n vfmadd231ps %%zmm30, %%zmm31, %%zmm9\n"                          \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm10\n vfmadd231ps %%zmm30, %%zmm31, %%zmm11\n"
#define ALONE(I)                                                                                          \
  I " %%zmm30, %%zmm31, %%zmm0\n" I " %%zmm30, %%zmm31, %%zmm1\n" I " %%zmm30, %%zmm31, %%zmm2\n"          \
  I " %%zmm30, %%zmm31, %%zmm3\n" I " %%zmm30, %%zmm31, %%zmm4\n" I " %%zmm30, %%zmm31, %%zmm5\n"          \
  I " %%zmm30, %%zmm31, %%zmm6\n" I " %%zmm30, %%zmm31, %%zmm7\n" I " %%zmm30, %%zmm31, %%zmm8\n"          \
  I " %%zmm30, %%zmm31, %%zmm9\n" I " %%zmm30, %%zmm31, %%zmm10\n" I " %%zmm30, %%zmm31, %%zmm11\n"
#define BESIDE(I)                                                                                         \
  FMA12 I " %%zmm28, %%zmm16\n" I " %%zmm28, %%zmm17\n" I " %%zmm28, %%zmm18\n" I " %%zmm28, %%zmm19\n"
#define BESIDE3(I)                                                                                        \
  FMA12 I " %%zmm28, %%zmm29, %%zmm16\n" I " %%zmm28, %%zmm29, %%zmm17\n" I " %%zmm28, %%zmm29, %%zmm18\n" \
      I " %%zmm28, %%zmm29, %%zmm19\n"
#define TIMED(NAME, BODY, PER)                                                                            \
  static double NAME(void) {                                                                              \
    unsigned long long t0 = __rdtsc();                                                                    \
    for (long n = 0; n < ITERS; n++) __asm__ volatile(BODY ::: "rax", "memory");                                \
    return (double)(__rdtsc() - t0) / (ITERS * (double)(PER));                                            \
  }

TIMED(adds, REP(REP("add $1, %%rax\n")), 16)
TIMED(fma_alone, ALONE("vfmadd231ps"), 12)
TIMED(dpbf16, ALONE("vdpbf16ps"), 12)
TIMED(dpbusd, ALONE("vpdpbusd"), 12)
TIMED(dpwssd, ALONE("vpdpwssd"), 12)
TIMED(fma_only, FMA12, 1)
TIMED(with_cvt, BESIDE("vcvtdq2ps"), 1)
TIMED(with_and, BESIDE3("vpandd"), 1)
TIMED(with_shufb, BESIDE3("vpshufb"), 1)
TIMED(with_permb, BESIDE3("vpermb"), 1)
TIMED(with_addps, BESIDE3("vaddps"), 1)
TIMED(with_mulps, BESIDE3("vmulps"), 1)
TIMED(with_dpbf16, BESIDE3("vdpbf16ps"), 1)

int main(void) {
  for (int round = 0; round < 3; round++) {
    const double tick = 1.0 / adds();  // cycles per TSC tick
    printf("round %d (%.3f cycles per TSC tick)\n", round + 1, tick);
    printf("  alone, cycles per instruction: vfmadd231ps %.2f, vdpbf16ps %.2f, vpdpbusd %.2f, vpdpwssd %.2f\n",
           fma_alone() * tick, dpbf16() * tick, dpbusd() * tick, dpwssd() * tick);
    printf("  12 FMAs: %.1f cycles; with 4 more of: vcvtdq2ps %.1f, vpandd %.1f, vpshufb %.1f, vpermb %.1f, "
           "vaddps %.1f, vmulps %.1f, vdpbf16ps %.1f\n",
           fma_only() * tick, with_cvt() * tick, with_and() * tick, with_shufb() * tick, with_permb() * tick,
           with_addps() * tick, with_mulps() * tick, with_dpbf16() * tick);
  }
  return 0;
}
