// KVCacheManager: the allocator API the scheduler uses. It owns the BlockPool,
// the PrefixCache and one BlockTable per sequence, and offers two-phase calls
// so nothing fails half-way (nano-vllm's BlockManager, vLLM's KVCacheManager):
//   match_prefix(tokens, salt)          -> can_allocate(n, match) -> allocate(seq_id, n, match)
//   can_append(seq_id, num_new_tokens)  -> append(seq_id, num_new_tokens)
//   cache_full_blocks(seq_id, tokens, num_computed_tokens)   (commit step)
//   fork(parent, child): the child shares all the parent's blocks (refcount +1);
//   the first append into a shared, partially filled last block copies it
//   (copy-on-write) and records (src, dst) in take_pending_copies().
// A sequence's table always covers its reserved token slots (num_tokens(seq_id));
// blocks are handed out lazily, one block_size at a time.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "block_table.h"
#include "kv_events.h"
#include "prefix_cache.h"

namespace pagedserve {

// The longest cached prefix of full blocks of a token sequence.
struct PrefixMatch {
  std::vector<int32_t> block_ids;  // cached blocks, in order (not yet acquired)
  std::vector<BlockHash> hashes;   // their chained hashes
  int32_t num_tokens(int32_t block_size) const { return static_cast<int32_t>(block_ids.size()) * block_size; }
};

// A block's state in KVBlockMap.
enum class BlockState : uint8_t {
  kFree = 0,        // on the free list
  kEvictable = 1,   // refcount 0 but holds a prefix-cache entry: reusable until evicted
  kInUse = 2,       // held by sequences (refcount > 0)
  kInUseCached = 3  // held, and registered in the prefix cache (new sequences can share it)
};

struct KVBlockMap {
  std::vector<uint8_t> states;          // [num_blocks] BlockState
  std::vector<int32_t> refcounts;       // [num_blocks]
  std::vector<uint64_t> hash_prefixes;  // [num_blocks] 0: no prefix-cache entry
};

class KVCacheManager {
 public:
  // num_blocks > 0; block_size in {16, 32} for the model path (any value > 0 is
  // accepted here so the allocator can be studied on its own).
  KVCacheManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching = false);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return pool_.num_blocks(); }
  // Blocks available to allocate: truly free + evictable cached ones.
  int32_t num_free_blocks() const { return pool_.num_free_blocks(); }
  int32_t num_evictable_blocks() const { return pool_.num_evictable_blocks(); }
  int64_t num_evictions() const { return pool_.num_evictions(); }
  bool prefix_caching_enabled() const { return enable_prefix_caching_; }
  // Fraction of blocks held by sequences, in [0, 1].
  double usage() const;

  // Longest prefix of full blocks of `tokens` whose K/V are cached under
  // `cache_salt`, leaving at least one token to compute (so the sequence gets
  // logits). Empty when prefix caching is off.
  PrefixMatch match_prefix(const std::vector<int32_t>& tokens, const std::string& cache_salt) const;

  // True if a new sequence of num_tokens tokens, of which the match's blocks are
  // cached, can get its blocks now (reviving an evictable block uses it up).
  bool can_allocate(int32_t num_tokens, const PrefixMatch& match = {}) const;
  // Blocks allocate(num_tokens, match) would take from the free + evictable
  // ones (new blocks plus the match's evictable blocks it revives).
  int32_t num_blocks_to_allocate(int32_t num_tokens, const PrefixMatch& match = {}) const;
  // Creates seq_id's block table covering num_tokens slots: the match's blocks
  // (shared, refcount +1) then new ones. Throws RequestRejectedError if seq_id
  // already has a table, InvalidArgumentError if num_tokens is shorter than the
  // match, OutOfBlocksError if can_allocate() is false.
  void allocate(int64_t seq_id, int32_t num_tokens, const PrefixMatch& match = {},
                const std::string& cache_salt = "");

  // True if seq_id can reserve num_new_tokens more slots now.
  // Throws UnknownRequestError for an unknown seq_id.
  bool can_append(int64_t seq_id, int32_t num_new_tokens) const;
  // Reserves num_new_tokens more slots, taking new blocks as needed.
  // Throws UnknownRequestError / OutOfBlocksError.
  void append(int64_t seq_id, int32_t num_new_tokens);

  // Gives back seq_id's reserved slots past the first num_tokens (rejected
  // speculative tokens): its count of reserved slots becomes num_tokens and
  // the blocks wholly past them return to the pool (refcount -1). Throws
  // UnknownRequestError, InvalidArgumentError unless num_tokens lies between
  // the tokens of its hashed full blocks and the reserved count.
  void truncate(int64_t seq_id, int32_t num_tokens);

  // Gives child_seq_id the same blocks as parent_seq_id (shared, refcount +1),
  // reserved slots and prefix hashes. Throws UnknownRequestError for an unknown
  // parent, RequestRejectedError if the child already has a table.
  void fork(int64_t parent_seq_id, int64_t child_seq_id);
  // Block copies (src, dst) that copy-on-write decided since the last call; the
  // model runner must copy src's K/V into dst before the next forward pass.
  std::vector<std::pair<int32_t, int32_t>> take_pending_copies();
  int64_t num_cow_copies() const { return num_cow_copies_; }

  // Registers seq_id's blocks that became full with computed K/V (the first
  // num_computed_tokens of `tokens`) in the prefix cache. No-op when off.
  void cache_full_blocks(int64_t seq_id, const std::vector<int32_t>& tokens, int32_t num_computed_tokens);

  // Gives back every block of seq_id (refcount -1 each) and drops its pending
  // copy-on-write copies. Unknown ids are a no-op and return false, so abort
  // paths can call it unconditionally.
  bool free(int64_t seq_id);

  // Blocks free(seq_id) would make available again: those only seq_id holds
  // (refcount 1). Throws UnknownRequestError for an unknown seq_id.
  int32_t num_exclusive_blocks(int64_t seq_id) const;

  bool has_sequence(int64_t seq_id) const { return tables_.count(seq_id) != 0; }
  // Throws UnknownRequestError for an unknown seq_id.
  const BlockTable& block_table(int64_t seq_id) const;
  int32_t num_tokens(int64_t seq_id) const;
  const BlockPool& block_pool() const { return pool_; }
  // The pool block by block (the KV map of GET /v1/kv): each block's
  // BlockState, refcount and prefix-cache hash prefix (PrefixCache::hash_prefix).
  KVBlockMap block_map() const;
  PrefixCache& prefix_cache() { return prefix_cache_; }
  // The hashes of every block the prefix cache holds (in use or evictable), unordered.
  std::vector<BlockHash> cached_block_hashes() const { return prefix_cache_.hashes(); }

  // KV-cache events (kv_events.h): off by default. While on, every block that
  // enters the prefix cache and every cached block the pool evicts is recorded
  // until take_events() hands the list over (and clears it).
  void set_record_events(bool on) { record_events_ = on; }
  bool record_events() const { return record_events_; }
  std::vector<KVCacheEvent> take_events();

 private:
  struct Entry {
    BlockTable table;
    int32_t num_tokens;
    std::vector<BlockHash> hashes;  // chained hashes of the leading full blocks known so far
    std::string cache_salt;
  };
  int32_t blocks_needed(const Entry& e, int32_t num_new_tokens) const;
  bool needs_cow(const Entry& e, int32_t num_new_tokens) const;
  const Entry& entry(int64_t seq_id) const;

  int32_t block_size_;
  bool enable_prefix_caching_;
  BlockPool pool_;
  PrefixCache prefix_cache_;
  std::unordered_map<int64_t, Entry> tables_;
  std::vector<std::pair<int32_t, int32_t>> pending_copies_;
  int64_t num_cow_copies_ = 0;
  bool record_events_ = false;
  std::vector<KVCacheEvent> events_;
};

}  // namespace pagedserve
