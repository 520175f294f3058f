// CPU emulator for Metal compute kernels (Linux CI): runs a kernel, compiled
// as C++ against the stand-in <metal_stdlib> (include/metal_stdlib, where the
// rules for kernel sources are), over a grid of threadgroups. The lanes (GPU
// threads) of a threadgroup are fibers on the calling OS thread, so a
// threadgroup_barrier, a simdgroup_barrier or a simd_* collective really
// suspends a lane until its peers arrive; threadgroups run one after another.
//
// Including this header does not define the address-space keyword macros
// (device, constant, ...); the .metal files' own #include <metal_stdlib> does.
// to_device / to_constant below convert host pointers without them.
#pragma once

#ifndef METAL_EMU_NO_KEYWORDS
#define METAL_EMU_NO_KEYWORDS
#define METAL_EMU_RUNTIME_H_SET_NO_KEYWORDS_
#endif
#include <metal_stdlib>
#ifdef METAL_EMU_RUNTIME_H_SET_NO_KEYWORDS_
#undef METAL_EMU_NO_KEYWORDS
#undef METAL_EMU_RUNTIME_H_SET_NO_KEYWORDS_
#endif

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>

namespace metal_emu {

// The order the runnable lanes of a threadgroup run in between two
// synchronisation points. A kernel that misses a barrier typically computes a
// wrong result under at least one of them.
enum class LaneOrder { kForward, kReverse, kShuffled };

struct Grid {
  uint32_t x = 1, y = 1, z = 1;
};

// What a kernel's builtin attributes would receive.
struct ThreadPosition {
  metal::uint3 threadgroup_position_in_grid;    // [[threadgroup_position_in_grid]]
  metal::uint3 threadgroups_per_grid;           // [[threadgroups_per_grid]]
  metal::uint3 thread_position_in_threadgroup;  // [[thread_position_in_threadgroup]]
  metal::uint3 threads_per_threadgroup;         // [[threads_per_threadgroup]]
  uint32_t thread_index_in_threadgroup;         // x + y * X + z * X * Y
  uint32_t simdgroup_index_in_threadgroup;      // thread_index_in_threadgroup / 32
  uint32_t thread_index_in_simdgroup;           // thread_index_in_threadgroup % 32
  uint32_t threads_per_simdgroup;               // 32
  // Additions beyond the original contract:
  metal::uint3 thread_position_in_grid;   // threadgroup_position * threads_per_threadgroup + thread_position
  uint32_t simdgroups_per_threadgroup;    // ceil(threads / 32)
};

struct DispatchOptions {
  LaneOrder order = LaneOrder::kForward;
  uint64_t seed = 0;               // kShuffled: seeds the permutations
  size_t stack_bytes = 256 * 1024;  // per lane (rounded up to pages; below a guard page)
};

struct EmulatorError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs body(position) for every lane of every threadgroup: threadgroups one
// after another in grid order (x fastest), the lanes of a threadgroup as
// fibers. Between synchronisation points the runnable lanes run one after
// another in options.order (kShuffled: a fresh seeded permutation each round).
// Throws EmulatorError (naming the threadgroup, the lanes and what they waited
// at) when a threadgroup_barrier is reached by only part of the threadgroup
// (the others finished), when the lanes of a SIMD group meet different
// collectives, when a lane finishes while its SIMD peers wait in a collective,
// and on any other deadlock. An exception thrown by body is re-thrown once the
// threadgroup is abandoned (its suspended lanes are unwound, so their
// destructors run, and their stacks reused). threads_per_threadgroup: 1 to
// 1024 lanes in all. Not re-entrant: one dispatch at a time per process
// (threadgroup memory is static storage).
void dispatch(Grid threadgroups, Grid threads_per_threadgroup, const DispatchOptions& options,
              const std::function<void(const ThreadPosition&)>& body);

// Statistics of the last dispatch (also when it threw): fiber switches,
// completed threadgroup barriers (one per threadgroup per barrier) and
// completed SIMD collectives including simdgroup_barrier (one per SIMD group
// per collective).
struct DispatchStats {
  uint64_t switches = 0, threadgroup_barriers = 0, simd_collectives = 0;
};
DispatchStats last_dispatch_stats();

// The context switch in use: "x86-64 assembly" or "ucontext".
const char* context_switch_kind();

// Host pointers as kernel arguments, without the keyword macros:
// kernel(to_device(out), to_constant(args), ...).
template <class T>
using device_ptr = T __attribute__((address_space(1)))*;
template <class T>
using constant_ptr = T __attribute__((address_space(2)))*;

template <class T>
inline device_ptr<T> to_device(T* p) {
  return (device_ptr<T>)p;
}
// MSL's constant address space is read-only; kernels spell it `constant T&`
// without const, hence the non-const reference.
template <class T>
inline T __attribute__((address_space(2)))& to_constant(const T& x) {
  return *(constant_ptr<T>)const_cast<T*>(&x);
}

}  // namespace metal_emu
