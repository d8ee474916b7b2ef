// The family-independent half of the MPS executors (csrc/mps/*_mps.mm): the embedded Metal
// sources (metal/quant.metal + metal/gguf.metal, each kernel compiled on its first use), a
// pipeline cache, and encoding a plan's launches on PyTorch's MPS stream. Declared in plain C++ so that each op file stays a thin
// "validated problem -> plan -> operands -> encode" function.
//
// NOT RUN ON APPLE HARDWARE: syntax-checked on Linux by tests/test_metal_mps_syntax.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "../plan.h"

namespace torch_qmm {
namespace mps {

// The tensors a plan's bindings refer to, by plan::Operand. Each must be contiguous; it is
// bound at its storage buffer with offset storage_offset() * element_size() + binding offset.
struct Operands {
  std::array<at::Tensor, plan::kOperandCount> tensors;
  at::Tensor& operator[](plan::Operand o) { return tensors[size_t(o)]; }
  const at::Tensor& operator[](plan::Operand o) const { return tensors[size_t(o)]; }
};

// The quantized weight's operands (kWq, kScales, and kBiases when the format has them), contiguous.
void set_weight_operands(Operands& ops, const at::Tensor& wq, const at::Tensor& scales,
                         const std::optional<at::Tensor>& biases);

// The output operand [rows, cols] with `options`: zeros when no launch writes it (an empty
// problem plans none), uninitialized otherwise.
at::Tensor new_output(const std::vector<plan::Launch>& launches, int64_t rows, int64_t cols,
                      const at::TensorOptions& options);

// plan::make_plan with the planner's exceptions turned into ValueError.
std::vector<plan::Launch> make_plan_checked(const plan::Problem& p);

// Encodes the launches on the current MPS stream's shared compute encoder (no commit, no wait).
void encode(const std::vector<plan::Launch>& launches, const Operands& operands);

}  // namespace mps
}  // namespace torch_qmm
