// MPS executor of the affine ops: validated problem -> plan (csrc/plan.cpp) -> Metal calls on
// PyTorch's MPS stream. Everything else (checks, routing, grids, bindings) is portable code
// that CI runs through metalsim (torch_qmm/metalsim_backend.py); keep this file thin.
//
// NOT RUN ON APPLE HARDWARE: written against Apple's documentation and the ATen/mps headers of
// the torch wheel, syntax-checked on Linux by tests/test_metal_mps_syntax.py.
//
// Rules followed (DESIGN.md "Apple facts"): encode inside dispatch_sync on the stream's queue,
// with the stream's shared commandEncoder(); never end the encoder or commit; bind a tensor's
// storage buffer at storage_offset() * element_size(); compile the embedded source once with
// fast math off; cache pipelines by name under a mutex. Works with and without ARC.
#include <ATen/core/Tensor.h>
#include <ATen/mps/MPSStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "../plan.h"
#include "../plan_torch.h"
#include "affine_metal_source.inc"  // kAffineMetalSource: metal/ flattened by embed_metal.py

namespace torch_qmm {
namespace {

#if __has_feature(objc_arc)
#define TQMM_RELEASE(x) (void)(x)
#else
#define TQMM_RELEASE(x) [(x) release]
#endif

id<MTLLibrary> affine_library(id<MTLDevice> device) {
  static std::mutex mu;
  static id<MTLLibrary> library = nil;  // compiled once per process, kept for its lifetime
  std::lock_guard<std::mutex> lock(mu);
  if (library != nil) return library;
  std::string error_text;
  @autoreleasepool {
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    // Fast math off: results must match the reference (fast math reassociates and flushes).
    if (@available(macOS 15.0, *)) {
      options.mathMode = MTLMathModeSafe;
    } else {
      options.fastMathEnabled = NO;
    }
    options.languageVersion = MTLLanguageVersion3_1;  // bfloat (macOS 14)
    NSError* error = nil;
    library = [device newLibraryWithSource:[NSString stringWithUTF8String:kAffineMetalSource]
                                   options:options
                                     error:&error];
    TQMM_RELEASE(options);
    if (library == nil && error != nil) error_text = [[error localizedDescription] UTF8String];
  }
  TORCH_CHECK(library != nil, "torch_qmm: compiling the Metal kernels failed: ", error_text);
  return library;
}

id<MTLComputePipelineState> pipeline(id<MTLDevice> device, const std::string& name) {
  static std::mutex mu;
  static std::unordered_map<std::string, id<MTLComputePipelineState>> cache;
  id<MTLLibrary> library = affine_library(device);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  id<MTLComputePipelineState> state = nil;
  std::string error_text;
  @autoreleasepool {
    id<MTLFunction> fn = [library newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
    TORCH_CHECK(fn != nil, "torch_qmm: kernel '", name, "' is missing from the Metal library");
    NSError* error = nil;
    state = [device newComputePipelineStateWithFunction:fn error:&error];
    TQMM_RELEASE(fn);
    if (state == nil && error != nil) error_text = [[error localizedDescription] UTF8String];
  }
  TORCH_CHECK(state != nil, "torch_qmm: pipeline for '", name, "' failed: ", error_text);
  cache.emplace(name, state);
  return state;
}

struct Operands {
  at::Tensor x, wq, scales, biases, y, w;
  const at::Tensor& get(plan::Operand o) const {
    switch (o) {
      case plan::Operand::kX:
        return x;
      case plan::Operand::kWq:
        return wq;
      case plan::Operand::kScales:
        return scales;
      case plan::Operand::kBiases:
        return biases;
      case plan::Operand::kY:
        return y;
      case plan::Operand::kW:
        return w;
    }
    return x;
  }
};

std::vector<plan::Launch> make_plan_checked(const plan::Problem& p) {
  try {
    return plan::make_plan(p);
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Encodes the launches on the current MPS stream. Pipelines are resolved before entering the
// queue so that nothing inside the block throws.
void encode(const std::vector<plan::Launch>& launches, const Operands& ops) {
  if (launches.empty()) return;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  id<MTLDevice> device = stream->device();
  std::vector<id<MTLComputePipelineState>> states;
  for (const plan::Launch& l : launches) states.push_back(pipeline(device, l.kernel));
  const std::vector<plan::Launch>* lp = &launches;
  const std::vector<id<MTLComputePipelineState>>* sp = &states;
  const Operands* op = &ops;
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      for (size_t i = 0; i < lp->size(); ++i) {
        const plan::Launch& l = (*lp)[i];
        [encoder setComputePipelineState:(*sp)[i]];
        for (const plan::Binding& b : l.buffers) {
          const at::Tensor& t = op->get(b.operand);
          id<MTLBuffer> buffer = __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
          [encoder setBuffer:buffer
                      offset:NSUInteger(t.storage_offset() * t.element_size() + b.byte_offset)
                     atIndex:NSUInteger(b.index)];
        }
        [encoder setBytes:l.params.data()
                   length:l.params.size() * sizeof(uint32_t)
                  atIndex:NSUInteger(l.params_index)];
        [encoder dispatchThreadgroups:MTLSizeMake(l.threadgroups[0], l.threadgroups[1], l.threadgroups[2])
                threadsPerThreadgroup:MTLSizeMake(l.threads_per_threadgroup[0], l.threads_per_threadgroup[1],
                                                  l.threads_per_threadgroup[2])];
      }
    }
  });
}

at::Tensor affine_qmm_mps(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                          const at::Tensor& biases, int64_t bits, int64_t group_size, bool transpose) {
  const plan::Problem p = qmm_problem(x, wq, scales, biases, bits, group_size, transpose);  // validates
  const std::vector<plan::Launch> launches = make_plan_checked(p);
  Operands ops;
  ops.x = x.reshape({p.M, p.K}).contiguous();
  ops.wq = wq.contiguous();
  ops.scales = scales.contiguous();
  ops.biases = biases.contiguous();
  ops.y = launches.empty() ? at::zeros({p.M, p.N}, x.options()) : at::empty({p.M, p.N}, x.options());
  encode(launches, ops);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.N;
  return ops.y.view(shape);
}

at::Tensor affine_dequantize_mps(const at::Tensor& wq, const at::Tensor& scales, const at::Tensor& biases,
                                 int64_t bits, int64_t group_size) {
  const plan::Problem p = dequantize_problem(wq, scales, biases, bits, group_size);
  const std::vector<plan::Launch> launches = make_plan_checked(p);
  Operands ops;
  ops.wq = wq.contiguous();
  ops.scales = scales.contiguous();
  ops.biases = biases.contiguous();
  ops.w = at::empty({p.N, p.K}, scales.options());
  encode(launches, ops);
  return ops.w;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> affine_quantize_mps(const at::Tensor& w, int64_t bits,
                                                                  int64_t group_size) {
  const plan::Problem p = quantize_problem(w, bits, group_size);  // validates, incl. NaN/Inf
  const std::vector<plan::Launch> launches = make_plan_checked(p);
  Operands ops;
  ops.w = w.reshape({p.N, p.K}).contiguous();
  ops.wq = at::empty({p.N, p.K * bits / 32}, w.options().dtype(at::kUInt32));
  ops.scales = at::empty({p.N, p.K / group_size}, w.options());
  ops.biases = at::empty({p.N, p.K / group_size}, w.options());
  encode(launches, ops);
  std::vector<int64_t> packed = w.sizes().vec(), groups = w.sizes().vec();
  packed.back() = p.K * bits / 32;
  groups.back() = p.K / group_size;
  return {ops.wq.view(packed), ops.scales.view(groups), ops.biases.view(groups)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, MPS, m) {
  m.impl("affine_qmm", &affine_qmm_mps);
  m.impl("affine_dequantize", &affine_dequantize_mps);
  m.impl("affine_quantize", &affine_quantize_mps);
}

}  // namespace torch_qmm
