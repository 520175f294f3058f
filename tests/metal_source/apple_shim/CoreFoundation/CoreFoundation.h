// Declarations-only stand-in for a Linux syntax check (see ../README.md).
#pragma once
#include <stdint.h>
typedef double CFTimeInterval;
typedef const void* CFTypeRef;
typedef const struct __CFString* CFStringRef;
typedef const struct __CFAllocator* CFAllocatorRef;
typedef const struct __CFArray* CFArrayRef;
typedef long CFIndex;
typedef struct {
  CFIndex version;
  const void* retain;
  const void* release;
  const void* copyDescription;
  const void* equal;
} CFArrayCallBacks;
typedef struct objc_dispatch_queue* dispatch_queue_t;
typedef struct objc_dispatch_data* dispatch_data_t;
extern "C" {
extern const CFAllocatorRef kCFAllocatorDefault;
extern const CFArrayCallBacks kCFTypeArrayCallBacks;
CFStringRef __CFStringMakeConstantString(const char* s);
CFArrayRef CFArrayCreate(CFAllocatorRef allocator, const void** values, CFIndex count, const CFArrayCallBacks* cb);
}
