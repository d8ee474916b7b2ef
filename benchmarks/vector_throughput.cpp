// What one core spends, at best, on the exact float32 products of the AVX-512 chunk kernels
// (csrc/cpu/chunk.h, gguf_f32.cpp): per 16 weights, the field of a packed dword masked in place,
// converted to float32 and multiplied into an accumulator (and + convert + FMA), against an FMA
// alone, a shift + table lookup (vpermps) + FMA, and one vdpbf16ps (32 bfloat16 products). Eight
// independent accumulators, operands in registers: no memory traffic, only the vector pipes.
//
//   g++ -O2 -march=native benchmarks/vector_throughput.cpp -o /tmp/vector_throughput
//   /tmp/vector_throughput
//
// Prints ns per step (one step = the instructions named, on one 512-bit vector) and the ratio to
// the FMA alone, whose throughput on cores that run 512-bit FMAs at one per cycle (Zen 4) is the
// clock period.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr int kChains = 8;
constexpr long kSteps = 20000000;

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

float total(const __m512 (&a)[kChains]) {
  float s = 0.0f;
  for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

// An empty asm that claims to change v: the compiler can neither hoist nor fold what computes it.
template <typename V>
inline void opaque(V& v) {
  asm volatile("" : "+v"(v));
}

__attribute__((noinline)) float fma_alone(long steps, __m512i) {
  __m512 a[kChains];
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.999f);
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long s = 0; s < steps; ++s)
#pragma GCC unroll 8
    for (int i = 0; i < kChains; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
  return total(a);
}

// Field j of every dword: w & (15 << 4j), converted (exact), times x.
__attribute__((noinline)) float and_convert_fma(long steps, __m512i w) {
  __m512 a[kChains];
  const __m512 x = _mm512_set1_ps(1.0001f);
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long s = 0; s < steps; ++s)
#pragma GCC unroll 8
    for (int i = 0; i < kChains; ++i) {
      __m512i mask = _mm512_set1_epi32(int(15u << (4 * (i & 7))));
      opaque(mask);
      a[i] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(_mm512_and_si512(w, mask)), x, a[i]);
    }
  return total(a);
}

// Field j of every dword: w >> 4j, its low 4 bits looked up in a 16-float table, times x.
__attribute__((noinline)) float shift_lookup_fma(long steps, __m512i w) {
  __m512 a[kChains];
  const __m512 x = _mm512_set1_ps(1.0001f);
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long s = 0; s < steps; ++s)
#pragma GCC unroll 8
    for (int i = 0; i < kChains; ++i) {
      __m512i shifted = _mm512_srli_epi32(w, 4 * (i & 7));
      opaque(shifted);
      a[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(shifted, table), x, a[i]);
    }
  return total(a);
}

#if defined(__AVX512BF16__)
__attribute__((noinline)) float bf16_dot(long steps, __m512i w) {
  __m512 a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long s = 0; s < steps; ++s)
#pragma GCC unroll 8
    for (int i = 0; i < kChains; ++i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)w, (__m512bh)w);
  return total(a);
}
#endif

}  // namespace

int main() {
  alignas(64) int32_t words[16];
  for (int i = 0; i < 16; ++i) words[i] = int32_t(0x01234567u * uint32_t(i + 1));
  const __m512i w = _mm512_load_si512(words);
  struct Case {
    const char* name;
    float (*run)(long, __m512i);
  } cases[] = {
      {"fma", fma_alone},
      {"and+convert+fma", and_convert_fma},
      {"shift+vpermps+fma", shift_lookup_fma},
#if defined(__AVX512BF16__)
      {"vdpbf16ps", bf16_dot},
#endif
  };
  double fma_ns = 0.0;
  for (const Case& c : cases) {
    c.run(kSteps / 10, w);  // warm up (clock, caches)
    const double t0 = seconds();
    const float sink = c.run(kSteps, w);
    const double ns = (seconds() - t0) / double(kSteps * kChains) * 1e9;
    if (fma_ns == 0.0) fma_ns = ns;
    std::printf("%-18s %.3f ns per step, %.2f x the FMA alone (%g)\n", c.name, ns, ns / fma_ns, double(sink));
  }
  return 0;
}
