// Syntax-check stub: only the class ATen/mps/MPSStream.h names. Not an SDK.
#pragma once
#import <Metal/Metal.h>
@interface MPSCommandBuffer : NSObject
@end
