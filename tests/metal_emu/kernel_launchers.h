// The Metal kernels of metal/*.metal, compiled as C++ against the stand-in
// <metal_stdlib> and launched through the emulator exactly as the host
// dispatch launches them on a Mac (csrc/backends/metal/): same plan, same
// argument structs, same grids. Plain C++ API so the tests need none of the
// stand-in's address-space macros.
#pragma once

#include <cstdint>

#include "backends/metal/metal_plan.h"

namespace metal_emu_kernels {

enum class Dtype { kFloat32, kFloat16, kBFloat16 };
enum class Order { kForward, kReverse, kShuffled };

struct LaunchOptions {
  Order order = Order::kForward;
  uint64_t seed = 0;
  // Run the decode kernel compiled with its threadgroup barriers removed (the
  // deliberately broken variant the tests keep to prove the emulator catches it).
  bool broken_decode = false;
};

// Buffers of one paged_attention call (dtype of query/out/caches as given).
struct AttentionBuffers {
  const void* query = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  const int32_t* block_tables = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* query_start_loc = nullptr;
  void* out = nullptr;
};

// reshape_and_cache over the emulator (function constants head_size, block_size).
void reshape_and_cache(Dtype dtype, const pagedserve::metal::ReshapeAndCacheLaunch& launch, const void* key,
                       const void* value, void* k_cache, void* v_cache, const int64_t* slot_mapping,
                       const LaunchOptions& options);

// Runs the plan's launches in the host's order: decode (+ merge when split),
// then prefill. Allocates the partial buffers the plan asks for.
void paged_attention(Dtype dtype, const pagedserve::metal::MetalAttentionPlan& plan, const AttentionBuffers& buffers,
                     const LaunchOptions& options);

// Fiber switches, threadgroup barriers and SIMD collectives of the last launch
// sequence (summed over its dispatches).
struct Counters {
  uint64_t switches = 0, threadgroup_barriers = 0, simd_collectives = 0;
};
Counters last_counters();

}  // namespace metal_emu_kernels
