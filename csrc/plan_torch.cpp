// Validated problems (plan_torch.h) and the Python-visible planner ops, whose schemas are in
// csrc/ops.cpp:
//   _plan(op, M, N, K, bits, group_size, dtype, transpose, mode) -> JSON launches   (tests, tools)
//   _plan_for(op, tensors, bits, group_size, transpose, mode, dtype) -> JSON launches (validates
//                                                            first; metalsim's executor)
//   _plan_gguf(M, N, K, ggml_type, dtype)                  -> JSON launches   (tests, tools)
//   _plan_for_gguf(x, blocks, ggml_type, N, K)             -> JSON launches   (gguf_qmm's checks
//                                                            first; same arguments as gguf_qmm)
//   _plan_gather(M, N, K, pairs, experts, x_batch, bits, group_size, dtype, transpose, sorted,
//                mode)                                      -> JSON launches   (tests, tools)
//   _gather_operands(x, w, scales, biases, lhs_indices, rhs_indices, mode, bits, group_size,
//                    transpose, sorted_indices)             -> (JSON launches, lhs, rhs, order)
//                                                            (validates first; metalsim's executor
//                                                            binds what the MPS one binds)
//   _routes() -> JSON routing table
// (_plan_gather's and _gather_operands' schemas are defined here, the others' in csrc/ops.cpp.)
#include "plan_torch.h"

#include <ATen/ops/amax.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/broadcast_to.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/sub.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "format_spec.h"
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

// The format of `mode` (validated), which the Metal planner must serve.
const FormatSpec& metal_format(const char* op, std::string_view mode) {
  const FormatSpec& f = check_mode(op, mode);
  TORCH_CHECK_VALUE(plan::serves(f.mode), op, ": mode '", f.name, "' has no Metal kernels");
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
  plan::Problem p{plan::Op::kQmm, M, N, K, int(bits), int(group_size), plan_dtype(x.scalar_type()), transpose};
  p.mode = f.mode;
  return p;
}

plan::Problem dequantize_problem(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
                                 std::string_view mode, int64_t bits, int64_t group_size,
                                 std::optional<at::ScalarType> dtype) {
  const FormatSpec& f = check_mode("dequantize", mode);
  const PackedShape s = check_packed("dequantize", f, wq, scales, biases, bits, group_size);
  const at::ScalarType out = check_dequantize_dtype("dequantize", f, scales, dtype);
  metal_format("dequantize", mode);
  // The affine kernels compute in the scales' dtype (the CPU op's rounding); fp kernels write any.
  TORCH_CHECK_VALUE(f.scale != ScaleKind::kFloat || out == scales.scalar_type(),
                    "dequantize: argument 'dtype' must be the scales' dtype (", scales.scalar_type(),
                    ") for mode '", f.name, "' on Metal, got ", out);
  plan::Problem p{plan::Op::kDequantize, 0, s.rows, s.cols, int(bits), int(group_size), plan_dtype(out), true};
  p.mode = f.mode;
  return p;
}

plan::Problem quantize_problem(const at::Tensor& w, std::string_view mode, int64_t bits, int64_t group_size) {
  const FormatSpec& f = check_mode("quantize", mode);
  const auto [N, K] = check_quantize(f, w, bits, group_size);
  metal_format("quantize", mode);
  // A kernel cannot raise: the data-dependent checks run here, before any launch (synchronizes).
  // Every group's range max - min in float32 is finite iff w is finite and no range overflows
  // (the range matters only where the format has biases: affine).
  if (w.numel() != 0) {
    const at::Tensor groups = w.reshape({-1, group_size});
    const at::Tensor range = at::sub(groups.amax(-1).to(at::kFloat), groups.amin(-1).to(at::kFloat));
    if (!at::isfinite(range).all().item<bool>()) {
      check_quantize_finite(at::isfinite(w).all().item<bool>());
      check_quantize_range(!f.has_biases);
    }
  }
  plan::Problem p{plan::Op::kQuantize, 0, N, K, int(bits), int(group_size), plan_dtype(w.scalar_type()), true};
  p.mode = f.mode;
  return p;
}

GatherOperands gather_qmm_operands(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& biases,
                                   const std::optional<at::Tensor>& lhs_indices,
                                   const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                                   int64_t group_size, bool transpose, bool sorted_indices) {
  const FormatSpec& f = check_mode("gather_qmm", mode);
  const GatherShape s =
      check_gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, transpose);
  metal_format("gather_qmm", mode);
  auto flat = [&](const char* arg, const std::optional<at::Tensor>& idx, const at::Tensor& target, const char* name,
                  int64_t count) {
    at::Tensor i;
    if (idx) {
      i = *idx;
      if (i.numel() > 0) {  // a kernel cannot raise: out-of-range indices are refused here (synchronizes)
        const auto [lo, hi] = at::aminmax(i.to(at::kLong));
        check_gather_index_range(arg, lo.item<int64_t>(), hi.item<int64_t>(), count, name, target.sizes());
      }
    } else {
      i = at::arange(count, target.options().dtype(at::kInt)).reshape(target.sizes().slice(0, target.dim() - 2));
    }
    return at::broadcast_to(i, s.batch).reshape({-1}).to(at::kInt).contiguous();
  };
  GatherOperands g;
  g.lhs = flat("lhs_indices", lhs_indices, x, "x", s.x_batch);
  g.rhs = flat("rhs_indices", rhs_indices, w, "w", s.w_batch);
  g.batch = s.batch;
  plan::Problem& p = g.problem;
  p = plan::Problem{plan::Op::kGatherQmm, s.M, s.N, s.K, int(bits), int(group_size), plan_dtype(x.scalar_type()),
                    transpose};
  p.mode = f.mode;
  p.pairs = g.lhs.numel();
  p.experts = s.w_batch;
  p.x_batch = s.x_batch;
  p.sorted = sorted_indices;
  return g;
}

at::Tensor gather_order(const at::Tensor& rhs, plan::Launch::Order order) {
  if (order == plan::Launch::Order::kAsGiven) return at::arange(rhs.numel(), rhs.options().dtype(at::kInt));
  return std::get<1>(at::sort(rhs, /*stable=*/true, /*dim=*/0, /*descending=*/false)).to(at::kInt).contiguous();
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

std::string planned(const plan::Problem& p) {
  try {
    return plan::to_json(plan::make_plan(p));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

std::string plan_op(const std::string& op, int64_t M, int64_t N, int64_t K, int64_t bits, int64_t group_size,
                    at::ScalarType dtype, bool transpose, const std::string& mode) {
  const FormatSpec& f = metal_format("_plan", mode);
  check_bits_and_group_size("_plan", f, bits, group_size);
  TORCH_CHECK_VALUE(M >= 0 && N >= 0 && K >= 0, "_plan: M, N, K must be >= 0, got ", M, ", ", N, ", ", K);
  plan::Problem p{parse_op(op), M, N, K, int(bits), int(group_size), plan_dtype(dtype), transpose};
  p.mode = f.mode;
  return planned(p);
}

std::string plan_for_op(const std::string& op, const std::vector<std::optional<at::Tensor>>& args, int64_t bits,
                        int64_t group_size, bool transpose, const std::string& mode,
                        std::optional<at::ScalarType> dtype) {
  const plan::Op o = parse_op(op);
  const size_t want = o == plan::Op::kQmm ? 4 : o == plan::Op::kDequantize ? 3 : 1;
  TORCH_CHECK_VALUE(args.size() == want, "_plan_for: op '", op, "' takes ", want, " tensors, got ", args.size());
  // Every tensor but the biases (the last of qmm and dequantize) must be given.
  auto tensor = [&](size_t i) -> const at::Tensor& {
    TORCH_CHECK_VALUE(args[i].has_value(), "_plan_for: tensor ", i, " of op '", op, "' must not be None");
    return *args[i];
  };
  const plan::Problem p =
      o == plan::Op::kQmm ? qmm_problem(tensor(0), tensor(1), tensor(2), args[3], mode, bits, group_size, transpose)
      : o == plan::Op::kDequantize ? dequantize_problem(tensor(0), tensor(1), args[2], mode, bits, group_size, dtype)
                                   : quantize_problem(tensor(0), mode, bits, group_size);
  return planned(p);
}

std::string plan_gguf_op(int64_t M, int64_t N, int64_t K, int64_t ggml_type, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(gguf::is_native_gguf_type(ggml_type),
                    "_plan_gguf: argument 'ggml_type' must be one of ", gguf::native_gguf_types(), ", got ",
                    ggml_type);
  TORCH_CHECK_VALUE(M >= 0 && N >= 0 && K >= 0 && K % gguf::kQK_K == 0,
                    "_plan_gguf: M, N, K must be >= 0 and K a multiple of 256, got ", M, ", ", N, ", ", K);
  plan::Problem p{plan::Op::kGgufQmm, M, N, K, 0, 0, plan_dtype(dtype), true};
  p.ggml_type = int(ggml_type);
  return planned(p);
}

std::string plan_for_gguf_op(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t N,
                             int64_t K) {
  return planned(gguf_qmm_problem(x, blocks, ggml_type, N, K));
}

std::string plan_gather_op(int64_t M, int64_t N, int64_t K, int64_t pairs, int64_t experts, int64_t x_batch,
                           int64_t bits, int64_t group_size, at::ScalarType dtype, bool transpose, bool sorted,
                           const std::string& mode) {
  const FormatSpec& f = metal_format("_plan_gather", mode);
  check_bits_and_group_size("_plan_gather", f, bits, group_size);
  TORCH_CHECK_VALUE(M >= 0 && N >= 0 && K >= 0 && pairs >= 0, "_plan_gather: M, N, K, pairs must be >= 0, got ", M,
                    ", ", N, ", ", K, ", ", pairs);
  TORCH_CHECK_VALUE(experts >= 1 && x_batch >= 1, "_plan_gather: experts and x_batch must be >= 1, got ", experts,
                    ", ", x_batch);
  plan::Problem p{plan::Op::kGatherQmm, M, N, K, int(bits), int(group_size), plan_dtype(dtype), transpose};
  p.mode = f.mode;
  p.pairs = pairs;
  p.experts = experts;
  p.x_batch = x_batch;
  p.sorted = sorted;
  return planned(p);
}

std::tuple<std::string, at::Tensor, at::Tensor, at::Tensor> gather_operands_op(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const std::optional<at::Tensor>& biases,
    const std::optional<at::Tensor>& lhs_indices, const std::optional<at::Tensor>& rhs_indices,
    const std::string& mode, int64_t bits, int64_t group_size, bool transpose, bool sorted_indices) {
  const GatherOperands g = gather_qmm_operands(x, w, scales, biases, lhs_indices, rhs_indices, mode, bits, group_size,
                                               transpose, sorted_indices);
  std::vector<plan::Launch> launches;
  try {
    launches = plan::make_plan(g.problem);
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  const plan::Launch::Order order = launches.empty() ? plan::Launch::Order::kAsGiven : launches.front().order;
  return {plan::to_json(launches), g.lhs, g.rhs, gather_order(g.rhs, order)};
}

std::string routes_op() { return plan::routes_json(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_qmm, m) {
  m.def(
      "_plan_gather(int M, int N, int K, int pairs, int experts, int x_batch, int bits, int group_size, "
      "ScalarType dtype, bool transpose, bool sorted, str mode) -> str");
  m.def(
      "_gather_operands(Tensor x, Tensor w, Tensor scales, Tensor? biases, Tensor? lhs_indices, "
      "Tensor? rhs_indices, str mode, int bits, int group_size, bool transpose, bool sorted_indices) "
      "-> (str, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_qmm, CompositeExplicitAutograd, m) {
  m.impl("_plan_gather", &plan_gather_op);
  m.impl("_gather_operands", &gather_operands_op);
  m.impl("_plan", &plan_op);
  m.impl("_plan_for", &plan_for_op);
  m.impl("_plan_gguf", &plan_gguf_op);
  m.impl("_plan_for_gguf", &plan_for_gguf_op);
  m.impl("_routes", &routes_op);
}

}  // namespace torch_qmm
