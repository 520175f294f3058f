#include "attention_checks.h"

#include <string>

#include "core/errors.h"

namespace pagedserve {

AttentionGeometry check_attention_metadata(const TensorArg& query_start_loc, const TensorArg& seq_lens,
                                           const TensorArg& block_tables, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                           int64_t num_blocks) {
  const auto in_range = [](const char* what, int64_t v, int64_t hi) {
    if (v < 1 || v > hi) {
      throw KernelArgumentError(std::string(what) + " must be in [1, " + std::to_string(hi) + "], got " +
                                std::to_string(v));
    }
  };
  in_range("num_heads", num_heads, kMaxHeads);
  in_range("num_kv_heads", num_kv_heads, kMaxHeads);
  in_range("head_dim", head_dim, kMaxHeadDim);
  in_range("block_size", block_size, kMaxBlockSize);
  in_range("num_blocks", num_blocks, kMaxBlocks);
  if (num_heads % num_kv_heads != 0) {
    throw KernelArgumentError("num_heads " + std::to_string(num_heads) + " is not a multiple of num_kv_heads " +
                              std::to_string(num_kv_heads));
  }
  for (const TensorArg* t : {&query_start_loc, &seq_lens, &block_tables}) {
    t->check_dtype(DType::kInt32);
    t->check_contiguous();
  }
  query_start_loc.check_dim(1);
  seq_lens.check_dim(1);
  block_tables.check_dim(2);
  AttentionGeometry g;
  g.num_heads = num_heads;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.block_size = block_size;
  g.num_blocks = num_blocks;
  g.num_seqs = seq_lens.size(0);
  g.max_blocks = block_tables.size(1);
  query_start_loc.check_shape({g.num_seqs + 1});
  if (block_tables.size(0) != g.num_seqs) throw KernelArgumentError("block_tables must have one row per sequence");
  const int32_t* qsl = query_start_loc.ptr<int32_t>();
  const int32_t* lens = seq_lens.ptr<int32_t>();
  const int32_t* tables = block_tables.ptr<int32_t>();
  if (qsl[0] != 0) throw KernelArgumentError("query_start_loc must start at 0");
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    const int64_t q_len = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
    if (q_len < 0 || q_len > lens[b]) {
      throw KernelArgumentError("sequence " + std::to_string(b) + ": query length " + std::to_string(q_len) +
                                " must be in [0, seq_len = " + std::to_string(lens[b]) + "]");
    }
    const int64_t nb = (static_cast<int64_t>(lens[b]) + block_size - 1) / block_size;
    if (nb > g.max_blocks) {
      throw KernelArgumentError("sequence " + std::to_string(b) + " needs " + std::to_string(nb) +
                                " blocks but block_tables has " + std::to_string(g.max_blocks) + " columns");
    }
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t id = tables[b * g.max_blocks + j];
      if (id < 0 || id >= num_blocks) {
        throw KernelArgumentError("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                                  std::to_string(id) + " is outside [0, " + std::to_string(num_blocks) + ")");
      }
    }
  }
  g.num_tokens = qsl[g.num_seqs];
  return g;
}

void check_token_heads(const TensorArg& t, int64_t num_tokens, int64_t heads, int64_t head_dim, DType dtype) {
  t.check_dim(3);
  t.check_dtype(dtype);
  t.check_last_dim_contiguous();
  if ((num_tokens >= 0 && t.size(0) != num_tokens) || t.size(1) != heads || t.size(2) != head_dim) {
    throw KernelArgumentError(t.name + " must be [" + (num_tokens >= 0 ? std::to_string(num_tokens) : "T") + ", " +
                              std::to_string(heads) + ", " + std::to_string(head_dim) + "]");
  }
}

std::vector<int64_t> check_slot_mapping(const TensorArg& slot_mapping, int64_t num_tokens, int64_t num_slots) {
  slot_mapping.check_dim(1);
  slot_mapping.check_contiguous();
  slot_mapping.check_shape({num_tokens});
  if (slot_mapping.dtype != DType::kInt64 && slot_mapping.dtype != DType::kInt32) {
    throw KernelArgumentError("slot_mapping must be int64 (or int32), got " +
                              std::string(dtype_name(slot_mapping.dtype)));
  }
  std::vector<int64_t> slots(num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t) {
    slots[t] = slot_mapping.dtype == DType::kInt64 ? slot_mapping.ptr<int64_t>()[t] : slot_mapping.ptr<int32_t>()[t];
    if (slots[t] >= num_slots) {
      throw KernelArgumentError("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                                " is outside the cache's " + std::to_string(num_slots) + " slots");
    }
  }
  return slots;
}

}  // namespace pagedserve
