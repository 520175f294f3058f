// BlockPool: the physical KV blocks of the paged cache, as ids 0..num_blocks-1,
// with a reference count each and a FIFO free list (vLLM's BlockPool; nano-vllm's
// BlockManager). The pool knows nothing about tokens or sequences.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace pagedserve {

class BlockPool {
 public:
  // num_blocks: number of physical KV blocks (> 0). Throws BlockPoolError if 0.
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_list_.size()); }

  // Takes one free block, sets its refcount to 1 and returns its id.
  // Throws OutOfBlocksError when no block is free.
  int32_t allocate();

  // Adds a reference to a block in use (sharing). Throws BlockPoolError if the
  // id is out of range or the block is free (use after free).
  void incref(int32_t block_id);

  // Drops one reference; at zero the block goes back to the free list.
  // Throws BlockPoolError on an out-of-range id or a block already free
  // (double free).
  void free(int32_t block_id);

  // Current reference count (0 = free). Throws BlockPoolError if out of range.
  int32_t refcount(int32_t block_id) const;

 private:
  void check_range(int32_t block_id) const;

  int32_t num_blocks_;
  std::vector<int32_t> refcounts_;
  std::deque<int32_t> free_list_;
};

}  // namespace pagedserve
