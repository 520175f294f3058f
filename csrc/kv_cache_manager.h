// KVCacheManager: the allocator API the scheduler uses. It owns the BlockPool
// and one BlockTable per sequence, and offers two-phase calls so nothing fails
// half-way (nano-vllm's BlockManager, vLLM's KVCacheManager):
//   can_allocate(num_tokens)          -> allocate(seq_id, num_tokens)
//   can_append(seq_id, num_new_tokens) -> append(seq_id, num_new_tokens)
// A sequence's table always covers at least its reserved token slots
// (num_tokens(seq_id)); blocks are handed out lazily, one block_size at a time.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "block_pool.h"
#include "block_table.h"

namespace pagedserve {

class KVCacheManager {
 public:
  // num_blocks > 0; block_size in {16, 32} for the model path (any value > 0 is
  // accepted here so the allocator can be studied on its own).
  KVCacheManager(int32_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return pool_.num_blocks(); }
  int32_t num_free_blocks() const { return pool_.num_free_blocks(); }
  // Fraction of blocks in use, in [0, 1].
  double usage() const;

  // True if a new sequence of num_tokens tokens can get its blocks now.
  bool can_allocate(int32_t num_tokens) const;
  // Creates seq_id's block table covering num_tokens slots.
  // Throws RequestRejectedError if seq_id already has a table, OutOfBlocksError
  // if can_allocate(num_tokens) is false.
  void allocate(int64_t seq_id, int32_t num_tokens);

  // True if seq_id can reserve num_new_tokens more slots now.
  // Throws UnknownRequestError for an unknown seq_id.
  bool can_append(int64_t seq_id, int32_t num_new_tokens) const;
  // Reserves num_new_tokens more slots, taking new blocks as needed.
  // Throws UnknownRequestError / OutOfBlocksError.
  void append(int64_t seq_id, int32_t num_new_tokens);

  // Gives back every block of seq_id (refcount -1 each). Unknown ids are a no-op
  // and return false, so abort paths can call it unconditionally.
  bool free(int64_t seq_id);

  bool has_sequence(int64_t seq_id) const { return tables_.count(seq_id) != 0; }
  // Throws UnknownRequestError for an unknown seq_id.
  const BlockTable& block_table(int64_t seq_id) const;
  int32_t num_tokens(int64_t seq_id) const;
  const BlockPool& block_pool() const { return pool_; }

 private:
  struct Entry {
    BlockTable table;
    int32_t num_tokens;
  };
  int32_t blocks_needed(const Entry& e, int32_t num_new_tokens) const;
  const Entry& entry(int64_t seq_id) const;

  int32_t block_size_;
  BlockPool pool_;
  std::unordered_map<int64_t, Entry> tables_;
};

}  // namespace pagedserve
