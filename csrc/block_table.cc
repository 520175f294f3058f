#include "block_table.h"

#include <stdexcept>
#include <string>

namespace pagedserve {

int64_t BlockTable::slot(int32_t position) const {
  if (position < 0 || position >= capacity()) {
    throw std::out_of_range("token position " + std::to_string(position) +
                            " outside block table capacity " + std::to_string(capacity()));
  }
  return static_cast<int64_t>(block_ids_[position / block_size_]) * block_size_ +
         position % block_size_;
}

}  // namespace pagedserve
