// The Metal backend's planner (csrc/backends/metal/metal_plan.cc): plain C++
// built on every platform, so the grid sizes, head tiles, split-KV choice and
// argument packing a Mac runs are checked here by the host compiler too (its
// include of metal/pagedserve_args.h runs the struct-layout static_asserts in
// this build; the kernels' own build runs them again).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "backends/metal/metal_plan.h"
#include "core/errors.h"
#include "contiguous_arg.h"

namespace {

namespace pmetal = pagedserve::metal;
using pagedserve::DType;
using pagedserve::TensorArg;

using pagedserve::test_support::arg;

pmetal::MetalPlanOptions split(pmetal::SplitKv mode, int partition_size = 128) {
  pmetal::MetalPlanOptions o;
  o.split = mode;
  o.partition_size = partition_size;
  return o;
}

// ---- the plan ------------------------------------------------------------------------

struct Meta {
  std::vector<int32_t> qsl, lens, tables;
  int max_blocks = 0;
  Meta(const std::vector<int>& seq_lens, const std::vector<int>& q_lens, int bs) {
    qsl.push_back(0);
    for (size_t b = 0; b < seq_lens.size(); ++b) {
      qsl.push_back(qsl.back() + q_lens[b]);
      lens.push_back(seq_lens[b]);
      max_blocks = std::max(max_blocks, (seq_lens[b] + bs - 1) / bs);
    }
    for (size_t b = 0; b < seq_lens.size(); ++b) {
      for (int j = 0; j < max_blocks; ++j) tables.push_back(j < (seq_lens[b] + bs - 1) / bs ? j : -1);
    }
  }
  pmetal::MetalAttentionPlan plan(int H, int Hkv, int D, int bs, const pmetal::MetalPlanOptions& o = {}) const {
    const int64_t B = static_cast<int64_t>(lens.size());
    return pmetal::make_metal_plan(arg(qsl, {B + 1}, DType::kInt32, "query_start_loc"),
                                   arg(lens, {B}, DType::kInt32, "seq_lens"),
                                   arg(tables, {B, max_blocks}, DType::kInt32, "block_tables"), H, Hkv, D, bs,
                                   std::max(max_blocks, 1), true, 0.125f, o);
  }
};

TEST(MetalPlan, SplitsOnlyFewLongDecodes) {
  // one long decode: too few threadgroups, split into 4 partitions of 512
  const auto one = Meta({2000}, {1}, 16).plan(9, 3, 64, 16);
  EXPECT_TRUE(one.split);
  EXPECT_EQ(one.decode_args.max_partitions, 4);
  EXPECT_EQ(one.decode.threadgroups[2], 4u);
  EXPECT_EQ(one.merge.threadgroups[0], 1u);
  EXPECT_EQ(one.merge.threadgroups[1], 9u);
  EXPECT_EQ(one.partial_lse_floats, 9u * 4u);
  EXPECT_EQ(one.partial_out_floats, 9u * 4u * 64u);
  // short decodes: nothing to split
  EXPECT_FALSE(Meta({900}, {1}, 16).plan(9, 3, 64, 16).split);
  // many decodes fill the GPU: no split
  EXPECT_FALSE(Meta(std::vector<int>(32, 2000), std::vector<int>(32, 1), 16).plan(9, 3, 64, 16).split);
  // forced off / on
  EXPECT_FALSE(Meta({2000}, {1}, 16).plan(9, 3, 64, 16, split(pmetal::SplitKv::kOff)).split);
  EXPECT_TRUE(Meta({40}, {1}, 16).plan(9, 3, 64, 16, split(pmetal::SplitKv::kOn, 32)).split);
}

TEST(MetalPlan, GridsAndHeadTiles) {
  // 2 decodes, one prefill of 10 tokens (3 tiles of 4), an idle sequence (0 queries)
  const auto p = Meta({50, 7, 20, 30}, {1, 1, 10, 0}, 16).plan(24, 2, 64, 16);
  EXPECT_EQ(p.decode_work, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(p.prefill_work, (std::vector<int32_t>{2, 0, 2, 4, 2, 8}));
  // group 12: decode tiles of 8 (2 per KV head), prefill tiles of 4 (3 per KV head)
  EXPECT_EQ(p.decode_args.heads_per_threadgroup, 8);
  EXPECT_EQ(p.decode_args.head_tiles, 2);
  EXPECT_EQ(p.decode.threadgroups[1], 4u);
  EXPECT_EQ(p.prefill_args.heads_per_threadgroup, 4);
  EXPECT_EQ(p.prefill_args.head_tiles, 3);
  EXPECT_EQ(p.prefill.threadgroups[0], 3u);
  EXPECT_EQ(p.prefill.threadgroups[1], 6u);
  EXPECT_EQ(p.decode.threads_per_threadgroup, 128u);
  EXPECT_EQ(p.decode_args.query_token_stride, 24 * 64);
}

TEST(MetalPlan, RefusesWhatTheKernelsCannotRun) {
  const Meta m({40}, {1}, 16);
  EXPECT_THROW(m.plan(4, 4, 257, 16), pagedserve::KernelArgumentError);
  EXPECT_THROW(m.plan(4, 4, 64, 16, split(pmetal::SplitKv::kOn, 48)), pagedserve::KernelArgumentError);
  EXPECT_THROW(m.plan(6, 4, 64, 16), pagedserve::KernelArgumentError);  // 6 heads over 4 KV heads
  Meta bad({40}, {1}, 16);
  bad.tables[1] = 9;  // block id beyond the cache
  EXPECT_THROW(bad.plan(4, 4, 64, 16), pagedserve::KernelArgumentError);
  EXPECT_THROW(pmetal::make_reshape_and_cache_launch(4, 2, 300, 16, 8, 600, 300, 600, 300),
               pagedserve::KernelArgumentError);
}

}  // namespace
