#include "kv_events.h"

namespace pagedserve {

const char* kv_event_type_str(KVEventType t) {
  switch (t) {
    case KVEventType::kBlockStored: return "BlockStored";
    case KVEventType::kBlockRemoved: return "BlockRemoved";
    case KVEventType::kAllBlocksCleared: return "AllBlocksCleared";
  }
  return "";
}

}  // namespace pagedserve
