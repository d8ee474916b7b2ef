// The read bandwidth a matmul that streams its weights once cannot beat: the time to read a
// buffer of the weights' size once per call, on N threads (OpenMP), each reading a contiguous
// share, nothing computed but an XOR of every 8 bytes (vectorized by the compiler).
//
//   cc -O3 -march=native -fopenmp benchmarks/read_bandwidth.c -o /tmp/read_bandwidth
//   OMP_NUM_THREADS=2 /tmp/read_bandwidth MB CALLS [COPIES]
//
// COPIES 1 reads the same buffer every call (the bench's --hot: what the last-level cache keeps
// of it between calls counts); COPIES 4 cycles through 4 buffers (past a 32 MB cache: cold).
// Prints the median and the fastest call.
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s MB CALLS [COPIES]\n", argv[0]);
    return 2;
  }
  const size_t words = ((size_t)atol(argv[1]) << 20) / 8;
  const int calls = atoi(argv[2]), copies = argc > 3 ? atoi(argv[3]) : 1;
  if (words == 0 || calls < 1 || copies < 1) {
    fprintf(stderr, "MB, CALLS and COPIES must be positive\n");
    return 2;
  }
  uint64_t* buf = aligned_alloc(64, words * 8 * (size_t)copies);
  double* times = malloc(sizeof(double) * (size_t)calls);
  if (buf == NULL || times == NULL) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  memset(buf, 1, words * 8 * (size_t)copies);
  uint64_t sink = 0;
  for (int c = -3; c < calls; ++c) {  // 3 calls to warm up
    const uint64_t* b = buf + (size_t)((c + copies * 3) % copies) * words;
    const double t0 = seconds();
    uint64_t x = 0;
#pragma omp parallel reduction(^ : x)
    {
      const size_t n = (size_t)omp_get_num_threads(), id = (size_t)omp_get_thread_num();
      const size_t lo = words * id / n, hi = words * (id + 1) / n;
      for (size_t i = lo; i < hi; ++i) x ^= b[i];
    }
    sink ^= x;
    if (c >= 0) times[c] = seconds() - t0;
  }
  qsort(times, (size_t)calls, sizeof(double), by_value);
  const double median = times[calls / 2], bytes = (double)words * 8;
  printf("%s MB, %d threads, %d copies: median %.3f ms (%.1f GB/s), fastest %.3f ms (%.1f GB/s)%s\n", argv[1],
         omp_get_max_threads(), copies, 1e3 * median, bytes / median / 1e9, 1e3 * times[0], bytes / times[0] / 1e9,
         sink == 42 ? " " : "");
  free(times);
  free(buf);
  return 0;
}
