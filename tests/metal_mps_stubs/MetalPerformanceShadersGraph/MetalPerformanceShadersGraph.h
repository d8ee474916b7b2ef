// Syntax-check stub: only the classes ATen/mps/MPSStream.h names. Not an SDK.
#pragma once
#import <MetalPerformanceShaders/MetalPerformanceShaders.h>
@interface MPSGraph : NSObject
@end
@interface MPSGraphExecutionDescriptor : NSObject
@end
@interface MPSGraphCompilationDescriptor : NSObject
@end
