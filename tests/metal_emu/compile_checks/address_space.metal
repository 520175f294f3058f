// Compile check (tests/metal_emu/CMakeLists.txt): the stand-in's address
// spaces are real. Without a MISUSE_* macro this compiles; with any one of
// them it must not (clang: no conversion between address spaces). Not caught:
// a write through a constant pointer (the stand-in's constant is not const, so
// that function constants stay assignable by the tests).
#include <metal_stdlib>
using namespace metal;

template <typename TgMem>
inline float first(TgMem p) {
  return p[0];
}

kernel void check(device float* out [[buffer(0)]], constant float* in [[buffer(1)]],
                  uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tg[32];
  tg[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  device float* d = out;     // same address space: fine
  thread float local = 1.0f;
  thread float* t = &local;  // thread = generic: fine
  d[tid] = first(tg) + *t;
#if defined(MISUSE_device_to_generic)
  float* g = out;  // device -> generic
  g[0] = 0.0f;
#elif defined(MISUSE_device_to_constant)
  constant float* c = out;  // device -> constant
  (void)c;
#elif defined(MISUSE_constant_to_device)
  device float* w = in;  // constant -> device
  (void)w;
#elif defined(MISUSE_threadgroup_to_device)
  device float* x = tg;  // threadgroup array -> device pointer
  (void)x;
#endif
}
