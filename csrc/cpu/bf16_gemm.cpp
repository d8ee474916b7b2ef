// qmm through bfloat16 GEMM (bf16_gemm.h). Each thread takes tiles of kTileRows rows of W,
// dequantizes one to bfloat16 [kTileRows, K] (the dequantize op: w rounded once to bfloat16) and
// multiplies it with bfloat16 x by at::mm (single-threaded inside at::parallel_for, under the
// caller's thread-local state as in qmm_gemm.cpp), which oneDNN runs on the matrix units. Whole
// rows of K per tile, so each y is accumulated in float32 by one GEMM and rounded once.
// Error against the exact product: |x - bf16(x)| <= 2^-9 |x| (0 for bfloat16 x), the same for
// w, and y's rounding to bfloat16: |y - x W| <= (2^-8 + 2^-18) sum |x| |w| + 2^-9 |y| + float32
// accumulation (tests/test_cpu_bf16_gemm.py).
#include "bf16_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

namespace torch_qmm {
namespace cpu {
namespace {

constexpr int64_t kTileRows = 256;

bool forced() {
  const char* v = std::getenv("TORCH_QMM_CPU_FORCE_BF16_GEMM");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
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

bool bf16_gemm_taken(const QmmArgs& a, bool transpose) {
  return transpose && a.M >= kBf16GemmMinRows && a.x_bf16_terms == 1 && !a.avoid_bf16 &&
         (bf16_matrix_units() || forced());
}

at::Tensor qmm_t_bf16_gemm(const QmmArgs& a, const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases,
                           std::string_view mode) {
  static const auto dequantize =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_qmm::dequantize", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            int64_t, int64_t, std::optional<at::ScalarType>)>();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor xb = at::from_blob(const_cast<float*>(a.x), {a.M, a.K}, f32).to(at::kBFloat16);
  at::Tensor y = at::empty({a.M, a.N}, f32.dtype(at::kBFloat16));
  const int64_t tiles = (a.N + kTileRows - 1) / kTileRows;
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, nn = std::min(kTileRows, a.N - n0);
      std::optional<at::Tensor> b;
      if (biases.defined()) b = biases.narrow(0, n0, nn);
      const at::Tensor w = dequantize.call(wq.narrow(0, n0, nn), scales.narrow(0, n0, nn), b, mode, a.bits,
                                           a.group_size, at::kBFloat16);
      y.narrow(1, n0, nn).copy_(at::mm(xb, w.t()));
    }
  });
  return y;
}

}  // namespace cpu
}  // namespace torch_qmm
