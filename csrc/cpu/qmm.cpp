// CPU qmm: y[..., N] = x[..., K] @ W, W given in any format of csrc/format_spec.h.
//
// This file is the op: validation, x to float32 (and, for affine, to codec order: decode.h),
// routing, and y back to x's dtype. Every mode is offered to the chunk kernels first
// (qmm_chunked.cpp: qmm_t_chunked_multiplier says whether they serve the call); affine then takes the
// fused kernels (qmm_fused.cpp, small M, W never materialized) or the GEMM kernels (qmm_gemm.cpp,
// large M, float32 tiles + BLAS); the fp modes take the GEMM kernels at every M.
// qmm_kernels.h holds the routing threshold. Accumulation is float32 throughout.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../validate.h"
#include "bf16_gemm.h"
#include "decode.h"
#include "qmm_kernels.h"
#include "work_split.h"
#include "x_rows.h"

namespace torch_qmm {
namespace {

// xf [M, K] with each 32-column block permuted to the codec order of `bits` (decode.h), so the
// fused/tiled kernels can multiply decoded lanes by contiguous x.
at::Tensor to_codec_order(const at::Tensor& xf, int bits) {
  if (cpu::codec_is_identity(bits)) return xf;
  const int64_t M = xf.size(0), K = xf.size(1);
  int64_t perm[32];
  for (int p = 0; p < 32; ++p) perm[p] = cpu::codec_to_natural(bits, p);
  at::Tensor xp = at::empty_like(xf);
  const float* src = xf.data_ptr<float>();
  float* dst = xp.data_ptr<float>();
  at::parallel_for(0, M * (K / 32), 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int p = 0; p < 32; ++p) dst[blk * 32 + p] = src[blk * 32 + perm[p]];
  });
  return xp;
}

// The checked, contiguous operands of one call and the kernel arguments pointing into them
// (x as float32 [M, K] in natural order).
struct Call {
  std::vector<int64_t> out_shape;
  at::Tensor xf, wq, scales, biases;
  cpu::QmmArgs a;
  bool empty;
};

Call prepare(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
             const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size,
             bool transpose) {
  const FormatSpec& f = check_mode("qmm", mode);
  const auto [N, K] = check_qmm(x, wq, scales, biases, f, bits, group_size, transpose);
  Call c;
  c.out_shape = x.sizes().vec();
  c.out_shape.back() = N;
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  c.empty = M == 0 || N == 0;
  if (c.empty) return c;
  c.wq = wq.contiguous();
  c.scales = scales.contiguous();
  if (biases) c.biases = biases->contiguous();
  cpu::XRows xr = cpu::x_rows(x, M, K);
  c.xf = std::move(xr.xf);
  cpu::QmmArgs& a = c.a;
  a.x_in_range = xr.in_range;
  a.mode = f.mode;
  a.x = c.xf.data_ptr<float>();
  a.wq = reinterpret_cast<const uint8_t*>(c.wq.data_ptr());
  a.scales = c.scales.data_ptr();
  a.biases = biases ? c.biases.data_ptr() : nullptr;
  a.dtype = c.scales.scalar_type();
  a.M = M;
  a.N = N;
  a.K = K;
  a.bits = int(bits);
  a.group_size = int(group_size);
  a.x_bf16_terms = cpu::x_bf16_terms_for(x.scalar_type());
  a.avoid_bf16 = cpu::avoid_bf16();
  return c;
}

enum class Route { kBf16Gemm, kChunked, kFused, kGemm };

// The one routing decision, for the op and for _cpu_route.
Route route_for(const cpu::QmmArgs& a, bool transpose) {
  const bool chunked = transpose && cpu::qmm_t_chunked_multiplier(a) != nullptr;
  if (cpu::bf16_gemm_taken(a, transpose, chunked)) return Route::kBf16Gemm;  // bf16_gemm.h: opt-in precision
  if (chunked) return Route::kChunked;
  if (a.mode != Mode::kAffine) return Route::kGemm;
  return a.M < cpu::kGemmMinRows ? Route::kFused : Route::kGemm;
}

at::Tensor qmm_cpu(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                   const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits, int64_t group_size,
                   bool transpose) {
  Call c = prepare(x, wq, scales, biases, mode, bits, group_size, transpose);
  if (c.empty) return at::zeros(c.out_shape, x.options());
  const at::Tensor yf = cpu::qmm_float(c.a, c.xf, transpose);
  return yf.to(x.scalar_type()).contiguous().reshape(c.out_shape);
}

// The threads a CPU call of x [..., K] by an N x K matrix runs on (work_split.h).
int64_t cpu_threads(const at::Tensor& x, int64_t N, int64_t K) {
  TORCH_CHECK_VALUE(K > 0 && N > 0 && x.numel() % K == 0, "_cpu_threads: x of ", x.numel(), " elements is not rows of K = ", K,
                    " (N = ", N, ")");
  return cpu::threads_for_work(x.numel() / K, N, K);
}

// The spans of W rows such a call's threads take (work_split.h: SpanSchedule), as n0, n1 pairs.
std::vector<int64_t> cpu_spans(const at::Tensor& x, int64_t N, int64_t K) {
  const cpu::SpanSchedule spans(N, cpu_threads(x, N, K));
  std::vector<int64_t> bounds;
  for (int64_t i = 0; i < spans.count; ++i) {
    const auto [n0, n1] = spans.rows(i);
    bounds.insert(bounds.end(), {n0, n1});
  }
  return bounds;
}

// Which CPU kernel qmm would run: "gemm-bf16" (bf16_gemm.h), "chunked/<multiplier>"
// (qmm_kernels.h), "fused", "gemm", or
// "empty" (for a finite result; a call whose chunked, gemm-bf16 or transposed fused result is not
// finite is redone by "gemm").
std::string qmm_cpu_route(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, int64_t bits, int64_t group_size, bool transpose,
                          std::string_view mode) {
  const Call c = prepare(x, wq, scales, biases, mode, bits, group_size, transpose);
  if (c.empty) return "empty";
  switch (route_for(c.a, transpose)) {
    case Route::kChunked: return std::string("chunked/") + cpu::qmm_t_chunked_multiplier(c.a);
    case Route::kFused: return "fused";
    case Route::kBf16Gemm: return "gemm-bf16";
    default: return "gemm";
  }
}

}  // namespace

namespace cpu {
at::Tensor qmm_float(QmmArgs a, at::Tensor xf, bool transpose) {
  a.x = xf.data_ptr<float>();
  const Route route = route_for(a, transpose);
  // The chunk kernels and the transpose=True fused kernel hoist the bias (s*sum(q*x) + b*sum(x)),
  // and the bfloat16 GEMM rounds w and runs on matrix units that flush subnormals; where that
  // gives a non-finite value (Inf/NaN in x, scales or biases, or an overflow) it need not be the
  // one IEEE arithmetic on the dequantized weights gives (F.linear's: e.g. +Inf in x times
  // weights of both signs), so those calls are redone by the GEMM kernels, which multiply the
  // dequantized weights in float32.
  if (route == Route::kChunked) {  // x in natural order
    at::Tensor yf = at::empty({a.M, a.N}, xf.options());
    cpu::qmm_t_chunked(a, yf.data_ptr<float>());
    if (cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return yf;
  }
  if (transpose && a.mode == Mode::kAffine) {
    xf = to_codec_order(xf, a.bits);
    a.x = xf.data_ptr<float>();
  }
  if (route == Route::kBf16Gemm) {  // bfloat16 y, exactly representable in float32
    at::Tensor yf = cpu::qmm_t_bf16_gemm(a).to(at::kFloat).contiguous();
    if (cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return yf;
  }
  if (route == Route::kFused) {
    at::Tensor yf = at::empty({a.M, a.N}, xf.options());
    if (!transpose) {
      cpu::qmm_n_fused(a, yf.data_ptr<float>());
      return yf;
    }
    cpu::qmm_t_fused(a, yf.data_ptr<float>());
    if (cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return yf;
  }
  return transpose ? cpu::qmm_t_gemm(a) : cpu::qmm_n_gemm(a);
}

bool all_finite(const float* y, int64_t n) {
  // Exponent bits all ones <=> Inf or NaN; an integer count (vectorizes, unlike float tests).
  const int64_t bad = at::parallel_reduce(
      0, n, int64_t(1) << 16, int64_t(0),
      [&](int64_t i0, int64_t i1, int64_t acc) {
        const uint32_t* u = reinterpret_cast<const uint32_t*>(y);
        for (int64_t i = i0; i < i1; ++i) acc += (u[i] & 0x7f800000u) == 0x7f800000u;
        return acc;
      },
      [](int64_t p, int64_t q) { return p + q; });
  return bad == 0;
}

bool avoid_bf16() {
  const char* v = std::getenv("TORCH_QMM_CPU_NO_BF16");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

bool float32_fma_first() {
  if (const char* v = std::getenv("TORCH_QMM_CPU_FMA_FIRST"); v != nullptr && v[0] != '\0') return v[0] != '0';
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

int x_bf16_terms_for(at::ScalarType x_dtype) {
  if (x_dtype == at::kBFloat16) return 1;
  if (x_dtype == at::kHalf) return 2;
  switch (at::globalContext().float32MatmulPrecision()) {
    case at::Float32MatmulPrecision::MEDIUM: return 1;
    case at::Float32MatmulPrecision::HIGH: return 2;
    default: return 3;
  }
}
}  // namespace cpu

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("qmm", &qmm_cpu);
  m.impl("_cpu_route", &qmm_cpu_route);
  m.impl("_cpu_threads", &cpu_threads);
  m.impl("_cpu_spans", &cpu_spans);
}

}  // namespace torch_qmm
