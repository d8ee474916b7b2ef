// Time of the AVX2 GGUF exact kernels (csrc/cpu/gguf_avx2.cpp) at one row of x, per W row and
// super-block, measured in a plain process: no Python, no torch op, one thread pinned by the
// caller. Two measures:
//   block:  the kernel's block() on one tile of W rows over `--blocks` super-blocks, repeated,
//           everything in L1/L2 (the arithmetic alone);
//   driver: the whole call (chunk::run: x prepared, tiles, prefetch) over `--tiles` tiles of W
//           (W streamed from L3 or memory, as the bench's calls are).
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
//   taskset -c 0 /tmp/gguf_block_cycles --type Q4_K --ghz 3.1
#include "../csrc/cpu/gguf_avx2.cpp"

#include <omp.h>

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
  int blocks = 56, tiles = 64, reps = 200;
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

template <typename Fmt>
double block_ns(const Options& o, std::mt19937& g) {
  constexpr int R = Fmt::tile_rows(1);
  const std::vector<uint8_t> w = random_blocks(int64_t(R) * o.blocks, Fmt::kBlockBytes, o.type, g);
  std::vector<float> x(256 * o.blocks), xc(256 * o.blocks), xs(Fmt::kSide * o.blocks);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(g);
  for (int b = 0; b < o.blocks; ++b) Fmt::prepare(&x[256 * b], &xc[256 * b], &xs[Fmt::kSide * b]);
  __m256 acc[R][1];
  for (int r = 0; r < R; ++r) acc[r][0] = _mm256_setzero_ps();
  constexpr int kPasses = 20;
  double best = 1e30;
  for (int rep = 0; rep < o.reps; ++rep) {
    const auto t0 = Clock::now();
    for (int pass = 0; pass < kPasses; ++pass)
      for (int b = 0; b < o.blocks; ++b) {
        const uint8_t* blk[R];
        for (int r = 0; r < R; ++r) blk[r] = &w[(int64_t(r) * o.blocks + b) * Fmt::kBlockBytes];
        const float* xcp[1] = {&xc[256 * b]};
        const float* xsp[1] = {&xs[Fmt::kSide * b]};
        Fmt::template block<R, 1>(blk, xcp, xsp, acc);
      }
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / (kPasses * o.blocks * R));
  }
  float sink = 0.0f;
  for (int r = 0; r < R; ++r) sink += hsum(acc[r][0]);
  if (sink == 12345.0f) std::puts("");  // keeps the sums live
  return best;
}

double driver_ns(const Options& o, int64_t block_bytes, int tile_rows, std::mt19937& g) {
  const int64_t n = int64_t(o.tiles) * tile_rows;
  const std::vector<uint8_t> w = random_blocks(n * o.blocks, block_bytes, o.type, g);
  std::vector<float> x(256 * o.blocks), y(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(g);
  omp_set_num_threads(1);
  GgufArgs a{x.data(), w.data(), 1, n, 256 * int64_t(o.blocks), 0, false, true, true};
  double best = 1e30;
  for (int rep = 0; rep < std::max(10, o.reps / 4); ++rep) {
    const auto t0 = Clock::now();
    gguf_avx2(a, o.type, y.data());
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / double(n * o.blocks));
  }
  return best;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: gguf_block_cycles [--type Q4_K|Q6_K] [--blocks B] [--tiles T] [--reps N] [--ghz G] "
               "[--convert]\n",
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
    } else if (a == "--tiles") {
      o.tiles = std::atoi(value());
    } else if (a == "--reps") {
      o.reps = std::atoi(value());
    } else if (a == "--ghz") {
      o.ghz = std::atof(value());
    } else if (a == "--convert") {
      g_subnormal = false;
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  if (o.blocks < 1 || o.tiles < 1 || o.reps < 1 || !(o.ghz > 0)) usage("--blocks, --tiles, --reps and --ghz must be positive");
  std::mt19937 g(1);
  const bool q4k = o.type == 12;
  const double blk = g_subnormal ? (q4k ? block_ns<Q4K<Fields<true>>>(o, g) : block_ns<Q6K<Fields<true>>>(o, g))
                                 : (q4k ? block_ns<Q4K<Fields<false>>>(o, g) : block_ns<Q6K<Fields<false>>>(o, g));
  const double drv = q4k ? driver_ns(o, Q4K<Fields<true>>::kBlockBytes, Q4K<Fields<true>>::tile_rows(1), g)
                         : driver_ns(o, Q6K<Fields<true>>::kBlockBytes, Q6K<Fields<true>>::tile_rows(1), g);
  const char* fields = g_subnormal ? "subnormal fields" : "converted fields";
  std::printf("%s (%s), one row of x, per W row and super-block:\n", q4k ? "Q4_K" : "Q6_K", fields);
  std::printf("  block, %d super-blocks in L1/L2: %.2f ns, %.1f cycles at %.2f GHz\n", o.blocks, blk, blk * o.ghz, o.ghz);
  std::printf("  driver, %d tiles x %d super-blocks: %.2f ns, %.1f cycles\n", o.tiles, o.blocks, drv, drv * o.ghz);
}
