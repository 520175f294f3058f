#include "prefix_cache.h"

#include <string>

#include "errors.h"

namespace pagedserve {

PrefixCache::PrefixCache(int32_t num_blocks) : hash_fn_(&PrefixCache::hash_block), entries_(num_blocks) {}

BlockHash PrefixCache::hash_block(const BlockHash* parent, const int32_t* tokens, int32_t n,
                                  const std::string& extra_key) {
  Sha256 h;
  const uint8_t has_parent = parent != nullptr;
  h.update(&has_parent, 1);
  if (parent) h.update(parent->data(), parent->size());
  // token ids as little-endian int32, independent of the host's byte order
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * 4);
  for (int32_t i = 0; i < n; ++i) {
    const uint32_t t = static_cast<uint32_t>(tokens[i]);
    for (int k = 0; k < 4; ++k) bytes[i * 4 + k] = static_cast<uint8_t>(t >> (8 * k));
  }
  h.update(bytes.data(), bytes.size());
  // the extra key's length as little-endian uint64, then its bytes
  uint8_t extra_len[8];
  for (int k = 0; k < 8; ++k) extra_len[k] = static_cast<uint8_t>(static_cast<uint64_t>(extra_key.size()) >> (8 * k));
  h.update(extra_len, sizeof extra_len);
  h.update(extra_key.data(), extra_key.size());
  return h.digest();
}

int32_t PrefixCache::lookup(const BlockHash& hash, const BlockHash* parent, const int32_t* tokens, int32_t n,
                            const std::string& extra_key) const {
  auto it = map_.find(hash);
  if (it == map_.end()) return -1;
  const Entry& e = *entries_[it->second];
  const bool same_parent = parent ? (e.parent && *e.parent == *parent) : !e.parent;
  if (!same_parent || e.extra_key != extra_key || e.tokens.size() != static_cast<size_t>(n) ||
      !std::equal(e.tokens.begin(), e.tokens.end(), tokens)) {
    return -1;  // a hash collision: never serve another prefix's K/V
  }
  return it->second;
}

bool PrefixCache::insert(int32_t block_id, const BlockHash& hash, const BlockHash* parent, const int32_t* tokens,
                         int32_t n, const std::string& extra_key) {
  check_block(block_id);
  if (map_.count(hash) || entries_[block_id].has_value()) return false;
  Entry e{hash, parent ? std::optional<BlockHash>(*parent) : std::nullopt, std::vector<int32_t>(tokens, tokens + n),
          extra_key};
  entries_[block_id] = std::move(e);
  map_.emplace(hash, block_id);
  return true;
}

const BlockHash* PrefixCache::hash_of(int32_t block_id) const {
  check_block(block_id);
  const auto& e = entries_[block_id];
  return e ? &e->hash : nullptr;
}

std::vector<BlockHash> PrefixCache::hashes() const {
  std::vector<BlockHash> out;
  out.reserve(map_.size());
  for (const auto& kv : map_) out.push_back(kv.first);
  return out;
}

void PrefixCache::erase_block(int32_t block_id) {
  check_block(block_id);
  auto& e = entries_[block_id];
  if (!e) return;
  map_.erase(e->hash);
  e.reset();
}

bool PrefixCache::is_cached(int32_t block_id) const {
  check_block(block_id);
  return entries_[block_id].has_value();
}

uint64_t PrefixCache::hash_prefix(int32_t block_id) const {
  check_block(block_id);
  if (!entries_[block_id].has_value()) return 0;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | entries_[block_id]->hash[i];
  return v;
}

void PrefixCache::check_block(int32_t block_id) const {
  if (block_id < 0 || static_cast<size_t>(block_id) >= entries_.size()) {
    throw BlockPoolError("block id " + std::to_string(block_id) + " out of range [0, " +
                         std::to_string(entries_.size()) + ")");
  }
}

}  // namespace pagedserve
