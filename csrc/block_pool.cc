#include "block_pool.h"

#include <string>

#include "errors.h"

namespace pagedserve {

BlockPool::BlockPool(int32_t num_blocks) : num_blocks_(num_blocks) {
  if (num_blocks <= 0) {
    throw BlockPoolError("BlockPool needs num_blocks > 0, got " + std::to_string(num_blocks));
  }
  refcounts_.assign(num_blocks, 0);
  for (int32_t i = 0; i < num_blocks; ++i) free_list_.push_back(i);
}

void BlockPool::check_range(int32_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks_) {
    throw BlockPoolError("block id " + std::to_string(block_id) + " out of range [0, " +
                         std::to_string(num_blocks_) + ")");
  }
}

int32_t BlockPool::allocate() {
  if (free_list_.empty()) {
    throw OutOfBlocksError("no free KV block left (pool of " + std::to_string(num_blocks_) +
                           " blocks); call can_allocate first");
  }
  int32_t id = free_list_.front();
  free_list_.pop_front();
  refcounts_[id] = 1;
  return id;
}

void BlockPool::incref(int32_t block_id) {
  check_range(block_id);
  if (refcounts_[block_id] == 0) {
    throw BlockPoolError("use of freed block " + std::to_string(block_id));
  }
  ++refcounts_[block_id];
}

void BlockPool::free(int32_t block_id) {
  check_range(block_id);
  if (refcounts_[block_id] == 0) {
    throw BlockPoolError("double free of block " + std::to_string(block_id));
  }
  if (--refcounts_[block_id] == 0) free_list_.push_back(block_id);
}

int32_t BlockPool::refcount(int32_t block_id) const {
  check_range(block_id);
  return refcounts_[block_id];
}

}  // namespace pagedserve
