// KV-cache events: what a router outside the engine needs to mirror which
// prefixes a replica holds. The schema is vLLM's KV events (BlockStored,
// BlockRemoved, AllBlocksCleared), which llm-d's scheduler, NVIDIA Dynamo's
// KV router and SGLang's gateway read. The KVCacheManager records them while
// recording is on (set_record_events): kBlockStored when full blocks enter
// the prefix cache (one event per run of a sequence's consecutive newly
// cached blocks, in chain order: the first block's parent is the block
// before the run), kBlockRemoved when the pool evicts a cached block
// (consecutive evictions share one event). Python drains them after each step
// and publishes them (python/pagedserve/engine/kv_events.py; the wire format
// is in docs/kv-events.md).
#pragma once

#include <cstdint>
#include <vector>

#include "prefix_cache.h"

namespace pagedserve {

enum class KVEventType : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };

// "BlockStored", "BlockRemoved" or "AllBlocksCleared" (vLLM's tags).
const char* kv_event_type_str(KVEventType t);

struct KVCacheEvent {
  KVEventType type = KVEventType::kBlockStored;
  std::vector<BlockHash> block_hashes;  // PrefixCache's chained SHA-256 of each block
  bool has_parent = false;              // kBlockStored: the run's first block has a parent block
  BlockHash parent_block_hash{};        // valid when has_parent
  std::vector<int32_t> token_ids;       // kBlockStored: block_size tokens per hash, in order
  int32_t block_size = 0;               // kBlockStored: tokens per block
};

}  // namespace pagedserve
