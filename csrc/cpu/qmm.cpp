// CPU affine_qmm: y[..., N] = x[..., K] @ W, W given in the affine format.
//
// Small M: fused decode-and-dot, W never materialized. Each group of W is decoded once into
// float32 and reused for every row of x; the bias term is hoisted per group:
//   y[m, n] += s * sum_j(q_j * x[m, j]) + b * sum_j(x[m, j]).
// Large M: W is decoded in row blocks to float32 and multiplied with a BLAS GEMM.
// Accumulation is float32 throughout.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "../format.h"
#include "../validate.h"

namespace torch_qmm {
namespace {

// Rows of x above which decoding W to float32 tiles and calling GEMM beats the fused loop.
constexpr int64_t kGemmMinRows = 16;
// W rows decoded per GEMM block (bounded float32 scratch: kGemmBlockRows * K * 4 bytes).
constexpr int64_t kGemmBlockRows = 256;

void decode_group(const uint8_t* row, int64_t k0, int group_size, int bits, float s, float b, float* dst) {
  for (int j = 0; j < group_size; ++j) dst[j] = s * float(unpack_element(row, k0 + j, bits)) + b;
}

// transpose=True: W [N, K], wq [N, K*bits/32]. xf [M, K] float32, yf [M, N] float32.
template <typename T>
void qmm_t_fused(const float* xf, const uint8_t* wq, const T* scales, const T* biases, float* yf, int64_t M,
                 int64_t N, int64_t K, int bits, int group_size) {
  const int64_t groups = K / group_size;
  const int64_t row_bytes = packed_words(K, bits) * 4;
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> q(group_size);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wq + n * row_bytes;
      for (int64_t m = 0; m < M; ++m) yf[m * N + n] = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        for (int j = 0; j < group_size; ++j) q[j] = float(unpack_element(row, g * group_size + j, bits));
        const float s = float(scales[n * groups + g]), b = float(biases[n * groups + g]);
        for (int64_t m = 0; m < M; ++m) {
          const float* xg = xf + m * K + g * group_size;
          float qx = 0.0f, sx = 0.0f;
          for (int j = 0; j < group_size; ++j) {
            qx += q[j] * xg[j];
            sx += xg[j];
          }
          yf[m * N + n] += s * qx + b * sx;
        }
      }
    }
  });
}

// transpose=False: W [K, N] quantized along N, wq [K, N*bits/32].
template <typename T>
void qmm_n_fused(const float* xf, const uint8_t* wq, const T* scales, const T* biases, float* yf, int64_t M,
                 int64_t N, int64_t K, int bits, int group_size) {
  const int64_t groups = N / group_size;
  const int64_t row_bytes = packed_words(N, bits) * 4;
  // Each task owns whole column groups of y, so no two tasks write the same output.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> w(group_size);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < group_size; ++j) yf[m * N + g * group_size + j] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        decode_group(wq + k * row_bytes, g * group_size, group_size, bits, float(scales[k * groups + g]),
                     float(biases[k * groups + g]), w.data());
        for (int64_t m = 0; m < M; ++m) {
          const float xv = xf[m * K + k];
          float* yg = yf + m * N + g * group_size;
          for (int j = 0; j < group_size; ++j) yg[j] += xv * w[j];
        }
      }
    }
  });
}

// Decodes stored rows [r0, r1) of the packed matrix to float32 [r1 - r0, cols].
template <typename T>
void decode_rows(const uint8_t* wq, const T* scales, const T* biases, float* dst, int64_t r0, int64_t r1,
                 int64_t cols, int bits, int group_size) {
  const int64_t groups = cols / group_size;
  const int64_t row_bytes = packed_words(cols, bits) * 4;
  at::parallel_for(r0, r1, 4, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      for (int64_t g = 0; g < groups; ++g)
        decode_group(wq + r * row_bytes, g * group_size, group_size, bits, float(scales[r * groups + g]),
                     float(biases[r * groups + g]), dst + (r - r0) * cols + g * group_size);
  });
}

at::Tensor affine_qmm_cpu(const at::Tensor& x, const at::Tensor& wq_in, const at::Tensor& scales_in,
                          const at::Tensor& biases_in, int64_t bits, int64_t group_size, bool transpose) {
  const auto [N, K] = check_qmm(x, wq_in, scales_in, biases_in, bits, group_size, transpose);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (M == 0 || N == 0) return at::zeros(out_shape, x.options());

  const at::Tensor wq = wq_in.contiguous(), scales = scales_in.contiguous(), biases = biases_in.contiguous();
  const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({M, N}, xf.options());
  const auto* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const int b = int(bits), g = int(group_size);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scales.scalar_type(), "affine_qmm", [&] {
    const auto* s = scales.data_ptr<scalar_t>();
    const auto* bi = biases.data_ptr<scalar_t>();
    if (M < kGemmMinRows) {
      if (transpose)
        qmm_t_fused(xf.data_ptr<float>(), w, s, bi, yf.data_ptr<float>(), M, N, K, b, g);
      else
        qmm_n_fused(xf.data_ptr<float>(), w, s, bi, yf.data_ptr<float>(), M, N, K, b, g);
      return;
    }
    const int64_t rows = transpose ? N : K, cols = transpose ? K : N;
    if (!transpose) {
      at::Tensor wf = at::empty({rows, cols}, xf.options());
      decode_rows(w, s, bi, wf.data_ptr<float>(), 0, rows, cols, b, g);
      at::mm_out(yf, xf, wf);
      return;
    }
    at::Tensor wf = at::empty({std::min(kGemmBlockRows, rows), cols}, xf.options());
    for (int64_t r0 = 0; r0 < rows; r0 += kGemmBlockRows) {
      const int64_t r1 = std::min(rows, r0 + kGemmBlockRows);
      decode_rows(w, s, bi, wf.data_ptr<float>(), r0, r1, cols, b, g);
      at::Tensor y_block = yf.narrow(1, r0, r1 - r0);
      y_block.copy_(at::mm(xf, wf.narrow(0, 0, r1 - r0).t()));
    }
  });
  return yf.to(x.scalar_type()).reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) { m.impl("affine_qmm", &affine_qmm_cpu); }

}  // namespace torch_qmm
