// Time of the AVX2 GGUF exact kernels (csrc/cpu/gguf_avx2.cpp) at 1, 2 or 4 rows of x (`--m`),
// per W row, x row and super-block, measured in a plain process: no Python, no torch op. Two
// measures:
//   block:  the kernel's block() on one tile of W rows over `--blocks` super-blocks, repeated,
//           everything in L1/L2 (the arithmetic alone; one thread);
//   driver: the whole call (chunk::run: x prepared, tiles, prefetch) over W
//           (`--n` W rows: 512 stream from L3, 4096 from memory, as the bench's calls do), on
//           `--threads` threads (the time per unit times the threads: one thread's share).
// The minimum of many repetitions is reported (a shared machine adds time, never removes it), in
// nanoseconds and in cycles at the clock given (--ghz). It includes the kernel's source file, so
// a change to gguf_avx2.cpp is measured by rebuilding this program (seconds), not the extension.
//
// Build and run (benchmarks/README.md, "Timing a kernel outside Python"):
//   TORCH=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   c++ -O3 -std=c++17 -march=native -fopenmp -w -Icsrc -I$TORCH/include \
//     -I$TORCH/include/torch/csrc/api/include $(python3-config --includes) \
//     benchmarks/gguf_block_cycles.cpp -o /tmp/gguf_block_cycles \
//     -L$TORCH/lib -lc10 -ltorch_cpu -Wl,-rpath,$TORCH/lib
//   taskset -c 0 /tmp/gguf_block_cycles --type Q4_K --m 1 --ghz 3.1   (one thread: pin it; two:
//   /tmp/gguf_block_cycles --threads 2 --n 4096, not pinned to one CPU)
#include "../csrc/cpu/gguf_avx2.cpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// The extension's switches, defined in other translation units: the AVX2 kernels allowed, and
// subnormal fields as the command line says.
static bool g_subnormal = true;
namespace torch_qmm {
namespace cpu {
bool avx2_chunks_avoided() { return false; }
bool subnormal_fields_enabled() { return g_subnormal; }
}  // namespace cpu
}  // namespace torch_qmm

namespace {

using namespace torch_qmm::cpu;
using Clock = std::chrono::steady_clock;

struct Options {
  int type = 12;  // ggml type: 12 Q4_K, 14 Q6_K
  int m = 1, blocks = 56, n = 512, reps = 200, threads = 1;
  double ghz = 3.1;
};

// Random blocks with the f16 scales at small normal values (as the bench's random_gguf_blocks).
std::vector<uint8_t> random_blocks(int64_t count, int64_t block_bytes, int type, std::mt19937& g) {
  std::vector<uint8_t> w(count * block_bytes);
  for (auto& b : w) b = uint8_t(g());
  std::uniform_real_distribution<float> scale(1e-4f, 2.1e-3f);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t off : type == 12 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{208}) {
      const c10::Half h(scale(g));
      std::memcpy(&w[i * block_bytes + off], &h, 2);
    }
  return w;
}

template <typename Fmt, int MB>
double block_ns(const Options& o, std::mt19937& g) {
  constexpr int R = Fmt::tile_rows(MB);
  const std::vector<uint8_t> w = random_blocks(int64_t(R) * o.blocks, Fmt::kBlockBytes, o.type, g);
  const int64_t per_row = 256 * int64_t(o.blocks);
  std::vector<float> x(MB * per_row), xc(MB * per_row), xs(MB * Fmt::kSide * o.blocks);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(g);
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < o.blocks; ++b)
      Fmt::prepare(&x[m * per_row + 256 * b], &xc[m * per_row + 256 * b], &xs[(m * o.blocks + b) * Fmt::kSide]);
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  constexpr int kPasses = 20;
  double best = 1e30;
  for (int rep = 0; rep < o.reps; ++rep) {
    const auto t0 = Clock::now();
    for (int pass = 0; pass < kPasses; ++pass)
      for (int b = 0; b < o.blocks; ++b) {
        const uint8_t* blk[R];
        for (int r = 0; r < R; ++r) blk[r] = &w[(int64_t(r) * o.blocks + b) * Fmt::kBlockBytes];
        const float* xcp[MB];
        const float* xsp[MB];
        for (int m = 0; m < MB; ++m) {
          xcp[m] = &xc[m * per_row + 256 * b];
          xsp[m] = &xs[(m * o.blocks + b) * Fmt::kSide];
        }
        Fmt::template block<R, MB>(blk, xcp, xsp, acc);
      }
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / (kPasses * o.blocks * R * MB));
  }
  float sink = 0.0f;
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) sink += hsum(acc[r][m]);
  if (sink == 12345.0f) std::puts("");  // keeps the sums live
  return best;
}

template <typename Fmt>
double block_ns(const Options& o, std::mt19937& g) {
  return o.m == 1 ? block_ns<Fmt, 1>(o, g) : o.m == 2 ? block_ns<Fmt, 2>(o, g) : block_ns<Fmt, 4>(o, g);
}

// The whole call at o.m rows of x; also names the kernel it took.
double driver_ns(const Options& o, int64_t block_bytes, std::mt19937& g, const char** route) {
  const int64_t n = o.n;
  const std::vector<uint8_t> w = random_blocks(n * o.blocks, block_bytes, o.type, g);
  std::vector<float> x(o.m * 256 * int64_t(o.blocks)), y(o.m * n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(g);
  at::set_num_threads(o.threads);
  GgufArgs a{};
  a.x = x.data();
  a.blocks = w.data();
  a.M = o.m;
  a.N = n;
  a.K = 256 * int64_t(o.blocks);
  a.x_in_range = a.x_in_subnormal_range = true;  // normal x of unit scale: in both ranges
  *route = gguf_avx2_multiplier(a, o.type);
  double best = 1e30;
  for (int rep = 0; rep < std::max(10, o.reps / 4); ++rep) {
    const auto t0 = Clock::now();
    gguf_avx2(a, o.type, y.data());
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() * o.threads /
                              double(n * o.blocks * o.m));
  }
  return best;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: gguf_block_cycles [--type Q4_K|Q6_K] [--m 1|2|4] [--blocks B] [--n N] [--threads N] [--reps N] "
               "[--ghz G] [--convert]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--type") {
      const std::string t = value();
      if (t != "Q4_K" && t != "Q6_K") usage(("--type: expected Q4_K or Q6_K, got " + t).c_str());
      o.type = t == "Q4_K" ? 12 : 14;
    } else if (a == "--blocks") {
      o.blocks = std::atoi(value());
    } else if (a == "--n") {
      o.n = std::atoi(value());
    } else if (a == "--reps") {
      o.reps = std::atoi(value());
    } else if (a == "--m") {
      o.m = std::atoi(value());
      if (o.m != 1 && o.m != 2 && o.m != 4) usage("--m: expected 1, 2 or 4 rows of x");
    } else if (a == "--threads") {
      o.threads = std::atoi(value());
    } else if (a == "--ghz") {
      o.ghz = std::atof(value());
    } else if (a == "--convert") {
      g_subnormal = false;
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  if (o.blocks < 1 || o.n < 1 || o.reps < 1 || o.threads < 1 || !(o.ghz > 0))
    usage("--blocks, --n, --reps, --threads and --ghz must be positive");
  std::mt19937 g(1);
  const bool q4k = o.type == 12;
  const double blk = g_subnormal ? (q4k ? block_ns<Q4K<Fields<true>>>(o, g) : block_ns<Q6K<Fields<true>>>(o, g))
                                 : (q4k ? block_ns<Q4K<Fields<false>>>(o, g) : block_ns<Q6K<Fields<false>>>(o, g));
  const char* route = "";
  const double drv = driver_ns(o, q4k ? Q4K<Fields<true>>::kBlockBytes : Q6K<Fields<true>>::kBlockBytes, g, &route);
  const char* fields = g_subnormal ? "subnormal fields" : "converted fields";
  std::printf("%s, %d row(s) of x, per W row, x row and super-block:\n", q4k ? "Q4_K" : "Q6_K", o.m);
  std::printf("  block (%s), %d super-blocks in L1/L2: %.2f ns, %.1f cycles at %.2f GHz\n", fields, o.blocks, blk, blk * o.ghz,
              o.ghz);
  std::printf("  driver (%s), N = %d W rows x %d super-blocks, %d thread(s): %.2f ns per thread, %.1f cycles; %.3f ms per call\n",
              route, o.n, o.blocks, o.threads, drv, drv * o.ghz, drv * 1e-6 * o.n * o.blocks * o.m / o.threads);
}
