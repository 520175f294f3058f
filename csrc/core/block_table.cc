#include "block_table.h"

#include <string>

#include "errors.h"

namespace pagedserve {

int64_t BlockTable::slot(int32_t position) const {
  if (position < 0 || position >= capacity()) {
    throw InvalidArgumentError("token position " + std::to_string(position) +
                            " outside block table capacity " + std::to_string(capacity()));
  }
  return static_cast<int64_t>(block_ids_[position / block_size_]) * block_size_ +
         position % block_size_;
}

int32_t BlockTable::pop_block() {
  if (block_ids_.empty()) throw InvalidArgumentError("pop_block on an empty block table");
  const int32_t id = block_ids_.back();
  block_ids_.pop_back();
  return id;
}

void BlockTable::set_block(int32_t i, int32_t block_id) {
  if (i < 0 || i >= num_blocks()) {
    throw InvalidArgumentError("logical block " + std::to_string(i) + " outside block table of " +
                               std::to_string(num_blocks()) + " blocks");
  }
  block_ids_[i] = block_id;
}

}  // namespace pagedserve
