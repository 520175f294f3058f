#include <gtest/gtest.h>

#include <algorithm>

#include "core/block_pool.h"
#include "core/block_table.h"
#include "core/errors.h"

using namespace pagedserve;

TEST(BlockPool, AllocatesEveryBlockOnceThenRunsOut) {
  BlockPool pool(4);
  std::vector<int32_t> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(pool.allocate());
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_THROW(pool.allocate(), OutOfBlocksError);
}

TEST(BlockPool, RefcountsShareAndRelease) {
  BlockPool pool(2);
  int32_t b = pool.allocate();
  EXPECT_EQ(pool.refcount(b), 1);
  pool.incref(b);
  EXPECT_EQ(pool.refcount(b), 2);
  pool.free(b);
  EXPECT_EQ(pool.refcount(b), 1);
  EXPECT_EQ(pool.num_free_blocks(), 1);  // still held once
  pool.free(b);
  EXPECT_EQ(pool.refcount(b), 0);
  EXPECT_EQ(pool.num_free_blocks(), 2);
}

TEST(BlockPool, DoubleFreeAndUseAfterFreeRaise) {
  BlockPool pool(2);
  int32_t b = pool.allocate();
  pool.free(b);
  EXPECT_THROW(pool.free(b), BlockPoolError);
  EXPECT_THROW(pool.incref(b), BlockPoolError);
  EXPECT_EQ(pool.num_free_blocks(), 2);  // the failed calls changed nothing
}

TEST(BlockPool, OutOfRangeIdsRaise) {
  BlockPool pool(2);
  EXPECT_THROW(pool.free(2), BlockPoolError);
  EXPECT_THROW(pool.free(-1), BlockPoolError);
  EXPECT_THROW(pool.refcount(7), BlockPoolError);
  EXPECT_THROW(BlockPool(0), BlockPoolError);
}

TEST(BlockTable, SlotMath) {
  BlockTable t(16);
  t.append_block(5);
  t.append_block(2);
  EXPECT_EQ(t.slot(0), 80);
  EXPECT_EQ(t.slot(15), 95);
  EXPECT_EQ(t.slot(16), 32);
  EXPECT_EQ(t.slot(31), 47);
  EXPECT_THROW(t.slot(32), InvalidArgumentError);
  EXPECT_THROW(t.set_block(5, 1), InvalidArgumentError);
  EXPECT_EQ(BlockTable::num_blocks_for(0, 16), 0);
  EXPECT_EQ(BlockTable::num_blocks_for(16, 16), 1);
  EXPECT_EQ(BlockTable::num_blocks_for(17, 16), 2);
}
