// The shared part of the MPS executors (see metal_executor.h): plan -> Metal calls on PyTorch's
// MPS stream. Everything else (checks, routing, grids, bindings, constant bytes) is portable code
// that CI runs through metalsim (torch_qmm/metalsim_backend.py); keep this file thin.
//
// NOT RUN ON APPLE HARDWARE: written against Apple's documentation and the ATen/mps headers of
// the torch wheel, syntax-checked on Linux by tests/test_metal_mps_syntax.py.
//
// Rules followed: encode inside dispatch_sync on the stream's queue, with the stream's shared
// commandEncoder(); never end the encoder or commit; bind a tensor's storage buffer at
// storage_offset() * element_size(); compile with fast math off; cache pipelines by name. Works
// with and without ARC.
//
// A kernel's function comes from the metallib built at install time when there is one (next to
// the extension module, loaded once with newLibraryWithURL:error:; metallib_choice.h decides);
// otherwise it is compiled on first use, one at a time: kernel `name` is its library's headers +
// its one instantiation line (metal_kernel_source.h), the source torch_qmm/metal_source.py's
// kernel_source(name) gives and that CI compiles with metalsim. A first call then compiles the
// kernel it launches, not every instantiation of metal/.
#include "metal_executor.h"

#include <ATen/mps/MPSStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "metal_kernel_source.h"  // kernel_source(name), kMetallibName
#include "metallib_choice.h"

// MTLCompileOptions' mathMode and mathFloatingPointFunctions, and their enums, are declared by the
// macOS 15 SDK and later only (@available below is a run-time check and declares nothing). With
// an older SDK they are declared here with the macOS 15 SDK's names and values, as ATen's
// MPSGraphSequoiaOps.h does; the code reaches them only when running on macOS 15+, whose
// MTLCompileOptions implements them.
#if !defined(__MAC_15_0)
typedef enum : NSInteger {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
} MTLMathMode;

typedef enum : NSInteger {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1,
} MTLMathFloatingPointFunctions;

@interface MTLCompileOptions ()
@property(readwrite, nonatomic) MTLMathMode mathMode;
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions;
@end
#endif  // !defined(__MAC_15_0)

namespace torch_qmm {
namespace mps {
namespace {

#if __has_feature(objc_arc)
#define TQMM_RELEASE(x) (void)(x)
#else
#define TQMM_RELEASE(x) [(x) release]
#endif

// The install-time metallib, loaded once (nil when there is none, it fails to load, or
// TORCH_QMM_METALLIB=0); kept for the process's lifetime.
id<MTLLibrary> installed_library(id<MTLDevice> device) {
  static id<MTLLibrary> library = [&]() -> id<MTLLibrary> {
    if (!metallib_enabled(std::getenv("TORCH_QMM_METALLIB"))) return nil;
    Dl_info info;
    if (dladdr((const void*)&installed_library, &info) == 0 || info.dli_fname == nullptr) return nil;
    const std::string path = metallib_path(info.dli_fname, kMetallibName);
    id<MTLLibrary> loaded = nil;
    @autoreleasepool {
      NSError* error = nil;  // a missing or unreadable file: compile from source instead
      loaded = [device newLibraryWithURL:[NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]]
                                   error:&error];
    }
    return loaded;
  }();
  return library;
}

// The pipeline of `fn`; nil with error_text set on failure.
id<MTLComputePipelineState> make_pipeline(id<MTLDevice> device, id<MTLFunction> fn, std::string& error_text) {
  NSError* error = nil;
  id<MTLComputePipelineState> state = [device newComputePipelineStateWithFunction:fn error:&error];
  if (state == nil) {
    error_text = "making the pipeline failed: ";
    if (error != nil) error_text += [[error localizedDescription] UTF8String];
  }
  return state;
}

// Makes kernel `name`'s pipeline from the installed metallib, else from its source compiled
// alone. Nothing inside @autoreleasepool throws: errors are collected and raised after it.
id<MTLComputePipelineState> compile_pipeline(id<MTLDevice> device, const std::string& name) {
  std::string error_text;
  id<MTLComputePipelineState> state = nil;
  id<MTLLibrary> installed = installed_library(device);
  @autoreleasepool {
    id<MTLFunction> shipped =
        installed == nil ? nil : [installed newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
    if (kernel_origin(true, installed != nil, shipped != nil) == KernelOrigin::kMetallib) {
      state = make_pipeline(device, shipped, error_text);
      TQMM_RELEASE(shipped);
    }
  }
  if (state != nil) return state;
  const std::string source = kernel_source(name);
  TORCH_CHECK(!source.empty(), "torch_qmm: no Metal kernel named '", name, "' in the embedded source");
  error_text.clear();
  @autoreleasepool {
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    // Fast math off: results must match the reference (fast math reassociates and flushes). On
    // macOS 15+ that is two settings, as PyTorch's compileLibrary sets them: mathMode Safe, and
    // precise floating-point functions (exp, log, ... default to the fast variants otherwise).
    // Before macOS 15, fastMathEnabled = NO turns both off; the macOS 15 SDK deprecates it.
    if (@available(macOS 15.0, *)) {
      options.mathMode = MTLMathModeSafe;
      options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
    } else {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
      options.fastMathEnabled = NO;
#pragma clang diagnostic pop
    }
    options.languageVersion = MTLLanguageVersion3_1;  // bfloat (macOS 14)
    NSError* error = nil;
    id<MTLLibrary> library = [device newLibraryWithSource:[NSString stringWithUTF8String:source.c_str()]
                                                  options:options
                                                    error:&error];
    TQMM_RELEASE(options);
    if (library == nil) {
      error_text = "compiling the Metal source failed: ";
      if (error != nil) error_text += [[error localizedDescription] UTF8String];
    } else {
      id<MTLFunction> fn = [library newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      if (fn == nil) {
        error_text = "the compiled source has no function of that name";
      } else {
        state = make_pipeline(device, fn, error_text);
        TQMM_RELEASE(fn);
      }
      TQMM_RELEASE(library);  // the pipeline state does not need it
    }
  }
  TORCH_CHECK(state != nil, "torch_qmm: Metal kernel '", name, "': ", error_text);
  return state;
}

// One slot per kernel name: the map's lock is held only to find the slot, the slot's lock while
// its kernel compiles, so a first use of one kernel does not stall launches of the others. A
// failed compile leaves the slot empty (the next call tries again and raises the same error).
struct PipelineSlot {
  std::mutex mu;
  id<MTLComputePipelineState> state = nil;  // kept for the process's lifetime
};

id<MTLComputePipelineState> pipeline(id<MTLDevice> device, const std::string& name) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<PipelineSlot>> slots;
  PipelineSlot* slot = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    std::unique_ptr<PipelineSlot>& s = slots[name];
    if (!s) s = std::make_unique<PipelineSlot>();
    slot = s.get();
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->state == nil) slot->state = compile_pipeline(device, name);
  return slot->state;
}

// Raises unless `state` can run launch `l` as planned: the plan's threads per threadgroup fit
// the pipeline's limit (which depends on the kernel's registers and threadgroup memory), and the
// device's SIMD-groups are SIMD_WIDTH threads wide, as the kernels' lane arithmetic assumes.
void check_launch(const plan::Launch& l, id<MTLComputePipelineState> state) {
  const std::array<uint32_t, 3>& t = l.threads_per_threadgroup;
  const uint64_t threads = uint64_t(t[0]) * t[1] * t[2];
  const uint64_t max_threads = uint64_t([state maxTotalThreadsPerThreadgroup]);
  TORCH_CHECK(threads <= max_threads, "torch_qmm: Metal kernel '", l.kernel, "' needs ", threads,
              " threads per threadgroup (", t[0], "x", t[1], "x", t[2],
              "), but its pipeline allows at most ", max_threads, " (maxTotalThreadsPerThreadgroup)");
  const uint64_t width = uint64_t([state threadExecutionWidth]);
  TORCH_CHECK(width == uint64_t(SIMD_WIDTH), "torch_qmm: Metal kernel '", l.kernel, "' needs SIMD-groups of ",
              int(SIMD_WIDTH), " threads, but its pipeline's threadExecutionWidth is ", width);
}

}  // namespace

void set_weight_operands(Operands& ops, const at::Tensor& wq, const at::Tensor& scales,
                         const std::optional<at::Tensor>& biases) {
  ops[plan::Operand::kWq] = wq.contiguous();
  ops[plan::Operand::kScales] = scales.contiguous();
  if (biases) ops[plan::Operand::kBiases] = biases->contiguous();
}

at::Tensor new_output(const std::vector<plan::Launch>& launches, int64_t rows, int64_t cols,
                      const at::TensorOptions& options) {
  return launches.empty() ? at::zeros({rows, cols}, options) : at::empty({rows, cols}, options);
}

std::vector<plan::Launch> make_plan_checked(const plan::Problem& p) {
  try {
    return plan::make_plan(p);
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Pipelines are resolved and checked against their launches before entering the queue so that
// nothing inside the block throws.
void encode(const std::vector<plan::Launch>& launches, const Operands& operands) {
  if (launches.empty()) return;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  id<MTLDevice> device = stream->device();
  std::vector<id<MTLComputePipelineState>> states;
  for (const plan::Launch& l : launches) {
    states.push_back(pipeline(device, l.kernel));
    check_launch(l, states.back());
  }
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
