#include "backends/cpu/attention/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "core/errors.h"
#include "backends/cpu/runtime/thread_pool.h"

namespace pagedserve {
namespace cpu {
namespace {

using bf16 = uint16_t;

// The caches of one layer: k [N, Hkv, D, bs], v [N, Hkv, bs, D], same dtype, contiguous.
void check_caches(const TensorArg& k_cache, const TensorArg& v_cache, int64_t num_blocks, int64_t num_kv_heads,
                  int64_t head_dim, int64_t block_size) {
  k_cache.check_contiguous();
  v_cache.check_contiguous();
  k_cache.check_shape({num_blocks, num_kv_heads, head_dim, block_size});
  v_cache.check_shape({num_blocks, num_kv_heads, block_size, head_dim});
  v_cache.check_dtype(k_cache.dtype);
  if (k_cache.dtype != DType::kFloat32 && k_cache.dtype != DType::kBFloat16) {
    throw KernelArgumentError("k_cache must be float32 or bfloat16, got " + std::string(dtype_name(k_cache.dtype)));
  }
}

// num_threads within [1, kMaxThreads] (reshape_and_cache, AttentionPlan), or KernelArgumentError.
void check_num_threads(int num_threads) {
  if (num_threads < 1 || num_threads > kMaxThreads) {
    throw KernelArgumentError("num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                              std::to_string(num_threads));
  }
}

// Elements of a head row one reshape_and_cache work item writes (for every token).
constexpr int64_t kCacheWriteChunk = 16;
// Below this many elements (T x Hkv x D, keys and values each) a call writes on
// the calling thread. A decode step's 32 tokens of 3 x 64 (SmolLM2) go to the
// pool, whose two threads overlap twice the cache misses of the transposed K
// stores (one line per element), and whose workers then stay awake for the
// attention call that follows (docs/benchmarks.md, "Behind the code").
constexpr int64_t kCacheWriteMinParallel = 4096;

// Writes elements [i0, i1) of head h of every token of src [T, Hkv, D] at its
// slot (negative: skipped), in token order: V rows as [bs, D], K transposed as
// [D, bs]. Work items own disjoint (head, element) ranges, so the result does
// not depend on the split, even when two tokens name the same slot.
template <typename T>
void write_head_range(const TensorArg& src, const std::vector<int64_t>& slots, T* cache, int64_t h, int64_t i0,
                      int64_t i1, int64_t hkv, int64_t d, int64_t bs, bool transposed) {
  for (size_t t = 0; t < slots.size(); ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / bs, off = slot % bs;
    const T* s = src.ptr<T>() + static_cast<int64_t>(t) * src.strides[0] + h * src.strides[1];
    T* base = cache + (block * hkv + h) * bs * d;
    if (transposed) {
      for (int64_t i = i0; i < i1; ++i) base[i * bs + off] = s[i];
    } else {
      std::memcpy(base + off * d + i0, s + i0, (i1 - i0) * sizeof(T));
    }
  }
}

}  // namespace

int64_t kernel_scratch_floats(int64_t group, int64_t head_dim, int64_t block_size) {
  // attention/kernels.cc's carve_scratch: queries, accumulators, maxima, sums and per-lane
  // sums of every row; one row's scores; a widened key and value tile
  const int64_t rows = group * kQueryChunk, lanes = std::max<int64_t>(block_size, kTileKeys);
  return rows * (head_dim * 2 + 2 + lanes) + block_size + lanes * head_dim * 2 + 16;  // + 16: 64-byte alignment
}

void reshape_and_cache(const TensorArg& key, const TensorArg& value, const TensorArg& k_cache,
                       const TensorArg& v_cache, const TensorArg& slot_mapping, int num_threads) {
  k_cache.check_dim(4);
  check_num_threads(num_threads);
  const int64_t num_blocks = k_cache.size(0), hkv = k_cache.size(1), d = k_cache.size(2), bs = k_cache.size(3);
  if (num_blocks > kMaxBlocks || hkv > kMaxHeads || d > kMaxHeadDim || bs > kMaxBlockSize) {
    throw KernelArgumentError("k_cache's shape is outside the supported bounds");
  }
  check_caches(k_cache, v_cache, num_blocks, hkv, d, bs);
  check_token_heads(key, -1, hkv, d, k_cache.dtype);
  const int64_t T = key.size(0);
  check_token_heads(value, T, hkv, d, k_cache.dtype);
  const std::vector<int64_t> slots = check_slot_mapping(slot_mapping, T, num_blocks * bs);
  // items: (K or V, head, chunk of kCacheWriteChunk elements)
  const int64_t chunks = (d + kCacheWriteChunk - 1) / kCacheWriteChunk, items = 2 * hkv * chunks;
  const auto write = [&](int64_t item, int) {
    const bool is_key = item < hkv * chunks;
    const int64_t rest = is_key ? item : item - hkv * chunks, h = rest / chunks, c = rest % chunks;
    const int64_t i0 = c * kCacheWriteChunk, i1 = std::min(d, i0 + kCacheWriteChunk);
    const TensorArg& src = is_key ? key : value;
    const TensorArg& cache = is_key ? k_cache : v_cache;
    if (k_cache.dtype == DType::kFloat32) {
      write_head_range<float>(src, slots, cache.ptr<float>(), h, i0, i1, hkv, d, bs, is_key);
    } else {
      write_head_range<bf16>(src, slots, cache.ptr<bf16>(), h, i0, i1, hkv, d, bs, is_key);
    }
  };
  if (num_threads == 1 || T * hkv * d < kCacheWriteMinParallel) {
    for (int64_t i = 0; i < items; ++i) write(i, 0);
  } else {
    ThreadPool::get(num_threads)->run(items, write);
  }
}

AttentionPlan::AttentionPlan(const TensorArg& query_start_loc, const TensorArg& seq_lens,
                             const TensorArg& block_tables, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t num_blocks, bool causal, int num_threads,
                             int64_t sliding_window, bool split_kv)
    : g_(check_attention_metadata(query_start_loc, seq_lens, block_tables, num_heads, num_kv_heads, head_dim,
                                  block_size, num_blocks)),
      causal_(causal),
      sliding_window_(sliding_window),
      isa_(&active_isa()) {
  if (sliding_window < 0) {
    throw KernelArgumentError("sliding_window must be >= 0 (0: none), got " + std::to_string(sliding_window));
  }
  check_num_threads(num_threads);
  const auto copy = [](const TensorArg& t) {
    const int32_t* p = t.ptr<int32_t>();
    return std::vector<int32_t>(p, p + t.numel());
  };
  query_start_loc_ = copy(query_start_loc);
  seq_lens_ = copy(seq_lens);
  block_tables_ = copy(block_tables);
  const int32_t* qsl = query_start_loc_.data();
  const int32_t* lens = seq_lens_.data();

  int64_t base_items = 0;
  for (int64_t b = 0; b < g_.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    if (q_len > 0) base_items += g_.num_kv_heads * ((q_len + kQueryChunk - 1) / kQueryChunk);
  }
  // Too few items to keep the threads busy: split each over its query heads (a row's result does not
  // change: batch invariant), or, with split_kv, long decodes along the KV length (flash-decoding; the
  // merge sums in another order than one item would, so a token's output then depends on the step).
  const int64_t target = 4 * static_cast<int64_t>(std::max(num_threads, 1));
  const bool few = base_items > 0 && base_items < target;
  const int64_t more = few ? (target + base_items - 1) / base_items : 1;
  const int64_t split_factor = split_kv ? more : 1;
  const int32_t G = static_cast<int32_t>(g_.group());
  const int32_t head_parts = split_kv ? 1 : static_cast<int32_t>(std::min<int64_t>(G, more));
  for (int32_t b = 0; b < g_.num_seqs; ++b) {
    const int32_t q_len = qsl[b + 1] - qsl[b];
    if (q_len == 0) continue;
    const int32_t seq_len = lens[b];
    const int32_t nb = static_cast<int32_t>((seq_len + g_.block_size - 1) / g_.block_size);
    // the first block holding a key visible to query position p under the window
    const auto first_block = [&](int64_t p) -> int32_t {
      return sliding_window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, p - sliding_window + 1) / g_.block_size)
                                : 0;
    };
    for (int32_t hk = 0; hk < g_.num_kv_heads; ++hk) {
      int32_t splits = 1;
      const int32_t j_start = q_len == 1 ? first_block(seq_len - 1) : 0;
      if (q_len == 1 && split_factor > 1) {
        splits = static_cast<int32_t>(
            std::min<int64_t>(split_factor, std::max(1, (nb - j_start) / kMinBlocksPerSplit)));
      }
      if (splits > 1) {
        split_groups_.push_back({b, hk, splits, static_cast<int64_t>(items_.size())});
        const int32_t per = (nb - j_start + splits - 1) / splits;
        for (int32_t sp = 0; sp < splits; ++sp) {
          items_.push_back({b, hk, 0, 1, j_start + sp * per, std::min(nb, j_start + (sp + 1) * per), sp, 0, G});
        }
        continue;
      }
      for (int32_t q0 = 0; q0 < q_len; q0 += kQueryChunk) {
        const int32_t q1 = std::min(q_len, q0 + kQueryChunk);
        // causal: the chunk's last query sees keys up to its own position
        const int64_t last_pos = causal ? seq_len - q_len + q1 - 1 : seq_len - 1;
        for (int32_t hp = 0; hp < head_parts; ++hp) {
          items_.push_back({b, hk, q0, q1, first_block(seq_len - q_len + q0),
                            static_cast<int32_t>(last_pos / g_.block_size + 1), -1, hp * G / head_parts,
                            (hp + 1) * G / head_parts});
        }
      }
    }
  }
  int64_t n_partial = 0;
  partial_slot_.assign(items_.size(), -1);
  for (size_t i = 0; i < items_.size(); ++i) {
    if (items_[i].split >= 0) partial_slot_[i] = n_partial++;
  }
  partial_acc_.resize(n_partial * g_.group() * g_.head_dim);
  partial_ml_.resize(n_partial * g_.group());
  // query-head x key pairs the step scores; below kInlineWork waking the pool's
  // workers costs more than the work (docs/benchmarks.md, "Behind the code")
  constexpr int64_t kInlineWork = 16384;
  int64_t work = 0;
  for (const WorkItem& it : items_) work += int64_t{it.j1 - it.j0} * g_.block_size * (it.q1 - it.q0) * (it.g1 - it.g0);
  run_inline_ = work < kInlineWork;
  pool_ = ThreadPool::get(num_threads);
  scratch_.assign(pool_->num_threads(),
                  std::vector<float>(kernel_scratch_floats(g_.group(), g_.head_dim, g_.block_size)));
}

AttentionPlan::~AttentionPlan() = default;

int AttentionPlan::num_threads() const { return pool_->num_threads(); }

int64_t AttentionPlan::num_blocks_visited() const {
  int64_t n = 0;
  for (const WorkItem& it : items_) n += it.j1 - it.j0;
  return n;
}

void AttentionPlan::run(const TensorArg& out, const TensorArg& query, const TensorArg& k_cache,
                        const TensorArg& v_cache, float scale, float softcap) {
  if (!(softcap >= 0.f) || std::isinf(softcap)) {
    throw KernelArgumentError("softcap must be a finite number >= 0 (0: none), got " + std::to_string(softcap));
  }
  check_caches(k_cache, v_cache, g_.num_blocks, g_.num_kv_heads, g_.head_dim, g_.block_size);
  check_token_heads(query, g_.num_tokens, g_.num_heads, g_.head_dim, k_cache.dtype);
  check_token_heads(out, g_.num_tokens, g_.num_heads, g_.head_dim, k_cache.dtype);
  out.check_no_overlap();
  std::lock_guard<std::mutex> lock(mu_);
  KernelArgs a{};
  a.dtype = k_cache.dtype;
  a.query = query.data;
  a.query_stride_token = query.strides[0];
  a.query_stride_head = query.strides[1];
  a.out = out.data;
  a.out_stride_token = out.strides[0];
  a.out_stride_head = out.strides[1];
  a.k_cache = k_cache.data;
  a.v_cache = v_cache.data;
  a.query_start_loc = query_start_loc_.data();
  a.seq_lens = seq_lens_.data();
  a.block_tables = block_tables_.data();
  a.num_kv_heads = g_.num_kv_heads;
  a.group = g_.group();
  a.head_dim = g_.head_dim;
  a.block_size = g_.block_size;
  a.max_blocks = g_.max_blocks;
  a.scale = scale;
  a.causal = causal_;
  a.sliding_window = sliding_window_;
  a.softcap = softcap;
  const KernelTable& k = isa_->attention();
  const int64_t per_split = g_.group() * g_.head_dim;  // floats of one split item's partial accumulators
  const auto dispatch = [this](int64_t n, const std::function<void(int64_t, int)>& fn) {
    if (run_inline_) {
      for (int64_t i = 0; i < n; ++i) fn(i, 0);
    } else {
      pool_->run(n, fn);
    }
  };
  // runs of consecutive items, so a worker knows the item it runs next and
  // prefetches its first KV blocks; about 8 runs per thread keep the threads balanced
  const int64_t n_items = static_cast<int64_t>(items_.size());
  const int64_t run_len = std::max<int64_t>(1, run_inline_ ? n_items : n_items / (8 * int64_t{pool_->num_threads()}));
  dispatch((n_items + run_len - 1) / run_len, [&](int64_t c, int worker) {
    const int64_t end = std::min(n_items, (c + 1) * run_len);
    for (int64_t i = c * run_len; i < end; ++i) {
      const int64_t ps = partial_slot_[i];
      k.run_item(a, items_[i], i + 1 < end ? &items_[i + 1] : nullptr, scratch_[worker].data(),
                 ps >= 0 ? partial_acc_.data() + ps * per_split : nullptr,
                 ps >= 0 ? partial_ml_.data() + ps * g_.group() : nullptr);
    }
  });
  dispatch(static_cast<int64_t>(split_groups_.size()), [&](int64_t i, int worker) {
    const SplitGroup& sg = split_groups_[i];
    const int64_t ps = partial_slot_[sg.first_item];
    k.merge_splits(a, sg.b, sg.hk, sg.splits, partial_acc_.data() + ps * per_split,
                   partial_ml_.data() + ps * g_.group(),
                   scratch_[worker].data());
  });
}

size_t paged_attention_scratch_bytes(int num_heads, int num_kv_heads, int head_dim, int block_size) {
  return static_cast<size_t>(kernel_scratch_floats(num_heads / std::max(num_kv_heads, 1), head_dim, block_size)) *
         sizeof(float);
}

}  // namespace cpu
}  // namespace pagedserve
