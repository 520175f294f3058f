// PrefixCache: content-addressed full KV blocks (vLLM's automatic prefix
// caching; SGLang's RadixAttention shares the idea). A full block's hash is
//   SHA-256(has_parent (1 byte) || parent block's hash (32 bytes, when it has one)
//           || the block's token ids (int32, little endian)
//           || the extra key's length (uint64, little endian) || the extra key)
// chained from the first block, so equal hashes mean equal prefixes; the extra
// key carries the request's cache_salt so differently salted requests never
// share blocks. A hit is only served after comparing the stored parent hash,
// token ids and extra key too, so even a hash collision cannot serve wrong K/V.
//
// The cache only maps hashes to block ids; the BlockPool keeps freed cached
// blocks evictable in LRU order and calls erase_block() when it evicts one.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "sha256.h"

namespace pagedserve {

using BlockHash = Sha256Digest;

struct BlockHashKey {
  size_t operator()(const BlockHash& h) const {
    size_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | h[i];
    return v;
  }
};

class PrefixCache {
 public:
  // The hash of one full block; parent is nullptr for the first block.
  using HashFn = std::function<BlockHash(const BlockHash* parent, const int32_t* tokens, int32_t n,
                                         const std::string& extra_key)>;

  explicit PrefixCache(int32_t num_blocks);

  // SHA-256(parent || tokens || extra_key), the default HashFn.
  static BlockHash hash_block(const BlockHash* parent, const int32_t* tokens, int32_t n,
                              const std::string& extra_key);
  BlockHash hash(const BlockHash* parent, const int32_t* tokens, int32_t n, const std::string& extra_key) const {
    return hash_fn_(parent, tokens, n, extra_key);
  }

  // The block holding exactly this content, or -1.
  int32_t lookup(const BlockHash& hash, const BlockHash* parent, const int32_t* tokens, int32_t n,
                 const std::string& extra_key) const;
  // Registers block_id under hash. Returns false (and registers nothing) if the
  // hash is already taken or the block already holds a hash. Every block_id
  // argument of this class throws BlockPoolError if out of [0, num_blocks).
  bool insert(int32_t block_id, const BlockHash& hash, const BlockHash* parent, const int32_t* tokens,
              int32_t n, const std::string& extra_key);
  // Forgets block_id's hash (eviction). No-op if it has none.
  void erase_block(int32_t block_id);
  bool is_cached(int32_t block_id) const;
  // block_id's hash, or nullptr when it holds none (valid until the next insert or erase).
  const BlockHash* hash_of(int32_t block_id) const;
  // The first 8 bytes of block_id's hash as a big-endian integer, 0 when it holds none.
  uint64_t hash_prefix(int32_t block_id) const;
  size_t size() const { return map_.size(); }
  // Every hash the cache holds (one per cached block), in no particular order.
  std::vector<BlockHash> hashes() const;

  // Replaces the hash function (tests force collisions with it).
  void set_hash_fn(HashFn fn) { hash_fn_ = std::move(fn); }

 private:
  struct Entry {
    BlockHash hash;
    std::optional<BlockHash> parent;
    std::vector<int32_t> tokens;
    std::string extra_key;
  };
  void check_block(int32_t block_id) const;

  HashFn hash_fn_;
  std::unordered_map<BlockHash, int32_t, BlockHashKey> map_;
  std::vector<std::optional<Entry>> entries_;
};

}  // namespace pagedserve
