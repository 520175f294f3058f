// The CPU attention backend: docs/architecture.md's attention contract on raw
// CPU buffers.
//
// KV layout (this backend's own; the Python KV store asks the backend for it):
// per layer k_cache [num_blocks, Hkv, head_dim, block_size] (each block's keys
// transposed, so a query's scores against a block are head_dim vector FMAs
// across block_size lanes, no horizontal sums) and v_cache [num_blocks, Hkv,
// block_size, head_dim]; float32 or bfloat16.
//
// A step builds one AttentionPlan (metadata validated, work partitioned,
// scratch sized, ISA variant chosen) and every layer's paged_attention reuses
// it. Work items are (sequence, KV head group, chunk of up to kQueryChunk query
// tokens); when there are too few of them to keep the threads busy, each is
// split over its group's query heads (a query row's output is the same bits in
// any item: batch invariance), or, when the plan is built with split_kv, long
// decodes are split along the KV length and merged by log-sum-exp
// (flash-decoding, Dao et al. 2023; faster for a long decode with few query
// heads per KV head, but the merge sums in another order than one item). A worker runs runs of consecutive items,
// so the kernel knows the next item and prefetches its first KV blocks. Per
// worker the scratch is O(block_size * head_dim + rows * head_dim), independent
// of the sequence length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/common/attention_checks.h"
#include "backends/common/tensor_arg.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/attention/kernel_table.h"

namespace pagedserve {
namespace cpu {

class ThreadPool;

constexpr int kMaxThreads = 1024;  // worker threads an AttentionPlan accepts

// Writes key/value [T, Hkv, D] into k_cache/v_cache at slot_mapping [T] (int64;
// slot = block * block_size + offset; a negative slot skips the token; of two
// tokens naming one slot the later wins), on up to num_threads threads (the
// shared pool) when the call is large enough. Throws KernelArgumentError on a
// shape/dtype/layout mismatch, a slot out of range (checked before anything is
// written) or num_threads outside [1, kMaxThreads].
void reshape_and_cache(const TensorArg& key, const TensorArg& value, const TensorArg& k_cache,
                       const TensorArg& v_cache, const TensorArg& slot_mapping, int num_threads = 1);

// One step's attention work, built once and shared by every layer.
class AttentionPlan {
 public:
  // query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks] (int32;
  // -1 padding allowed past the blocks a sequence uses) are validated and
  // copied. Query token i of sequence b sits at position seq_lens[b] - q_len[b]
  // + i and sees key positions <= its own (all keys when causal is false);
  // with sliding_window > 0 only keys at positions > its own - sliding_window
  // (transformers' sliding-window mask), and the work items skip the blocks
  // wholly outside the window, so a long decode reads only in-window blocks.
  // split_kv: let long decodes in a step of few items be split along the KV length (see above).
  // num_threads in [1, kMaxThreads] worker threads (usually torch.get_num_threads()). The ISA
  // variant is the active one now (runtime/isa_registry.h). Throws KernelArgumentError.
  AttentionPlan(const TensorArg& query_start_loc, const TensorArg& seq_lens, const TensorArg& block_tables,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                bool causal, int num_threads, int64_t sliding_window = 0, bool split_kv = false);
  ~AttentionPlan();

  const AttentionGeometry& geometry() const { return g_; }
  // The registry variant the plan runs (runtime/isa_registry.h: e.g. avx512_vnni, whose attention table is avx512's).
  const char* isa() const { return isa_->name; }
  int64_t num_work_items() const { return static_cast<int64_t>(items_.size()); }
  int64_t num_split_groups() const { return static_cast<int64_t>(split_groups_.size()); }
  int64_t sliding_window() const { return sliding_window_; }
  // KV blocks the work items read, summed over items (each item reads its KV head's blocks; items split
  // over a group's query heads each read them).
  int64_t num_blocks_visited() const;
  // True when run() does its items on the calling thread (too little work to wake the pool).
  bool runs_inline() const { return run_inline_; }
  int num_threads() const;

  // out [T, H, D] = attention of query [T, H, D] over one layer's caches
  // (layout above, the plan's num_blocks / Hkv / D / block_size; query, out and
  // caches of one dtype, float32 or bfloat16). softcap > 0: every scaled score s
  // becomes softcap * tanh(s / softcap) (Gemma 2's attention logit soft-capping).
  // Checks the tensors against the plan in O(1), then runs the work items.
  // Calls on one plan are serialised.
  void run(const TensorArg& out, const TensorArg& query, const TensorArg& k_cache, const TensorArg& v_cache,
           float scale, float softcap = 0.f);

 private:
  struct SplitGroup {
    int32_t b, hk, splits;
    int64_t first_item;
  };
  AttentionGeometry g_;
  bool causal_;
  int64_t sliding_window_;
  const IsaVariant* isa_;
  std::vector<int32_t> query_start_loc_, seq_lens_, block_tables_;
  std::vector<WorkItem> items_;
  std::vector<SplitGroup> split_groups_;
  std::vector<int64_t> partial_slot_;  // per item: its slot in partial_* or -1
  std::shared_ptr<ThreadPool> pool_;
  // The step's work is too small to pay for waking the pool (a batch-1 decode
  // of a short context): items run on the calling thread.
  bool run_inline_ = false;
  std::mutex mu_;  // scratch below is reused by every layer
  std::vector<std::vector<float>> scratch_;
  std::vector<float> partial_acc_;
  std::vector<Partial> partial_ml_;
};

// Scratch bytes one worker uses (float32), whatever the sequence lengths.
size_t paged_attention_scratch_bytes(int num_heads, int num_kv_heads, int head_dim, int block_size);

}  // namespace cpu
}  // namespace pagedserve
