// CPU affine_qmm: y[..., N] = x[..., K] @ W, W given in the affine format.
//
// This file is the op: validation, x to float32 (and to codec order, decode.h), routing by M,
// and y back to x's dtype. The kernels are in qmm_fused.cpp (small M, W never materialized) and
// qmm_gemm.cpp (large M, float32 tiles + BLAS); qmm_kernels.h holds the routing threshold.
// Accumulation is float32 throughout.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "../validate.h"
#include "decode.h"
#include "qmm_kernels.h"

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

at::Tensor affine_qmm_cpu(const at::Tensor& x, const at::Tensor& wq_in, const at::Tensor& scales_in,
                          const at::Tensor& biases_in, int64_t bits, int64_t group_size, bool transpose) {
  const auto [N, K] = check_qmm(x, wq_in, scales_in, biases_in, bits, group_size, transpose);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (M == 0 || N == 0) return at::zeros(out_shape, x.options());

  const at::Tensor wq = wq_in.contiguous(), scales = scales_in.contiguous(), biases = biases_in.contiguous();
  at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();

  cpu::QmmArgs a;
  a.x = xf.data_ptr<float>();
  a.wq = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  a.scales = scales.data_ptr();
  a.biases = biases.data_ptr();
  a.dtype = scales.scalar_type();
  a.M = M;
  a.N = N;
  a.K = K;
  a.bits = int(bits);
  a.group_size = int(group_size);

  if (transpose && M == 1 && bits == 4) {  // token decode: its own kernel, x in natural order
    at::Tensor yf = at::empty({1, N}, xf.options());
    if (cpu::qmm_t_gemv_q4(a, yf.data_ptr<float>())) return yf.to(x.scalar_type()).reshape(out_shape);
  }
  if (transpose) {
    xf = to_codec_order(xf, int(bits));
    a.x = xf.data_ptr<float>();
  }

  at::Tensor yf;
  if (M < cpu::kGemmMinRows) {
    yf = at::empty({M, N}, xf.options());
    if (transpose)
      cpu::qmm_t_fused(a, yf.data_ptr<float>());
    else
      cpu::qmm_n_fused(a, yf.data_ptr<float>());
  } else {
    yf = transpose ? cpu::qmm_t_gemm(a) : cpu::qmm_n_gemm(a);
  }
  return yf.to(x.scalar_type()).contiguous().reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) { m.impl("affine_qmm", &affine_qmm_cpu); }

}  // namespace torch_qmm
