#include "gguf_validate.h"

#include <c10/util/Exception.h>

#include "gguf_format.h"
#include "validate.h"

namespace torch_qmm {

namespace {
const char* type_hint(int64_t t) {
  switch (t) {
    case gguf::kTypeQ4_0: return " (Q4_0: convert it to the affine format, torch_qmm.interop.gguf.to_affine)";
    case gguf::kTypeQ4_1: return " (Q4_1: convert it to the affine format, torch_qmm.interop.gguf.to_affine)";
    case gguf::kTypeQ5_0: return " (Q5_0: convert it to the affine format, torch_qmm.interop.gguf.to_affine)";
    case gguf::kTypeQ5_1: return " (Q5_1: convert it to the affine format, torch_qmm.interop.gguf.to_affine)";
    case gguf::kTypeQ8_0: return " (Q8_0: convert it to the affine format, torch_qmm.interop.gguf.to_affine)";
    case gguf::kTypeIQ4_NL: return " (IQ4_NL: convert it to the affine format, torch_qmm.interop.gguf.to_affine)";
    case gguf::kTypeMXFP4: return " (MXFP4: it is MLX's mxfp4, torch_qmm.interop.gguf.to_fp)";
    default: return "";
  }
}
}  // namespace

void check_gguf_qmm(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N, int64_t K) {
  const char* op = "gguf_qmm";
  TORCH_CHECK_VALUE(gguf::is_native_gguf_type(ggml_type), op,
                    ": argument 'ggml_type' must be one of ", gguf::native_gguf_types(), ", got ", ggml_type,
                    type_hint(ggml_type));
  TORCH_CHECK_VALUE(K > 0 && K % gguf::kQK_K == 0, op, ": argument 'K' must be a positive multiple of ",
                    gguf::kQK_K, " (the super-block size), got ", K);
  TORCH_CHECK_VALUE(N >= 0, op, ": argument 'N' must be >= 0, got ", N);
  TORCH_CHECK_TYPE(blocks.scalar_type() == at::kByte, op,
                   ": argument 'blocks' must be uint8 (the GGUF block bytes), got ", blocks.scalar_type());
  const int64_t row_bytes = K / gguf::kQK_K * gguf::block_bytes(ggml_type);
  TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.sym_size(0) == N && blocks.sym_size(1) == row_bytes, op,
                    ": argument 'blocks' must have shape [N, K/256*", gguf::block_bytes(ggml_type), "] = [", N,
                    ", ", row_bytes, "] for N=", N, ", K=", K, ", got ", blocks.sym_sizes());
  check_float_dtype(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.sym_size(-1) == K, op, ": argument 'x' must have last dimension K=", K,
                    ", got x of shape ", x.sym_sizes());
  TORCH_CHECK_VALUE(x.device() == blocks.device(), op, ": argument 'x' is on ", x.device(),
                    " but 'blocks' is on ", blocks.device());
}

void check_gguf_int8_activations(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                                 int64_t K) {
  check_gguf_qmm(x, blocks, ggml_type, N, K);
  TORCH_CHECK_VALUE(ggml_type == gguf::kTypeQ4_K || ggml_type == gguf::kTypeQ6_K,
                    "gguf_qmm_int8_activations: argument 'ggml_type' must be one of 12 (Q4_K), 14 (Q6_K) (the types "
                    "with int8-activation kernels), got ", ggml_type, "; gguf_qmm multiplies it with x exact");
}

}  // namespace torch_qmm
