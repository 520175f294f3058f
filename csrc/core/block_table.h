// BlockTable: one sequence's logical -> physical block mapping and the slot
// math of the paged KV cache (vLLM's BlockTable). Slot of token position p:
//   block_ids[p / block_size] * block_size + p % block_size.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedserve {

class BlockTable {
 public:
  explicit BlockTable(int32_t block_size) : block_size_(block_size) {}

  int32_t block_size() const { return block_size_; }
  const std::vector<int32_t>& block_ids() const { return block_ids_; }
  int32_t num_blocks() const { return static_cast<int32_t>(block_ids_.size()); }
  // Token slots this table covers: num_blocks() * block_size.
  int32_t capacity() const { return num_blocks() * block_size_; }

  void append_block(int32_t block_id) { block_ids_.push_back(block_id); }
  // Replaces logical block i (copy-on-write). Throws InvalidArgumentError if
  // i is not in [0, num_blocks()).
  void set_block(int32_t i, int32_t block_id);
  void clear() { block_ids_.clear(); }
  // Removes and returns the last block's id. Throws InvalidArgumentError when empty.
  int32_t pop_block();

  // Physical slot of token position `position` (0-based).
  // Throws InvalidArgumentError if position is negative or >= capacity().
  int64_t slot(int32_t position) const;

  // Blocks needed to hold num_tokens tokens: ceil(num_tokens / block_size).
  static int32_t num_blocks_for(int32_t num_tokens, int32_t block_size) {
    return (num_tokens + block_size - 1) / block_size;
  }

 private:
  int32_t block_size_;
  std::vector<int32_t> block_ids_;
};

}  // namespace pagedserve
