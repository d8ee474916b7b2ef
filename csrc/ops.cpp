// The op schemas of torch_qmm: written here once. Backends (csrc/cpu, csrc/mps) only add
// implementations; the Meta (fake) kernels are csrc/meta.cpp. The mode is MLX's mode string,
// one of the formats of csrc/format_spec.h; biases are given exactly for the modes that have them.
//
// The affine_* ops are aliases of quantize / dequantize / qmm with mode "affine", implemented
// here once (CompositeImplicitAutograd: they decompose into the general ops, whose backends,
// Meta kernels and autograd rules serve them).
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "format_spec.h"

// An empty Python module so that `import torch_qmm._C` loads this library and runs the
// registrations below (pattern of pytorch/extension-cpp).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(torch_qmm, m) {
  m.def("quantize(Tensor w, str mode, int bits, int group_size) -> Tensor[]");
  m.def(
      "dequantize(Tensor wq, Tensor scales, Tensor? biases, str mode, int bits, int group_size, "
      "ScalarType? dtype=None) -> Tensor");
  m.def(
      "qmm(Tensor x, Tensor wq, Tensor scales, Tensor? biases, str mode, int bits, int group_size, "
      "bool transpose=True) -> Tensor");
  m.def("affine_quantize(Tensor w, int bits, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("affine_dequantize(Tensor wq, Tensor scales, Tensor biases, int bits, int group_size) -> Tensor");
  m.def(
      "affine_qmm(Tensor x, Tensor wq, Tensor scales, Tensor biases, int bits, int group_size, "
      "bool transpose=True) -> Tensor");
  // mlx.core.gather_qmm: y[*batch, M, N] = x[lhs_indices] @ W[rhs_indices] (csrc/validate.h,
  // check_gather_qmm; docs/design.md, "gather_qmm").
  m.def(
      "gather_qmm(Tensor x, Tensor w, Tensor scales, Tensor? biases, Tensor? lhs_indices, Tensor? rhs_indices, "
      "str mode, int bits, int group_size, bool transpose, bool sorted_indices) -> Tensor");
  m.def("gguf_qmm(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> Tensor");
  // qmm (transpose=True) with x quantized to int8 per block of 32: an opt-in approximation
  // (csrc/cpu/actq_qmm.cpp, docs/activation-quantization.md).
  m.def(
      "qmm_int8_activations(Tensor x, Tensor wq, Tensor scales, Tensor? biases, str mode, int bits, "
      "int group_size) -> Tensor");
  // gather_qmm (transpose=True) with each pair's rows of x quantized as qmm_int8_activations
  // quantizes them: the same opt-in (csrc/cpu/gather_qmm.cpp).
  m.def(
      "gather_qmm_int8_activations(Tensor x, Tensor w, Tensor scales, Tensor? biases, Tensor? lhs_indices, "
      "Tensor? rhs_indices, str mode, int bits, int group_size, bool sorted_indices) -> Tensor");
  // gguf_qmm with x quantized to int8 per super-block of 256: the same opt-in (csrc/cpu/actq_gguf.cpp).
  m.def("gguf_qmm_int8_activations(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> Tensor");
  // The format table (csrc/format_spec.h) as JSON, read once by torch_qmm/formats.py.
  m.def("_formats() -> str");
  // The Metal planner (csrc/plan*.cpp), for executors and tests: JSON launch lists, routing table.
  m.def(
      "_plan(str op, int M, int N, int K, int bits, int group_size, ScalarType dtype, bool transpose, "
      "str mode='affine') -> str");
  m.def(
      "_plan_for(str op, Tensor?[] args, int bits, int group_size, bool transpose, str mode='affine', "
      "ScalarType? dtype=None) -> str");
  m.def("_plan_gguf(int M, int N, int K, int ggml_type, ScalarType dtype) -> str");
  m.def("_plan_for_gguf(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> str");
  m.def("_routes() -> str");
  // The CPU kernel qmm would run for these operands (csrc/cpu/qmm.cpp), for tests/tools.
  m.def(
      "_cpu_route(Tensor x, Tensor wq, Tensor scales, Tensor? biases, int bits, int group_size, "
      "bool transpose=True, str mode=\"affine\") -> str");
  m.def("_gguf_cpu_route(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> str");
  // The threads a CPU kernel call of x [..., K] by an N x K matrix runs on (csrc/cpu/work_split.h).
  m.def("_cpu_threads(Tensor x, int N, int K) -> int");
  m.def("_cpu_spans(Tensor x, int N, int K) -> int[]");
  m.def("_gguf_cpu_route_int8_activations(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> str");
  m.def(
      "_cpu_route_int8_activations(Tensor x, Tensor wq, Tensor scales, Tensor? biases, str mode, int bits, "
      "int group_size) -> str");
}

namespace torch_qmm {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> affine_quantize(const at::Tensor& w, int64_t bits, int64_t group_size) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_qmm::quantize", "")
                             .typed<std::vector<at::Tensor>(const at::Tensor&, std::string_view, int64_t, int64_t)>();
  const std::vector<at::Tensor> out = op.call(w, "affine", bits, group_size);
  return {out[0], out[1], out[2]};
}

at::Tensor affine_dequantize(const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases, int64_t bits,
                             int64_t group_size) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_qmm::dequantize", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            int64_t, int64_t, std::optional<at::ScalarType>)>();
  return op.call(wq, scales, biases, "affine", bits, group_size, std::nullopt);
}

at::Tensor affine_qmm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases,
                      int64_t bits, int64_t group_size, bool transpose) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_qmm::qmm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, int64_t, int64_t, bool)>();
  return op.call(x, wq, scales, biases, "affine", bits, group_size, transpose);
}

std::string formats_op() { return formats_json(); }

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CompositeImplicitAutograd, m) {
  m.impl("affine_quantize", &affine_quantize);
  m.impl("affine_dequantize", &affine_dequantize);
  m.impl("affine_qmm", &affine_qmm);
}

TORCH_LIBRARY_IMPL(torch_qmm, CompositeExplicitAutograd, m) { m.impl("_formats", &formats_op); }

}  // namespace torch_qmm
