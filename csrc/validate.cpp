#include "validate.h"

#include <c10/util/Exception.h>

#include "format.h"

namespace torch_qmm {

void check_bits_and_group_size(const char* op, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(is_supported_bits(bits), op, ": argument 'bits' must be one of 2, 3, 4, 5, 6, 8, got ",
                    bits);
  TORCH_CHECK_VALUE(is_supported_group_size(group_size), op,
                    ": argument 'group_size' must be one of 32, 64, 128, got ", group_size);
}

void check_float_dtype(const char* op, const char* arg, const at::Tensor& t) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": argument '", arg,
                   "' must be float32, float16 or bfloat16, got ", d);
}

PackedShape check_packed(const char* op, const at::Tensor& wq, const at::Tensor& scales,
                         const at::Tensor& biases, int64_t bits, int64_t group_size) {
  check_bits_and_group_size(op, bits, group_size);
  TORCH_CHECK_TYPE(wq.scalar_type() == at::kUInt32, op,
                   ": argument 'wq' must be uint32 (packed weights), got ", wq.scalar_type(),
                   " (an int32 tensor holding the same bits can be passed as wq.view(torch.uint32))");
  TORCH_CHECK_VALUE(wq.dim() == 2, op, ": argument 'wq' must be 2-D [rows, cols*bits/32], got shape ",
                    wq.sizes());
  check_float_dtype(op, "scales", scales);
  TORCH_CHECK_TYPE(biases.scalar_type() == scales.scalar_type(), op,
                   ": argument 'biases' must have the dtype of 'scales' (", scales.scalar_type(),
                   "), got ", biases.scalar_type());
  const int64_t rows = wq.size(0);
  const int64_t cols = wq.size(1) * 32 / bits;
  TORCH_CHECK_VALUE(wq.size(1) * 32 % bits == 0 && cols % group_size == 0, op,
                    ": argument 'wq' has ", wq.size(1), " words per row, which is not a whole number of ",
                    "groups of ", group_size, " ", bits, "-bit values");
  const std::vector<int64_t> expected{rows, cols / group_size};
  TORCH_CHECK_VALUE(scales.sizes() == at::IntArrayRef(expected), op, ": argument 'scales' must have shape ",
                    at::IntArrayRef(expected), " for wq of shape ", wq.sizes(), " with bits=", bits,
                    " and group_size=", group_size, ", got ", scales.sizes());
  TORCH_CHECK_VALUE(biases.sizes() == scales.sizes(), op, ": argument 'biases' must have shape ",
                    scales.sizes(), " (the shape of 'scales'), got ", biases.sizes());
  TORCH_CHECK_VALUE(wq.device() == scales.device() && wq.device() == biases.device(), op,
                    ": 'wq', 'scales' and 'biases' must be on one device, got ", wq.device(), ", ",
                    scales.device(), ", ", biases.device());
  return {rows, cols};
}

std::pair<int64_t, int64_t> check_quantize(const at::Tensor& w, int64_t bits, int64_t group_size) {
  const char* op = "affine_quantize";
  check_bits_and_group_size(op, bits, group_size);
  check_float_dtype(op, "w", w);
  TORCH_CHECK_VALUE(w.dim() >= 1, op, ": argument 'w' must have at least 1 dimension [..., K], got a scalar");
  const int64_t K = w.size(-1);
  TORCH_CHECK_VALUE(K % group_size == 0, op, ": the last dimension of 'w' (K=", K,
                    ") must be a multiple of group_size=", group_size);
  return {K == 0 ? 0 : w.numel() / K, K};
}

void check_quantize_finite(bool all_finite) {
  TORCH_CHECK_VALUE(all_finite, "affine_quantize: argument 'w' contains NaN or Inf; quantization needs finite ",
                    "weights (replace or clamp them first, e.g. torch.nan_to_num)");
}

void check_quantize_range(bool ranges_finite) {
  TORCH_CHECK_VALUE(ranges_finite, "affine_quantize: argument 'w' has a group whose range max - min exceeds ",
                    "the float32 maximum 3.4028235e+38 (its scale would be Inf); scale or clamp the weights first");
}

std::pair<int64_t, int64_t> check_qmm(const at::Tensor& x, const at::Tensor& wq,
                                      const at::Tensor& scales, const at::Tensor& biases,
                                      int64_t bits, int64_t group_size, bool transpose) {
  const char* op = "affine_qmm";
  const PackedShape w = check_packed(op, wq, scales, biases, bits, group_size);
  check_float_dtype(op, "x", x);
  TORCH_CHECK_TYPE(x.scalar_type() == scales.scalar_type(), op, ": argument 'x' must have the dtype of ",
                   "'scales' and 'biases' (", scales.scalar_type(), "), got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": argument 'x' must have at least 1 dimension [..., K], got a scalar");
  TORCH_CHECK_VALUE(x.device() == wq.device(), op, ": argument 'x' is on ", x.device(),
                    " but the packed weights are on ", wq.device());
  // transpose=True: W [N, K] stored row by row, quantized along K.
  // transpose=False: W [K, N] quantized along N (MLX's qvm layout).
  const int64_t K = transpose ? w.cols : w.rows;
  const int64_t N = transpose ? w.rows : w.cols;
  TORCH_CHECK_VALUE(x.size(-1) == K, op, ": argument 'x' must have last dimension K=", K,
                    " (from wq of shape ", wq.sizes(), ", bits=", bits, ", transpose=",
                    transpose ? "True" : "False", "), got x of shape ", x.sizes());
  return {N, K};
}

}  // namespace torch_qmm
