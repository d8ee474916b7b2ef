// The shared part of the MPS executors (see metal_executor.h): plan -> Metal calls on PyTorch's
// MPS stream. Everything else (checks, routing, grids, bindings, constant bytes) is portable code
// that CI runs through metalsim (torch_qmm/metalsim_backend.py); keep this file thin.
//
// NOT RUN ON APPLE HARDWARE: written against Apple's documentation and the ATen/mps headers of
// the torch wheel, syntax-checked on Linux by tests/test_metal_mps_syntax.py.
//
// Rules followed (DESIGN.md "Apple facts"): encode inside dispatch_sync on the stream's queue,
// with the stream's shared commandEncoder(); never end the encoder or commit; bind a tensor's
// storage buffer at storage_offset() * element_size(); compile the embedded source once with
// fast math off; cache pipelines by name under a mutex. Works with and without ARC.
#include "metal_executor.h"

#include <ATen/mps/MPSStream.h>
#include <c10/util/Exception.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "metal_source.inc"  // kMetalSource: metal/ flattened by embed_metal.py

namespace torch_qmm {
namespace mps {
namespace {

#if __has_feature(objc_arc)
#define TQMM_RELEASE(x) (void)(x)
#else
#define TQMM_RELEASE(x) [(x) release]
#endif

id<MTLLibrary> metal_library(id<MTLDevice> device) {
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
    library = [device newLibraryWithSource:[NSString stringWithUTF8String:kMetalSource] options:options error:&error];
    TQMM_RELEASE(options);
    if (library == nil && error != nil) error_text = [[error localizedDescription] UTF8String];
  }
  TORCH_CHECK(library != nil, "torch_qmm: compiling the Metal kernels failed: ", error_text);
  return library;
}

id<MTLComputePipelineState> pipeline(id<MTLDevice> device, const std::string& name) {
  static std::mutex mu;
  static std::unordered_map<std::string, id<MTLComputePipelineState>> cache;
  id<MTLLibrary> library = metal_library(device);
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

}  // namespace

std::vector<plan::Launch> make_plan_checked(const plan::Problem& p) {
  try {
    return plan::make_plan(p);
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Pipelines are resolved before entering the queue so that nothing inside the block throws.
void encode(const std::vector<plan::Launch>& launches, const Operands& operands) {
  if (launches.empty()) return;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  id<MTLDevice> device = stream->device();
  std::vector<id<MTLComputePipelineState>> states;
  for (const plan::Launch& l : launches) states.push_back(pipeline(device, l.kernel));
  const std::vector<plan::Launch>* lp = &launches;
  const std::vector<id<MTLComputePipelineState>>* sp = &states;
  const Operands* op = &operands;
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      for (size_t i = 0; i < lp->size(); ++i) {
        const plan::Launch& l = (*lp)[i];
        [encoder setComputePipelineState:(*sp)[i]];
        for (const plan::Binding& b : l.buffers) {
          const at::Tensor& t = (*op)[b.operand];
          id<MTLBuffer> buffer = __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
          [encoder setBuffer:buffer
                      offset:NSUInteger(t.storage_offset() * t.element_size() + b.byte_offset)
                     atIndex:NSUInteger(b.index)];
        }
        // The family's params struct (AffineParams, GGUFParams) as 32-bit words.
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

}  // namespace mps
}  // namespace torch_qmm
