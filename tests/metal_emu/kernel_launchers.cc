// Compiles the real kernel sources (metal/*.metal) as C++ and launches them
// through the emulator. Standard headers first: the stand-in <metal_stdlib>
// defines address-space keywords (device, constant, thread, ...) as macros.
#include "kernel_launchers.h"

#include <vector>

#include "emu_runtime.h"

#include "reshape_and_cache.metal"
#include "paged_attention_decode.metal"
#include "paged_attention_merge.metal"
#include "paged_attention_prefill.metal"

// The broken variant: the same decode kernel with every threadgroup barrier
// removed (queries, SIMD-group states and accumulators are then read before
// the other SIMD groups wrote them).
namespace broken {
#define threadgroup_barrier(flags) ((void)0)
#include "paged_attention_decode.metal"
#undef threadgroup_barrier
}  // namespace broken

namespace metal_emu_kernels {
namespace {

namespace pm = pagedserve_metal;
using pagedserve::metal::MetalLaunch;

Counters g_counters;

metal_emu::DispatchOptions emu_options(const LaunchOptions& o, uint64_t salt) {
  metal_emu::DispatchOptions d;
  d.order = o.order == Order::kForward   ? metal_emu::LaneOrder::kForward
            : o.order == Order::kReverse ? metal_emu::LaneOrder::kReverse
                                         : metal_emu::LaneOrder::kShuffled;
  d.seed = o.seed * 1000003u + salt;
  return d;
}

void run(const MetalLaunch& l, const LaunchOptions& o, uint64_t salt,
         const std::function<void(const metal_emu::ThreadPosition&)>& body) {
  if (l.empty()) return;
  metal_emu::dispatch({l.threadgroups[0], l.threadgroups[1], l.threadgroups[2]}, {l.threads_per_threadgroup, 1, 1},
                      emu_options(o, salt), body);
  const metal_emu::DispatchStats s = metal_emu::last_dispatch_stats();
  g_counters.switches += s.switches;
  g_counters.threadgroup_barriers += s.threadgroup_barriers;
  g_counters.simd_collectives += s.simd_collectives;
}

template <typename T>
void reshape_typed(const pagedserve::metal::ReshapeAndCacheLaunch& launch, const void* key, const void* value,
                   void* k_cache, void* v_cache, const int64_t* slots, const LaunchOptions& o) {
  head_size_fc = launch.args.head_size;
  block_size_fc = launch.args.block_size;
  const pm::ReshapeAndCacheArgs args = launch.args;
  run(launch.launch, o, 1, [&](const metal_emu::ThreadPosition& p) {
    ::reshape_and_cache<T>(*(constant pm::ReshapeAndCacheArgs*)&args, (device const T*)key, (device const T*)value,
                         (device T*)k_cache, (device T*)v_cache, (device const long*)slots,
                         p.threadgroup_position_in_grid, p.thread_index_in_threadgroup);
  });
}

template <typename T>
void attention_typed(const pagedserve::metal::MetalAttentionPlan& plan, const AttentionBuffers& b,
                     const LaunchOptions& o) {
  head_size_fc = plan.decode_args.head_size;
  block_size_fc = plan.decode_args.block_size;
  std::vector<float> partial_out(plan.partial_out_floats), partial_lse(plan.partial_lse_floats);
  const pm::PagedAttentionArgs decode_args = plan.decode_args, prefill_args = plan.prefill_args;
  auto q = (device const T*)b.query;
  auto kc = (device const T*)b.k_cache;
  auto vc = (device const T*)b.v_cache;
  auto tables = (device const int*)b.block_tables;
  auto lens = (device const int*)b.seq_lens;
  auto qsl = (device const int*)b.query_start_loc;
  auto out = (device T*)b.out;
  auto decode_work = (device const int*)plan.decode_work.data();
  auto prefill_work = (device const int*)plan.prefill_work.data();
  auto pout = (device float*)partial_out.data();
  auto plse = (device float*)partial_lse.data();
  auto dargs = (constant pm::PagedAttentionArgs*)&decode_args;
  auto pargs = (constant pm::PagedAttentionArgs*)&prefill_args;
  run(plan.decode, o, 2, [&](const metal_emu::ThreadPosition& p) {
    if (o.broken_decode) {
      broken::paged_attention_decode<T>(*dargs, q, kc, vc, tables, lens, qsl, decode_work, out, pout, plse,
                                        p.threadgroup_position_in_grid, p.thread_index_in_threadgroup,
                                        p.simdgroup_index_in_threadgroup, p.thread_index_in_simdgroup);
    } else {
      ::paged_attention_decode<T>(*dargs, q, kc, vc, tables, lens, qsl, decode_work, out, pout, plse,
                                p.threadgroup_position_in_grid, p.thread_index_in_threadgroup,
                                p.simdgroup_index_in_threadgroup, p.thread_index_in_simdgroup);
    }
  });
  if (plan.split) {
    run(plan.merge, o, 3, [&](const metal_emu::ThreadPosition& p) {
      ::paged_attention_merge<T>(*dargs, (device const float*)pout, (device const float*)plse, lens, qsl, decode_work,
                               out, p.threadgroup_position_in_grid, p.thread_index_in_simdgroup);
    });
  }
  run(plan.prefill, o, 4, [&](const metal_emu::ThreadPosition& p) {
    ::paged_attention_prefill<T>(*pargs, q, kc, vc, tables, lens, qsl, prefill_work, out,
                               p.threadgroup_position_in_grid, p.simdgroup_index_in_threadgroup,
                               p.thread_index_in_simdgroup);
  });
}

}  // namespace

void reshape_and_cache(Dtype dtype, const pagedserve::metal::ReshapeAndCacheLaunch& launch, const void* key,
                       const void* value, void* k_cache, void* v_cache, const int64_t* slot_mapping,
                       const LaunchOptions& options) {
  g_counters = {};
  switch (dtype) {
    case Dtype::kFloat32: return reshape_typed<float>(launch, key, value, k_cache, v_cache, slot_mapping, options);
    case Dtype::kFloat16: return reshape_typed<half>(launch, key, value, k_cache, v_cache, slot_mapping, options);
    case Dtype::kBFloat16: return reshape_typed<bfloat>(launch, key, value, k_cache, v_cache, slot_mapping, options);
  }
}

void paged_attention(Dtype dtype, const pagedserve::metal::MetalAttentionPlan& plan, const AttentionBuffers& buffers,
                     const LaunchOptions& options) {
  g_counters = {};
  switch (dtype) {
    case Dtype::kFloat32: return attention_typed<float>(plan, buffers, options);
    case Dtype::kFloat16: return attention_typed<half>(plan, buffers, options);
    case Dtype::kBFloat16: return attention_typed<bfloat>(plan, buffers, options);
  }
}

Counters last_counters() { return g_counters; }

}  // namespace metal_emu_kernels
