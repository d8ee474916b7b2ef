// Syntax-check stub: the Metal APIs used by csrc/mps/quant_mps.mm (and the other csrc/mps/*.mm) and ATen/mps/MPSStream.h,
// declared as Apple documents them (developer.apple.com/documentation/metal). Not an SDK.
#pragma once
#import <Foundation/Foundation.h>

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize s = {width, height, depth};
  return s;
}

// The SDK this stub stands for: the macOS 15 SDK by default, the macOS 14 SDK (Xcode 15) with
// -DTQMM_STUB_MACOS_SDK_14, which lacks MTLMathMode, MTLMathFloatingPointFunctions and
// MTLCompileOptions' properties of those types, and does not define __MAC_15_0 (Availability.h's
// mark of the macOS 15 SDK, which Foundation includes).
#ifndef TQMM_STUB_MACOS_SDK_14
#define __MAC_15_0 150000
#endif

#ifdef __MAC_15_0
typedef enum : NSInteger { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 } MTLMathMode;
typedef enum : NSInteger {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1
} MTLMathFloatingPointFunctions;
#endif
typedef enum : NSUInteger { MTLLanguageVersion3_0 = (3 << 16) + 0, MTLLanguageVersion3_1 = (3 << 16) + 1 } MTLLanguageVersion;

@protocol MTLBuffer <NSObject>
@end
@protocol MTLSharedEvent <NSObject>
@end
@protocol MTLFunction <NSObject>
@end
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@end
@protocol MTLCommandBuffer <NSObject>
@end
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);
@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@end
@protocol MTLCommandQueue <NSObject>
@end
@protocol MTLComputeCommandEncoder <NSObject>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

@interface MTLCompileOptions : NSObject
#ifdef __MAC_15_0
@property(readwrite, nonatomic) BOOL fastMathEnabled __attribute__((deprecated("Use mathMode instead")));
@property(readwrite, nonatomic) MTLMathMode mathMode;
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions;
#else
@property(readwrite, nonatomic) BOOL fastMathEnabled;
#endif
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

@protocol MTLDevice <NSObject>
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error;  // macOS 10.13+
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError**)error;
@end
