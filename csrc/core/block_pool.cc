#include "block_pool.h"

#include <string>

#include "errors.h"

namespace pagedserve {

BlockPool::BlockPool(int32_t num_blocks) : num_blocks_(num_blocks) {
  if (num_blocks <= 0) {
    throw BlockPoolError("BlockPool needs num_blocks > 0, got " + std::to_string(num_blocks));
  }
  refcounts_.assign(num_blocks, 0);
  cached_.assign(num_blocks, false);
  in_lru_.assign(num_blocks, false);
  lru_pos_.resize(num_blocks);
  for (int32_t i = 0; i < num_blocks; ++i) free_list_.push_back(i);
}

void BlockPool::check_range(int32_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks_) {
    throw BlockPoolError("block id " + std::to_string(block_id) + " out of range [0, " +
                         std::to_string(num_blocks_) + ")");
  }
}

int32_t BlockPool::allocate() {
  int32_t id;
  if (!free_list_.empty()) {
    id = free_list_.front();
    free_list_.pop_front();
  } else if (!lru_.empty()) {
    id = lru_.front();
    lru_.pop_front();
    in_lru_[id] = false;
    cached_[id] = false;
    ++num_evictions_;
    if (on_evict_) on_evict_(id);
  } else {
    throw OutOfBlocksError("no free KV block left (pool of " + std::to_string(num_blocks_) +
                           " blocks); call can_allocate first");
  }
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

void BlockPool::acquire(int32_t block_id) {
  check_range(block_id);
  if (refcounts_[block_id] == 0) {
    if (!in_lru_[block_id]) {
      throw BlockPoolError("acquire of block " + std::to_string(block_id) + ", which is neither in use nor cached");
    }
    lru_.erase(lru_pos_[block_id]);
    in_lru_[block_id] = false;
  }
  ++refcounts_[block_id];
}

void BlockPool::free(int32_t block_id) {
  check_range(block_id);
  if (refcounts_[block_id] == 0) {
    throw BlockPoolError("double free of block " + std::to_string(block_id));
  }
  if (--refcounts_[block_id] > 0) return;
  if (cached_[block_id]) {
    lru_pos_[block_id] = lru_.insert(lru_.end(), block_id);
    in_lru_[block_id] = true;
  } else {
    free_list_.push_back(block_id);
  }
}

void BlockPool::mark_cached(int32_t block_id) {
  check_range(block_id);
  if (refcounts_[block_id] == 0) {
    throw BlockPoolError("mark_cached of free block " + std::to_string(block_id));
  }
  cached_[block_id] = true;
}

bool BlockPool::is_evictable(int32_t block_id) const {
  check_range(block_id);
  return in_lru_[block_id];
}

int32_t BlockPool::refcount(int32_t block_id) const {
  check_range(block_id);
  return refcounts_[block_id];
}

}  // namespace pagedserve
