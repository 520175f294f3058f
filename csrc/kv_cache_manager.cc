#include "kv_cache_manager.h"

#include <string>

#include "errors.h"

namespace pagedserve {

KVCacheManager::KVCacheManager(int32_t num_blocks, int32_t block_size)
    : block_size_(block_size), pool_(num_blocks) {
  if (block_size <= 0) {
    throw BlockPoolError("block_size must be > 0, got " + std::to_string(block_size));
  }
}

double KVCacheManager::usage() const {
  return 1.0 - static_cast<double>(num_free_blocks()) / num_blocks();
}

bool KVCacheManager::can_allocate(int32_t num_tokens) const {
  return BlockTable::num_blocks_for(num_tokens, block_size_) <= num_free_blocks();
}

void KVCacheManager::allocate(int64_t seq_id, int32_t num_tokens) {
  if (has_sequence(seq_id)) {
    throw RequestRejectedError("sequence " + std::to_string(seq_id) + " already has blocks");
  }
  if (num_tokens < 0) throw OutOfBlocksError("negative num_tokens");
  if (!can_allocate(num_tokens)) {
    throw OutOfBlocksError("cannot allocate " + std::to_string(num_tokens) + " tokens: only " +
                           std::to_string(num_free_blocks()) + " free blocks");
  }
  Entry e{BlockTable(block_size_), num_tokens};
  for (int32_t i = 0; i < BlockTable::num_blocks_for(num_tokens, block_size_); ++i) {
    e.table.append_block(pool_.allocate());
  }
  tables_.emplace(seq_id, std::move(e));
}

const KVCacheManager::Entry& KVCacheManager::entry(int64_t seq_id) const {
  auto it = tables_.find(seq_id);
  if (it == tables_.end()) {
    throw UnknownRequestError("sequence " + std::to_string(seq_id) + " has no block table");
  }
  return it->second;
}

int32_t KVCacheManager::blocks_needed(const Entry& e, int32_t num_new_tokens) const {
  int32_t want = BlockTable::num_blocks_for(e.num_tokens + num_new_tokens, block_size_);
  return want > e.table.num_blocks() ? want - e.table.num_blocks() : 0;
}

bool KVCacheManager::can_append(int64_t seq_id, int32_t num_new_tokens) const {
  return blocks_needed(entry(seq_id), num_new_tokens) <= num_free_blocks();
}

void KVCacheManager::append(int64_t seq_id, int32_t num_new_tokens) {
  if (!can_append(seq_id, num_new_tokens)) {
    throw OutOfBlocksError("cannot append " + std::to_string(num_new_tokens) +
                           " tokens to sequence " + std::to_string(seq_id));
  }
  Entry& e = tables_.at(seq_id);
  for (int32_t n = blocks_needed(e, num_new_tokens); n > 0; --n) {
    e.table.append_block(pool_.allocate());
  }
  e.num_tokens += num_new_tokens;
}

bool KVCacheManager::free(int64_t seq_id) {
  auto it = tables_.find(seq_id);
  if (it == tables_.end()) return false;
  // Free in reverse so the tail blocks (least likely shared) return first.
  const auto& ids = it->second.table.block_ids();
  for (auto b = ids.rbegin(); b != ids.rend(); ++b) pool_.free(*b);
  tables_.erase(it);
  return true;
}

const BlockTable& KVCacheManager::block_table(int64_t seq_id) const { return entry(seq_id).table; }

int32_t KVCacheManager::num_tokens(int64_t seq_id) const { return entry(seq_id).num_tokens; }

}  // namespace pagedserve
