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

typedef enum : NSInteger { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 } MTLMathMode;
typedef enum : NSUInteger { MTLLanguageVersion3_0 = (3 << 16) + 0, MTLLanguageVersion3_1 = (3 << 16) + 1 } MTLLanguageVersion;

@protocol MTLBuffer <NSObject>
@end
@protocol MTLSharedEvent <NSObject>
@end
@protocol MTLFunction <NSObject>
@end
@protocol MTLComputePipelineState <NSObject>
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
@property(readwrite, nonatomic) BOOL fastMathEnabled;  // deprecated in macOS 15: mathMode
@property(readwrite, nonatomic) MTLMathMode mathMode;  // macOS 15+
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
