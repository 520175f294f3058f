#include "model_input.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace pagedserve {

ModelInput build_model_input(const SchedulerOutput& out) {
  const int32_t B = out.num_seqs();
  const int32_t bs = out.block_size;
  if (bs < 1 || static_cast<int32_t>(out.num_scheduled_tokens.size()) != B ||
      static_cast<int32_t>(out.num_computed_tokens.size()) != B ||
      static_cast<int32_t>(out.block_table_offsets.size()) != B + 1) {
    throw InvalidArgumentError("SchedulerOutput arrays do not describe the same sequences");
  }
  if (out.block_table_offsets[0] != 0 ||
      out.block_table_offsets[B] != static_cast<int64_t>(out.block_ids.size())) {
    throw InvalidArgumentError("block_table_offsets must run from 0 to the number of block ids");
  }
  int64_t total = 0;
  ModelInput in;
  for (int32_t b = 0; b < B; ++b) {
    if (out.block_table_offsets[b + 1] < out.block_table_offsets[b] || out.num_computed_tokens[b] < 0 ||
        out.num_scheduled_tokens[b] < 0) {
      throw InvalidArgumentError("sequence " + std::to_string(b) + " has negative counts or block offsets");
    }
    total += out.num_scheduled_tokens[b];
    in.max_num_blocks_per_seq =
        std::max(in.max_num_blocks_per_seq, out.block_table_offsets[b + 1] - out.block_table_offsets[b]);
  }
  for (int32_t id : out.block_ids) {
    if (id < 0) throw InvalidArgumentError("block id " + std::to_string(id) + " is negative");
  }
  if (total != static_cast<int64_t>(out.token_ids.size())) {
    throw InvalidArgumentError("token_ids has " + std::to_string(out.token_ids.size()) +
                               " tokens, num_scheduled_tokens sums to " + std::to_string(total));
  }
  const int32_t T = out.total_num_scheduled_tokens();
  in.input_ids.assign(out.token_ids.begin(), out.token_ids.end());
  in.positions.reserve(T);
  in.slot_mapping.reserve(T);
  in.query_start_loc.reserve(B + 1);
  in.seq_lens.reserve(B);
  in.block_tables.assign(static_cast<size_t>(B) * in.max_num_blocks_per_seq, -1);
  in.query_start_loc.push_back(0);
  for (int32_t b = 0; b < B; ++b) {
    const int64_t start = out.num_computed_tokens[b], n = out.num_scheduled_tokens[b];
    const int32_t* table = out.block_ids.data() + out.block_table_offsets[b];
    const int32_t num_blocks = out.block_table_offsets[b + 1] - out.block_table_offsets[b];
    if (static_cast<int64_t>(num_blocks) * bs < start + n) {
      throw InvalidArgumentError("sequence " + std::to_string(b) + " has " + std::to_string(num_blocks) +
                                 " blocks for " + std::to_string(start + n) + " tokens");
    }
    std::copy(table, table + num_blocks, in.block_tables.begin() + static_cast<ptrdiff_t>(b) * in.max_num_blocks_per_seq);
    for (int64_t p = start; p < start + n; ++p) {
      in.positions.push_back(p);
      in.slot_mapping.push_back(static_cast<int64_t>(table[p / bs]) * bs + p % bs);
    }
    in.query_start_loc.push_back(in.query_start_loc.back() + static_cast<int32_t>(n));
    in.seq_lens.push_back(static_cast<int32_t>(start + n));
  }
  in.logits_indices.reserve(out.sampling_seq_indices.size());
  for (int32_t b : out.sampling_seq_indices) {
    if (b < 0 || b >= B) throw InvalidArgumentError("sampling_seq_indices holds a row outside [0, B)");
    in.logits_indices.push_back(in.query_start_loc[b + 1] - 1);
  }
  in.blocks_to_copy = out.blocks_to_copy;
  return in;
}

}  // namespace pagedserve
