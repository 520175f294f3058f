// BlockPool: the physical KV blocks of the paged cache, as ids 0..num_blocks-1,
// with a reference count each (vLLM's BlockPool; nano-vllm's BlockManager).
//
// A block whose refcount drops to 0 goes to the free list, unless it holds a
// prefix-cache entry (mark_cached): then it stays evictable, in LRU order, and
// acquire() can revive it. allocate() takes a truly free block first, then
// evicts the least recently freed cached block (calling the evict callback so
// the PrefixCache forgets it). Free + evictable blocks are all available.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <vector>

namespace pagedserve {

class BlockPool {
 public:
  // num_blocks: number of physical KV blocks (> 0). Throws BlockPoolError if 0.
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return num_blocks_; }
  // Blocks allocate() can hand out: truly free + evictable cached ones.
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_list_.size() + lru_.size()); }
  int32_t num_evictable_blocks() const { return static_cast<int32_t>(lru_.size()); }
  int64_t num_evictions() const { return num_evictions_; }

  // Takes a free block (evicting the LRU cached one if none is truly free), sets
  // its refcount to 1 and returns its id. Throws OutOfBlocksError when none is left.
  int32_t allocate();

  // Adds a reference to a block in use (sharing). Throws BlockPoolError if the
  // id is out of range or the block is free (use after free).
  void incref(int32_t block_id);

  // Takes a reference to a cached block, reviving it from the evictable list if
  // its refcount is 0. Throws BlockPoolError if it is neither in use nor cached.
  void acquire(int32_t block_id);

  // Drops one reference; at zero the block goes back to the free list (or the
  // evictable LRU if cached). Throws BlockPoolError on an out-of-range id or a
  // block already free (double free).
  void free(int32_t block_id);

  // Marks a block in use as holding a prefix-cache entry. Throws BlockPoolError
  // if the block is not in use.
  void mark_cached(int32_t block_id);
  // True if the block is cached with refcount 0 (waiting in the LRU). Throws
  // BlockPoolError if out of range.
  bool is_evictable(int32_t block_id) const;

  // Called with a block id when allocate() evicts it.
  void set_evict_callback(std::function<void(int32_t)> fn) { on_evict_ = std::move(fn); }

  // Current reference count (0 = free or evictable). Throws BlockPoolError if out of range.
  int32_t refcount(int32_t block_id) const;

 private:
  void check_range(int32_t block_id) const;

  int32_t num_blocks_;
  std::vector<int32_t> refcounts_;
  std::vector<bool> cached_, in_lru_;
  std::deque<int32_t> free_list_;
  std::list<int32_t> lru_;  // front = least recently freed
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  std::function<void(int32_t)> on_evict_;
  int64_t num_evictions_ = 0;
};

}  // namespace pagedserve
