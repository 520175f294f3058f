// A kernel in plain Metal Shading Language syntax, for the emulator's
// self-test (test_emulator.cc, EmuSelftestKernel.*): builtin-attributed
// arguments, a threadgroup array, a function constant, SIMD-group reductions,
// a threadgroup barrier and explicit instantiations (named with host_name on
// a GPU, through the same kind of macro metal/kernel_utils.h defines: clang
// rejects an attribute list right after `template`). Compiled as C++ (-x c++).
#include <metal_stdlib>
using namespace metal;

// Multiplies every input (specialised per pipeline on a GPU; set by the test here).
constant int selftest_scale [[function_constant(0)]];

struct SelftestArgs {
  int n;       // valid inputs per threadgroup
  float bias;  // added to each threadgroup's sum
};

// out[tgid.x] = bias + scale * sum(in[tgid.x * threads + i] for i < n).
template <typename T>
kernel void selftest_reduce(constant SelftestArgs& args [[buffer(0)]],
                            device const T* in [[buffer(1)]],
                            device float* out [[buffer(2)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint3 threads [[threads_per_threadgroup]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float partial[32];
  const uint n = threads.x;
  const float x = tid < uint(args.n) ? float(in[tgid.x * n + tid]) * float(selftest_scale) : 0.0f;
  const float s = simd_sum(x);
  if (lane == 0) partial[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    const uint groups = (n + 31) / 32;
    float t = lane < groups ? partial[lane] : 0.0f;
    t = simd_sum(t);
    if (lane == 0) out[tgid.x] = t + args.bias;
  }
}

#ifdef __METAL_VERSION__
#define SELFTEST_INSTANTIATE(name, T) template [[host_name(name)]] [[kernel]] decltype(selftest_reduce<T>) selftest_reduce<T>;
#else
#define SELFTEST_INSTANTIATE(name, T) template decltype(selftest_reduce<T>) selftest_reduce<T>;
#endif
SELFTEST_INSTANTIATE("selftest_reduce_float", float)
SELFTEST_INSTANTIATE("selftest_reduce_half", half)

// Non-template kernel: out[tid] = max of its SIMD group's inputs, via
// simd_max and simd_shuffle_xor (which must agree).
kernel void selftest_simd_max(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              uint tid [[thread_index_in_threadgroup]]) {
  const float v = in[tid];
  float m = v;
  for (ushort mask = 16; mask > 0; mask >>= 1) m = max(m, simd_shuffle_xor(m, mask));
  out[tid] = m == simd_max(v) ? m : -1.0f;
}
