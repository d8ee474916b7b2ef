// Issue rates of 512-bit instructions on this CPU: cycles per instruction of the multiply-add
// family alone (12 independent accumulators), and the cycles a block of 12 FMAs takes with 4
// other instructions beside it (does the other instruction take an FMA pipe's turn?).
// Cycles are counted in TSC ticks and scaled by a dependent chain of 64-bit integer adds
// (one cycle each), so the result is in core cycles whatever the TSC frequency. With the argument
// `ymm`, the same for 256-bit instructions (AVX2 + FMA CPUs; 8 FMAs with 4 others beside them).
//   gcc -O2 -fno-ipa-ra -o /tmp/vector_issue_rates benchmarks/vector_issue_rates.c
//   /tmp/vector_issue_rates        (AVX-512)      /tmp/vector_issue_rates ymm        (AVX2)
#include <stdio.h>
#include <string.h>
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
  __attribute__((noinline)) static double NAME(void) {                                                                              \
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

// 256-bit: 12 independent destinations (alone), or 8 FMAs and 4 of another instruction.
#define Y2(I, A, B) I " %%ymm14, %%ymm15, %%ymm" #A "\n" I " %%ymm14, %%ymm15, %%ymm" #B "\n"
#define Y_ALONE(I) Y2(I, 0, 1) Y2(I, 2, 3) Y2(I, 4, 5) Y2(I, 6, 7) Y2(I, 8, 9) Y2(I, 10, 11)
#define Y_FMA8 Y2("vfmadd231ps", 0, 1) Y2("vfmadd231ps", 2, 3) Y2("vfmadd231ps", 4, 5) Y2("vfmadd231ps", 6, 7)
#define Y_BESIDE(I) Y_FMA8 Y2(I, 8, 9) Y2(I, 10, 11)
#define Y_BESIDE1(I) Y_FMA8 I " %%ymm15, %%ymm8\n" I " %%ymm15, %%ymm9\n" I " %%ymm15, %%ymm10\n" I " %%ymm15, %%ymm11\n"
TIMED(y_fma_alone, Y_ALONE("vfmadd231ps"), 12)
TIMED(y_and_alone, Y_ALONE("vpand"), 12)
TIMED(y_maddubs_alone, Y_ALONE("vpmaddubsw"), 12)
TIMED(y_permps_alone, Y_ALONE("vpermps"), 12)
TIMED(y_fma_only, Y_FMA8, 1)
TIMED(y_with_cvt, Y_BESIDE1("vcvtdq2ps"), 1)
TIMED(y_with_and, Y_BESIDE("vpand"), 1)
TIMED(y_with_addps, Y_BESIDE("vaddps"), 1)
TIMED(y_with_mulps, Y_BESIDE("vmulps"), 1)
TIMED(y_with_shufb, Y_BESIDE("vpshufb"), 1)
TIMED(y_with_permps, Y_BESIDE("vpermps"), 1)
TIMED(y_with_maddubs, Y_BESIDE("vpmaddubsw"), 1)

static int ymm_main(void) {
  for (int round = 0; round < 3; round++) {
    const double tick = 1.0 / adds();
    printf("round %d (%.3f cycles per TSC tick)\n", round + 1, tick);
    printf("  alone, cycles per instruction: vfmadd231ps %.2f, vpand %.2f, vpmaddubsw %.2f, vpermps %.2f\n",
           y_fma_alone() * tick, y_and_alone() * tick, y_maddubs_alone() * tick, y_permps_alone() * tick);
    printf("  8 FMAs: %.1f cycles; with 4 more of: vcvtdq2ps %.1f, vpand %.1f, vaddps %.1f, vmulps %.1f, vpshufb %.1f, "
           "vpermps %.1f, vpmaddubsw %.1f\n",
           y_fma_only() * tick, y_with_cvt() * tick, y_with_and() * tick, y_with_addps() * tick, y_with_mulps() * tick,
           y_with_shufb() * tick, y_with_permps() * tick, y_with_maddubs() * tick);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "ymm") == 0) return ymm_main();
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
