"""PagedServe's routers (router.py) as a Ray Serve request router.

Ray Serve calls a deployment's request router in the process that holds the
DeploymentHandle (here the ingress) for every request: ``choose_replicas``
gets the candidate replicas, each with the ``routing_stats`` its
``record_routing_stats()`` last returned (the Serve controller polls every
``request_routing_stats_period_s`` and passes on only stats that changed), and
the request's arguments.

``PagedServeRequestRouter`` keeps one of our ``Router``s (``policy``: prefix,
round-robin, least-loaded) in step with Ray's replica set: a replica's new
report (its ``report_seq`` moved) replaces what the router knew of it, a
replica Ray no longer lists or reports dead is forgotten (a restarted one comes
back as a new replica id, knowing nothing). The request's block hashes come as
the ``block_hashes`` keyword of the call (the ingress computed them with the
engine's hash).

A report carries each cached block's hash cut to its first HASH_PREFIX_BYTES
bytes, packed into one bytes object (``pack_hash_prefixes``): 8 bytes per
block instead of a 32-byte Python object, so 20,000 cached blocks report in
160 kB. Two different blocks share a prefix with probability about n^2 / 2^65
(n blocks): a collision can only misroute a request, never change an answer
(the replica compares tokens on every cache hit).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .router import ReplicaReport, Router, make_router

logger = logging.getLogger(__name__)

HASH_PREFIX_BYTES = 8
_REMEMBERED_REQUESTS = 4096  # request ids whose choice is kept, so Ray's retries do not count twice


def pack_hash_prefixes(hashes) -> bytes:
    """The first HASH_PREFIX_BYTES bytes of each 32-byte hash, sorted and concatenated."""
    return b"".join(sorted(h[:HASH_PREFIX_BYTES] for h in hashes))


def unpack_hash_prefixes(packed: bytes) -> frozenset[bytes]:
    """The set pack_hash_prefixes packed. Raises ValueError for a length not a
    multiple of HASH_PREFIX_BYTES."""
    if len(packed) % HASH_PREFIX_BYTES:
        raise ValueError(f"packed hash prefixes must be a multiple of {HASH_PREFIX_BYTES} bytes, got {len(packed)}")
    return frozenset(packed[i:i + HASH_PREFIX_BYTES] for i in range(0, len(packed), HASH_PREFIX_BYTES))


def report_from_stats(stats: dict[str, Any]) -> ReplicaReport:
    """The ReplicaReport in a replica's routing stats (EngineReplica.record_routing_stats:
    block_hash_prefixes packed by pack_hash_prefixes); an empty one when the
    replica has not reported yet."""
    return ReplicaReport(num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
                         num_free_blocks=int(stats.get("num_free_blocks", 0)),
                         block_hashes=unpack_hash_prefixes(stats.get("block_hash_prefixes", b"")))


class PagedServeRequestRouter(RequestRouter):
    """A Router of router.py behind Ray Serve's RequestRouter interface.

    request_router_kwargs (initialize_state): policy (router.POLICIES) and, for
    "prefix", balance_abs_threshold / balance_rel_threshold.

    Ray may call choose_replicas more than once for one request (when a
    replica turns it away, or after a backoff): the first choice is kept for
    the request's id and counted once. A request Ray then sends elsewhere (to a
    lower rank) still counts where the router chose, until that replica's next
    report."""

    def initialize_state(self, policy: str = "prefix", **router_kwargs) -> None:
        self.policy = policy
        self.router: Router = make_router(policy, **router_kwargs)
        self._report_seq: dict[str, Any] = {}
        self._chosen: collections.OrderedDict[str, str] = collections.OrderedDict()

    def _sync(self) -> None:
        """Brings the router's replicas in line with Ray's: new reports in,
        replicas Ray no longer lists out."""
        live = {rid.unique_id: r for rid, r in list(self.curr_replicas.items())}
        for uid in set(self.router.replicas) - set(live):
            self.router.remove(uid)
            self._report_seq.pop(uid, None)
        for uid, replica in live.items():
            stats = replica.routing_stats or {}
            seq = stats.get("report_seq")
            if uid not in self.router.replicas or (seq is not None and seq != self._report_seq.get(uid)):
                self.router.report(uid, report_from_stats(stats))
                self._report_seq[uid] = seq

    def _choose(self, pending_request: PendingRequest | None) -> str:
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        if request_id is not None and request_id in self._chosen:
            return self._chosen[request_id]
        hashes = pending_request.kwargs.get("block_hashes", ()) if pending_request is not None else ()
        chosen = self.router.choose([h[:HASH_PREFIX_BYTES] for h in hashes])
        if request_id is not None:
            self._chosen[request_id] = chosen
            if len(self._chosen) > _REMEMBERED_REQUESTS:
                self._chosen.popitem(last=False)
        return chosen

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks: [the router's choice], [the other candidates]; all the
        candidates as one rank when the choice is not among them (busy or gone)."""
        self._sync()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        chosen = self._choose(pending_request)
        if chosen not in by_id:
            return [candidate_replicas]
        return [[by_id[chosen]], [r for r in candidate_replicas if r is not by_id[chosen]]]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.remove(replica_id.unique_id)
        self._report_seq.pop(replica_id.unique_id, None)
