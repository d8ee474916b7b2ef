// Syntax-check stub (tests/test_metal_mps_syntax.py): declarations of exactly the Foundation
// APIs that csrc/mps/*.mm and the ATen/mps headers it includes use, as Apple documents them.
// Not an SDK: nothing here is linked or run.
#pragma once
#include <stddef.h>
#include <stdint.h>

// objc/objc.h
#ifndef nil
#define nil nullptr
#endif

typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
typedef long NSInteger;
typedef unsigned long NSUInteger;

@protocol NSObject
- (instancetype)retain;
- (oneway void)release;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(readonly) const char* UTF8String;
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

@interface NSDictionary : NSObject
@end

// libdispatch (Foundation pulls it in on macOS).
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
