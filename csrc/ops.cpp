// The op schemas of torch_qmm: written here once. Backends (csrc/cpu, csrc/mps) only add
// implementations; the Meta (fake) kernels are csrc/meta.cpp.
#include <Python.h>
#include <torch/library.h>

// An empty Python module so that `import torch_qmm._C` loads this library and runs the
// registrations below (pattern of pytorch/extension-cpp).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(torch_qmm, m) {
  m.def("affine_quantize(Tensor w, int bits, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("affine_dequantize(Tensor wq, Tensor scales, Tensor biases, int bits, int group_size) -> Tensor");
  m.def(
      "affine_qmm(Tensor x, Tensor wq, Tensor scales, Tensor biases, int bits, int group_size, "
      "bool transpose=True) -> Tensor");
  m.def("gguf_qmm(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> Tensor");
  // The Metal planner (csrc/plan*.cpp), for executors and tests: JSON launch lists, routing table.
  m.def(
      "_plan(str op, int M, int N, int K, int bits, int group_size, ScalarType dtype, bool transpose, "
      "str mode='affine') -> str");
  m.def("_plan_for(str op, Tensor[] args, int bits, int group_size, bool transpose) -> str");
  m.def("_plan_gguf(int M, int N, int K, int ggml_type, ScalarType dtype) -> str");
  m.def("_plan_for_gguf(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> str");
  m.def("_routes() -> str");
  // The CPU kernel affine_qmm would run for these operands (csrc/cpu/qmm.cpp), for tests/tools.
  m.def(
      "_cpu_route(Tensor x, Tensor wq, Tensor scales, Tensor biases, int bits, int group_size, "
      "bool transpose=True) -> str");
  m.def("_gguf_cpu_route(Tensor x, Tensor blocks, int ggml_type, int N, int K) -> str");
}
