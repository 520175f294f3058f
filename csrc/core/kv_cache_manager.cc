#include "kv_cache_manager.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace pagedserve {

KVCacheManager::KVCacheManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      pool_(num_blocks),
      prefix_cache_(num_blocks) {
  if (block_size <= 0) {
    throw BlockPoolError("block_size must be > 0, got " + std::to_string(block_size));
  }
  pool_.set_evict_callback([this](int32_t block) {
    const BlockHash* h = record_events_ ? prefix_cache_.hash_of(block) : nullptr;
    if (h != nullptr) {
      if (events_.empty() || events_.back().type != KVEventType::kBlockRemoved) {
        events_.emplace_back();
        events_.back().type = KVEventType::kBlockRemoved;
      }
      events_.back().block_hashes.push_back(*h);
    }
    prefix_cache_.erase_block(block);
  });
}

KVBlockMap KVCacheManager::block_map() const {
  const int32_t n = num_blocks();
  KVBlockMap m;
  m.states.resize(n);
  m.refcounts.resize(n);
  m.hash_prefixes.resize(n);
  for (int32_t b = 0; b < n; ++b) {
    const int32_t refs = pool_.refcount(b);
    const uint64_t hash = prefix_cache_.hash_prefix(b);
    m.refcounts[b] = refs;
    m.hash_prefixes[b] = hash;
    BlockState s = BlockState::kFree;
    if (refs > 0) {
      s = prefix_cache_.is_cached(b) ? BlockState::kInUseCached : BlockState::kInUse;
    } else if (pool_.is_evictable(b)) {
      s = BlockState::kEvictable;
    }
    m.states[b] = static_cast<uint8_t>(s);
  }
  return m;
}

double KVCacheManager::usage() const {
  return 1.0 - static_cast<double>(num_free_blocks()) / num_blocks();
}

PrefixMatch KVCacheManager::match_prefix(const std::vector<int32_t>& tokens, const std::string& cache_salt) const {
  PrefixMatch m;
  if (!enable_prefix_caching_ || tokens.empty()) return m;
  const int32_t max_blocks = (static_cast<int32_t>(tokens.size()) - 1) / block_size_;
  for (int32_t i = 0; i < max_blocks; ++i) {
    const int32_t* blk = tokens.data() + static_cast<ptrdiff_t>(i) * block_size_;
    const BlockHash* parent = m.hashes.empty() ? nullptr : &m.hashes.back();
    BlockHash h = prefix_cache_.hash(parent, blk, block_size_, cache_salt);
    const int32_t id = prefix_cache_.lookup(h, parent, blk, block_size_, cache_salt);
    if (id < 0) break;
    m.block_ids.push_back(id);
    m.hashes.push_back(h);
  }
  return m;
}

int32_t KVCacheManager::num_blocks_to_allocate(int32_t num_tokens, const PrefixMatch& match) const {
  int32_t revived = 0;  // cached blocks sitting in the evictable list: reviving them uses them up
  for (int32_t b : match.block_ids) revived += pool_.is_evictable(b) ? 1 : 0;
  const int32_t fresh = BlockTable::num_blocks_for(num_tokens, block_size_) - static_cast<int32_t>(match.block_ids.size());
  return std::max(fresh, 0) + revived;
}

bool KVCacheManager::can_allocate(int32_t num_tokens, const PrefixMatch& match) const {
  return num_blocks_to_allocate(num_tokens, match) <= num_free_blocks();
}

int32_t KVCacheManager::num_exclusive_blocks(int64_t seq_id) const {
  int32_t n = 0;
  for (int32_t b : entry(seq_id).table.block_ids()) n += pool_.refcount(b) == 1 ? 1 : 0;
  return n;
}

void KVCacheManager::allocate(int64_t seq_id, int32_t num_tokens, const PrefixMatch& match,
                              const std::string& cache_salt) {
  if (has_sequence(seq_id)) {
    throw RequestRejectedError("sequence " + std::to_string(seq_id) + " already has blocks");
  }
  if (num_tokens < match.num_tokens(block_size_)) {
    throw InvalidArgumentError("num_tokens " + std::to_string(num_tokens) + " is shorter than the cached prefix (" +
                               std::to_string(match.num_tokens(block_size_)) + " tokens)");
  }
  if (!can_allocate(num_tokens, match)) {
    throw OutOfBlocksError("cannot allocate " + std::to_string(num_tokens) + " tokens: only " +
                           std::to_string(num_free_blocks()) + " free blocks");
  }
  Entry e{BlockTable(block_size_), num_tokens, match.hashes, cache_salt};
  for (int32_t b : match.block_ids) {  // revive first: allocate() below must not evict them
    pool_.acquire(b);
    e.table.append_block(b);
  }
  while (e.table.num_blocks() < BlockTable::num_blocks_for(num_tokens, block_size_)) {
    e.table.append_block(pool_.allocate());
  }
  tables_.emplace(seq_id, std::move(e));
}

const KVCacheManager::Entry& KVCacheManager::entry(int64_t seq_id) const {
  auto it = tables_.find(seq_id);
  if (it == tables_.end()) {
    throw UnknownRequestError("sequence " + std::to_string(seq_id) + " has no block table");
  }
  return it->second;
}

int32_t KVCacheManager::blocks_needed(const Entry& e, int32_t num_new_tokens) const {
  int32_t want = BlockTable::num_blocks_for(e.num_tokens + num_new_tokens, block_size_);
  return want > e.table.num_blocks() ? want - e.table.num_blocks() : 0;
}

// The next token goes into the last block, which is partially filled and shared.
bool KVCacheManager::needs_cow(const Entry& e, int32_t num_new_tokens) const {
  return num_new_tokens > 0 && e.num_tokens % block_size_ != 0 && e.table.num_blocks() > 0 &&
         pool_.refcount(e.table.block_ids()[e.num_tokens / block_size_]) > 1;
}

bool KVCacheManager::can_append(int64_t seq_id, int32_t num_new_tokens) const {
  const Entry& e = entry(seq_id);
  return blocks_needed(e, num_new_tokens) + (needs_cow(e, num_new_tokens) ? 1 : 0) <= num_free_blocks();
}

void KVCacheManager::append(int64_t seq_id, int32_t num_new_tokens) {
  if (!can_append(seq_id, num_new_tokens)) {
    throw OutOfBlocksError("cannot append " + std::to_string(num_new_tokens) +
                           " tokens to sequence " + std::to_string(seq_id));
  }
  Entry& e = tables_.at(seq_id);
  if (needs_cow(e, num_new_tokens)) {  // copy-on-write of the shared partial block
    const int32_t idx = e.num_tokens / block_size_;
    const int32_t src = e.table.block_ids()[idx];
    const int32_t dst = pool_.allocate();
    e.table.set_block(idx, dst);
    pool_.free(src);
    pending_copies_.emplace_back(src, dst);
    ++num_cow_copies_;
  }
  for (int32_t n = blocks_needed(e, num_new_tokens); n > 0; --n) {
    e.table.append_block(pool_.allocate());
  }
  e.num_tokens += num_new_tokens;
}

void KVCacheManager::truncate(int64_t seq_id, int32_t num_tokens) {
  entry(seq_id);  // UnknownRequestError for an unknown id
  Entry& e = tables_.at(seq_id);
  // never into the full blocks whose hashes are known (computed K/V the prefix cache may hold)
  const int32_t hashed = static_cast<int32_t>(e.hashes.size()) * block_size_;
  if (num_tokens < hashed || num_tokens > e.num_tokens) {
    throw InvalidArgumentError("cannot truncate sequence " + std::to_string(seq_id) + " to " +
                               std::to_string(num_tokens) + " of its " + std::to_string(e.num_tokens) + " slots");
  }
  e.num_tokens = num_tokens;
  while (e.table.num_blocks() > BlockTable::num_blocks_for(num_tokens, block_size_)) {
    const int32_t b = e.table.pop_block();
    pending_copies_.erase(std::remove_if(pending_copies_.begin(), pending_copies_.end(),
                                         [&](const std::pair<int32_t, int32_t>& c) { return c.second == b; }),
                          pending_copies_.end());
    pool_.free(b);
  }
}

void KVCacheManager::fork(int64_t parent_seq_id, int64_t child_seq_id) {
  const Entry& parent = entry(parent_seq_id);
  if (has_sequence(child_seq_id)) {
    throw RequestRejectedError("sequence " + std::to_string(child_seq_id) + " already has blocks");
  }
  for (int32_t b : parent.table.block_ids()) pool_.incref(b);
  tables_.emplace(child_seq_id, parent);
}

std::vector<std::pair<int32_t, int32_t>> KVCacheManager::take_pending_copies() {
  std::vector<std::pair<int32_t, int32_t>> out;
  out.swap(pending_copies_);
  return out;
}

void KVCacheManager::cache_full_blocks(int64_t seq_id, const std::vector<int32_t>& tokens,
                                       int32_t num_computed_tokens) {
  if (!enable_prefix_caching_) return;
  auto it = tables_.find(seq_id);
  if (it == tables_.end()) return;
  Entry& e = it->second;
  const int32_t full = std::min<int32_t>(num_computed_tokens, static_cast<int32_t>(tokens.size())) / block_size_;
  KVCacheEvent* run = nullptr;  // the BlockStored event of the current run of newly cached blocks
  for (int32_t i = static_cast<int32_t>(e.hashes.size()); i < full; ++i) {
    const int32_t* blk = tokens.data() + static_cast<ptrdiff_t>(i) * block_size_;
    const BlockHash* parent = e.hashes.empty() ? nullptr : &e.hashes.back();
    BlockHash h = prefix_cache_.hash(parent, blk, block_size_, e.cache_salt);
    const int32_t block = e.table.block_ids()[i];
    // If another sequence already cached this content, the hash stays with its
    // block and ours stays private (freed normally).
    if (prefix_cache_.insert(block, h, parent, blk, block_size_, e.cache_salt)) {
      pool_.mark_cached(block);
      if (record_events_) {
        if (run == nullptr) {
          events_.emplace_back();
          run = &events_.back();
          run->type = KVEventType::kBlockStored;
          run->block_size = block_size_;
          run->has_parent = parent != nullptr;
          if (parent != nullptr) run->parent_block_hash = *parent;
        }
        run->block_hashes.push_back(h);
        run->token_ids.insert(run->token_ids.end(), blk, blk + block_size_);
      }
    } else {
      run = nullptr;
    }
    e.hashes.push_back(h);
  }
}

std::vector<KVCacheEvent> KVCacheManager::take_events() {
  std::vector<KVCacheEvent> out;
  out.swap(events_);
  return out;
}

bool KVCacheManager::free(int64_t seq_id) {
  auto it = tables_.find(seq_id);
  if (it == tables_.end()) return false;
  // Free in reverse so a prompt's tail blocks become the least recently used
  // and its head blocks (most shared) are evicted last.
  const auto& ids = it->second.table.block_ids();
  // A copy-on-write copy not yet taken targets a block only this sequence held:
  // nobody needs it any more (the sequence was preempted or ended in this step).
  pending_copies_.erase(std::remove_if(pending_copies_.begin(), pending_copies_.end(),
                                       [&](const std::pair<int32_t, int32_t>& c) {
                                         return std::find(ids.begin(), ids.end(), c.second) != ids.end();
                                       }),
                        pending_copies_.end());
  for (auto b = ids.rbegin(); b != ids.rend(); ++b) pool_.free(*b);
  tables_.erase(it);
  return true;
}

const BlockTable& KVCacheManager::block_table(int64_t seq_id) const { return entry(seq_id).table; }

int32_t KVCacheManager::num_tokens(int64_t seq_id) const { return entry(seq_id).num_tokens; }

}  // namespace pagedserve
