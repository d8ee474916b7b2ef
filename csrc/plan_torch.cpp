// Validated problems (plan_torch.h) and the Python-visible planner ops, whose schemas are in
// csrc/ops.cpp:
//   _plan(op, M, N, K, bits, group_size, dtype, transpose) -> JSON launches   (tests, tools)
//   _plan_for(op, tensors, bits, group_size, transpose)   -> JSON launches   (validates first;
//                                                            metalsim's executor)
//   _plan_gguf(M, N, K, ggml_type, dtype)                  -> JSON launches   (tests, tools)
//   _plan_for_gguf(x, blocks, ggml_type, N, K)             -> JSON launches   (gguf_qmm's checks
//                                                            first; same arguments as gguf_qmm)
//   _routes() -> JSON routing table
#include "plan_torch.h"

#include <ATen/ops/amax.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/sub.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "gguf_format.h"
#include "gguf_validate.h"
#include "validate.h"

namespace torch_qmm {

plan::DType plan_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return plan::DType::kFloat32;
    case at::kHalf:
      return plan::DType::kFloat16;
    case at::kBFloat16:
      return plan::DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "torch_qmm: Metal kernels take float32, float16 or bfloat16, got ", t);
  }
}

namespace {
// The format of `mode`, which the Metal planner must serve (affine only so far).
const FormatSpec& metal_format(const char* op, std::string_view mode) {
  const FormatSpec& f = check_mode(op, mode);
  TORCH_CHECK_VALUE(f.mode == Mode::kAffine, op, ": mode '", f.name, "' has no Metal kernels yet (supported: 'affine')");
  return f;
}
}  // namespace

plan::Problem qmm_problem(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, std::string_view mode, int64_t bits,
                          int64_t group_size, bool transpose) {
  const FormatSpec& f = check_mode("qmm", mode);
  const auto [N, K] = check_qmm(x, wq, scales, biases, f, bits, group_size, transpose);
  metal_format("qmm", mode);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  return {plan::Op::kQmm, M, N, K, int(bits), int(group_size), plan_dtype(x.scalar_type()), transpose};
}

plan::Problem dequantize_problem(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                                 std::string_view mode, int64_t bits, int64_t group_size) {
  const FormatSpec& f = check_mode("dequantize", mode);
  const PackedShape s = check_packed("dequantize", f, wq, scales, biases, bits, group_size);
  metal_format("dequantize", mode);
  return {plan::Op::kDequantize, 0, s.rows, s.cols, int(bits), int(group_size), plan_dtype(scales.scalar_type()),
          true};
}

plan::Problem quantize_problem(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size) {
  const FormatSpec& f = check_mode("quantize", mode);
  const auto [N, K] = check_quantize(f, w, bits, group_size);
  metal_format("quantize", mode);
  // A kernel cannot raise: the data-dependent checks run here, before any launch (synchronizes).
  // Every group's range max - min in float32 is finite iff w is finite and no range overflows.
  if (w.numel() != 0) {
    const at::Tensor groups = w.reshape({-1, group_size});
    const at::Tensor range = at::sub(groups.amax(-1).to(at::kFloat), groups.amin(-1).to(at::kFloat));
    if (!at::isfinite(range).all().item<bool>()) {
      check_quantize_finite(at::isfinite(w).all().item<bool>());
      check_quantize_range(false);
    }
  }
  return {plan::Op::kQuantize, 0, N, K, int(bits), int(group_size), plan_dtype(w.scalar_type()), true};
}

plan::Problem gguf_qmm_problem(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                               int64_t K) {
  check_gguf_qmm(x, blocks, ggml_type, N, K);
  const int64_t M = x.numel() / K;  // K > 0 (checked)
  plan::Problem p{plan::Op::kGgufQmm, M, N, K, 0, 0, plan_dtype(x.scalar_type()), true};
  p.ggml_type = int(ggml_type);
  return p;
}

namespace {

plan::Op parse_op(const std::string& op) {
  if (op == "qmm" || op == "affine_qmm") return plan::Op::kQmm;
  if (op == "dequantize" || op == "affine_dequantize") return plan::Op::kDequantize;
  if (op == "quantize" || op == "affine_quantize") return plan::Op::kQuantize;
  TORCH_CHECK_VALUE(false, "_plan: argument 'op' must be one of 'qmm', 'dequantize', 'quantize', got '", op, "'");
}

std::string plan_op(const std::string& op, int64_t M, int64_t N, int64_t K, int64_t bits, int64_t group_size,
                    at::ScalarType dtype, bool transpose) {
  check_bits_and_group_size("_plan", format_spec(Mode::kAffine), bits, group_size);
  TORCH_CHECK_VALUE(M >= 0 && N >= 0 && K >= 0, "_plan: M, N, K must be >= 0, got ", M, ", ", N, ", ", K);
  const plan::Problem p{parse_op(op), M, N, K, int(bits), int(group_size), plan_dtype(dtype), transpose};
  try {
    return plan::to_json(plan::make_plan(p));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

std::string plan_for_op(const std::string& op, const std::vector<at::Tensor>& args, int64_t bits,
                        int64_t group_size, bool transpose) {
  const plan::Op o = parse_op(op);
  const size_t want = o == plan::Op::kQmm ? 4 : o == plan::Op::kDequantize ? 3 : 1;
  TORCH_CHECK_VALUE(args.size() == want, "_plan_for: op '", op, "' takes ", want, " tensors, got ", args.size());
  plan::Problem p = o == plan::Op::kQmm
                        ? qmm_problem(args[0], args[1], args[2], args[3], "affine", bits, group_size, transpose)
                    : o == plan::Op::kDequantize ? dequantize_problem(args[0], args[1], args[2], "affine", bits, group_size)
                                                 : quantize_problem(args[0], "affine", bits, group_size);
  try {
    return plan::to_json(plan::make_plan(p));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

std::string plan_gguf_op(int64_t M, int64_t N, int64_t K, int64_t ggml_type, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(gguf::is_native_gguf_type(ggml_type),
                    "_plan_gguf: argument 'ggml_type' must be one of 12 (Q4_K), 14 (Q6_K), got ", ggml_type);
  TORCH_CHECK_VALUE(M >= 0 && N >= 0 && K >= 0 && K % gguf::kQK_K == 0,
                    "_plan_gguf: M, N, K must be >= 0 and K a multiple of 256, got ", M, ", ", N, ", ", K);
  plan::Problem p{plan::Op::kGgufQmm, M, N, K, 0, 0, plan_dtype(dtype), true};
  p.ggml_type = int(ggml_type);
  try {
    return plan::to_json(plan::make_plan(p));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

std::string plan_for_gguf_op(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                             int64_t K) {
  const plan::Problem p = gguf_qmm_problem(x, blocks, ggml_type, N, K);
  try {
    return plan::to_json(plan::make_plan(p));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

std::string routes_op() { return plan::routes_json(); }

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CompositeExplicitAutograd, m) {
  m.impl("_plan", &plan_op);
  m.impl("_plan_for", &plan_for_op);
  m.impl("_plan_gguf", &plan_gguf_op);
  m.impl("_plan_for_gguf", &plan_for_gguf_op);
  m.impl("_routes", &routes_op);
}

}  // namespace torch_qmm
