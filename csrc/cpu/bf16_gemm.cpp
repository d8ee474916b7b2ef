// qmm through bfloat16 GEMM (bf16_gemm.h). Each thread takes tiles of W rows (whole rows of K),
// decodes each row to float32 (decode_tile.h: w = s * q + b, or element * scale, in float32),
// rounds it to bfloat16 (to nearest even) into the tile, and multiplies the tile with bfloat16 x
// by at::mm (single-threaded inside at::parallel_for, under the caller's thread-local state as in
// qmm_gemm.cpp), which oneDNN runs on the matrix units. Whole rows of K per tile, so each y is
// accumulated in float32 by one GEMM and rounded once to bfloat16.
// Error against the exact product: |x - bf16(x)| <= 2^-8 |x| (0 for bfloat16 x), the same for w
// (plus w's float32 rounding), and y's rounding to bfloat16: the bound of "medium" precision in
// torch_qmm/tolerance.py (tests/test_cpu_bf16_gemm.py).
#include "bf16_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "decode_tile.h"

namespace torch_qmm {
namespace cpu {
namespace {

// A tile of bfloat16 W is at most this large (rows x K x 2 bytes): it stays in L2 while the GEMM
// reads it.
constexpr int64_t kTileBytes = 512 * 1024;

// W rows per tile for K: as many as fit kTileBytes, in multiples of 16, 16 to 256.
int64_t tile_rows(int64_t K) { return std::clamp<int64_t>(kTileBytes / (2 * K) / 16 * 16, 16, 256); }

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// dst[0 .. n) = src rounded to bfloat16 (nearest even; NaN stays NaN).
void round_to_bf16(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), reinterpret_cast<__m512i>(v));
  }
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// y [M, N] bfloat16 with W decoded by `decode` (decode_tile.h).
template <typename Decode>
at::Tensor bf16_gemm(const QmmArgs& a, Decode decode) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat), bf16 = f32.dtype(at::kBFloat16);
  const at::Tensor xbT = at::from_blob(const_cast<float*>(a.x), {a.M, a.K}, f32).to(at::kBFloat16).t();
  at::Tensor yT = at::empty({a.N, a.M}, bf16);
  const int64_t rows = tile_rows(a.K), tiles = (a.N + rows - 1) / rows;
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    std::vector<float> row(a.K);
    at::Tensor tile = at::empty({rows, a.K}, bf16);
    c10::BFloat16* tp = tile.data_ptr<c10::BFloat16>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * rows, nn = std::min(rows, a.N - n0);
      for (int64_t r = 0; r < nn; ++r) {
        decode(a.K, n0 + r, 1, 0, a.K, row.data());
        round_to_bf16(row.data(), a.K, tp + r * a.K);
      }
      at::Tensor out = yT.narrow(0, n0, nn);
      at::mm_out(out, tile.narrow(0, 0, nn), xbT);
    }
  });
  return yT.t();
}

}  // namespace

bool bf16_matrix_units() {
  static const bool has = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    auto on = [&](const char* key) {
      const auto it = caps.find(key);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    return on("amx_bf16") || on("avx512_bf16");
  }();
  return has;
}

bool bf16_matrix_tiles() {
  static const bool has = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("amx_bf16");
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  }();
  return has;
}

bool bf16_gemm_taken(const QmmArgs& a, bool transpose, bool chunk_serves) {
  if (!transpose || a.M < kBf16GemmMinRows || a.x_bf16_terms != 1 || a.avoid_bf16 ||
      env_on("TORCH_QMM_CPU_NO_BF16_GEMM"))
    return false;
  if (env_on("TORCH_QMM_CPU_FORCE_BF16_GEMM")) return true;
  return bf16_matrix_units() && (bf16_matrix_tiles() || !chunk_serves);
}

at::Tensor qmm_t_bf16_gemm(const QmmArgs& a) {
  if (a.mode != Mode::kAffine) return bf16_gemm(a, fp_decoder(a));
  at::Tensor y;
  dispatch_bits_dtype(a.bits, a.dtype,
                      [&](auto bits_c, auto t) { y = bf16_gemm(a, affine_decoder<decltype(bits_c)::value, decltype(t)>(a)); });
  return y;
}

}  // namespace cpu
}  // namespace torch_qmm
