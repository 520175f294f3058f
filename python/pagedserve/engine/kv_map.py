"""The KV map (GET /v1/kv): the block pool block by block, who owns each
block, the prefix cache and the queues, read from the C++ scheduler in one
consistent moment (the engine thread, between steps)."""

from __future__ import annotations

import numpy as np

STATE_CHARS = ".cuU"  # by BlockState: free, evictable (cached, refcount 0), in use, in use and cached


def kv_map(scheduler, with_hashes: bool = False) -> dict:
    """A JSON-ready picture of the KV pool.

    Args:
        scheduler: the engine's _core.Scheduler (called on the engine thread).
        with_hashes: add `hashes`, each cached block's prefix-cache hash
            prefix (16 hex digits), keyed by block id (large for big pools).
    Returns:
        num_blocks, block_size; num_free + num_cached + num_in_use ==
        num_blocks (num_cached: evictable blocks that hold a prefix-cache
        entry; in-use blocks may be cached too, num_in_use_cached of them);
        states: one character per block ("." free, "c" cached and evictable,
        "u" in use, "U" in use and cached, so new prompts can share it);
        shared: {block id: refcount} of blocks held by more than one sequence;
        owners: per sequence holding blocks, request_id, index and block_ids;
        prefix_cache: queries, hits (tokens) and hit_rate; num_running,
        num_waiting, num_preemptions.
    """
    kv = scheduler.kv_cache_manager
    states, refcounts, hashes = kv.block_map()
    counts = np.bincount(states, minlength=4)
    stats = scheduler.prefix_cache_stats
    shared = np.flatnonzero(refcounts > 1)
    out = {
        "num_blocks": int(states.size), "block_size": kv.block_size,
        "num_free": int(counts[0]), "num_cached": int(counts[1]), "num_in_use": int(counts[2] + counts[3]),
        "num_in_use_cached": int(counts[3]),
        "states": np.frombuffer(STATE_CHARS.encode(), dtype=np.uint8)[states].tobytes().decode("ascii"),
        "shared": {int(b): int(refcounts[b]) for b in shared},
        "owners": [{"request_id": o.request_id, "index": o.index, "block_ids": list(o.block_ids)}
                   for o in scheduler.block_owners()],
        "prefix_cache": {"queries": stats.queries, "hits": stats.hits,
                         "hit_rate": stats.hits / stats.queries if stats.queries else 0.0},
        "num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
        "num_preemptions": scheduler.num_preemptions,
    }
    if with_hashes:
        cached = np.flatnonzero(hashes)
        out["hashes"] = {int(b): f"{int(hashes[b]):016x}" for b in cached}
    return out
