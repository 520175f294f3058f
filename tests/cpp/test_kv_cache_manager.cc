#include <gtest/gtest.h>

#include <set>

#include "core/errors.h"
#include "core/kv_cache_manager.h"

using namespace pagedserve;

TEST(KVCacheManager, TwoPhaseAllocate) {
  KVCacheManager kv(4, 16);
  EXPECT_TRUE(kv.can_allocate(64));
  EXPECT_FALSE(kv.can_allocate(65));
  EXPECT_THROW(kv.allocate(0, 65), OutOfBlocksError);
  EXPECT_EQ(kv.num_free_blocks(), 4);  // a refused allocate takes nothing
  kv.allocate(0, 17);
  EXPECT_EQ(kv.block_table(0).num_blocks(), 2);
  EXPECT_EQ(kv.num_free_blocks(), 2);
  EXPECT_THROW(kv.allocate(0, 1), RequestRejectedError);
}

TEST(KVCacheManager, AppendTakesABlockOnlyAtBoundaries) {
  KVCacheManager kv(3, 16);
  kv.allocate(7, 16);
  EXPECT_EQ(kv.num_free_blocks(), 2);
  ASSERT_TRUE(kv.can_append(7, 1));
  kv.append(7, 1);  // token 17 needs block 2
  EXPECT_EQ(kv.num_free_blocks(), 1);
  for (int i = 0; i < 15; ++i) kv.append(7, 1);  // fills block 2, no new block
  EXPECT_EQ(kv.num_free_blocks(), 1);
  EXPECT_EQ(kv.num_tokens(7), 32);
  kv.append(7, 16);
  EXPECT_EQ(kv.num_free_blocks(), 0);
  EXPECT_FALSE(kv.can_append(7, 1));
  EXPECT_THROW(kv.append(7, 1), OutOfBlocksError);
  EXPECT_THROW(kv.can_append(8, 1), UnknownRequestError);
}

TEST(KVCacheManager, FreeReturnsEverythingAndIsIdempotent) {
  KVCacheManager kv(8, 16);
  kv.allocate(1, 40);
  kv.allocate(2, 1);
  EXPECT_EQ(kv.num_free_blocks(), 4);
  EXPECT_TRUE(kv.free(1));
  EXPECT_FALSE(kv.free(1));
  EXPECT_TRUE(kv.free(2));
  EXPECT_EQ(kv.num_free_blocks(), kv.num_blocks());
  EXPECT_DOUBLE_EQ(kv.usage(), 0.0);
}

TEST(KVCacheManager, DistinctSequencesGetDistinctBlocks) {
  KVCacheManager kv(6, 16);
  kv.allocate(1, 48);
  kv.allocate(2, 48);
  std::set<int32_t> all;
  for (int32_t b : kv.block_table(1).block_ids()) all.insert(b);
  for (int32_t b : kv.block_table(2).block_ids()) all.insert(b);
  EXPECT_EQ(all.size(), 6u);
}
