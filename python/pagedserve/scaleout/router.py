"""Request routing across PagedServe replicas: which replica serves a request.

Three policies behind one interface (``Router``): ``prefix`` (the default:
prefix-cache affinity with a load guard), ``round-robin`` and
``least-loaded``. A router knows each replica by what the replica last
reported (``ReplicaReport``: its load and the block hashes its prefix cache
holds) plus what the router itself sent there since; it never asks. The
request side is the prompt's chained block hashes (``prompt_block_hashes``:
the engine's own hash, ``_core.hash_block``, so router and engine cannot
disagree on a prefix and differently salted requests never match).

``PrefixAffinityRouter`` follows SGLang's cache-aware router (our own code):
while the load is balanced, the replica holding the longest cached prefix of
the request wins (ties: the lower load); a request no replica holds any of
goes to the replica with the fewest cached blocks and, among those, the lowest
load, so new prefixes spread. The load guard switches to the least-loaded
replica when the busiest and the idlest differ by more than
``balance_abs_threshold`` requests AND the busiest carries more than
``balance_rel_threshold`` times the idlest's load (SGLang's two conditions;
its defaults 64 and 1.5 are ours too). Load is running + waiting requests at
the last report plus the requests routed there since.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

POLICIES = ("prefix", "round-robin", "least-loaded")
# what `pagedserve serve --routing` takes: these, or Ray Serve's own router (scaleout/ray_app.py)
ROUTING_POLICIES = POLICIES + ("ray-default",)
BALANCE_ABS_THRESHOLD = 64  # SGLang's defaults for the load guard
BALANCE_REL_THRESHOLD = 1.5


def prompt_block_hashes(token_ids: Sequence[int], block_size: int = 16, cache_salt: str = "") -> list[bytes]:
    """The chained 32-byte hashes of the prompt's full blocks, as the engine's
    prefix cache computes them (``_core.hash_block``; docs/kv-events.md): block
    i covers tokens [i * block_size, (i + 1) * block_size). A trailing partial
    block has none. Raises ValueError for block_size < 1."""
    from .. import _core

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = _core.hash_block(parent, list(token_ids[i * block_size:(i + 1) * block_size]), cache_salt)
        hashes.append(parent)
    return hashes


@dataclass
class ReplicaReport:
    """What a replica says about itself.

    Attributes:
        num_running: sequences running (requests being decoded or prefilled).
        num_waiting: requests queued for admission.
        num_free_blocks: KV blocks it can still hand out (free + evictable).
        block_hashes: the hashes of the full blocks its prefix cache holds.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    block_hashes: frozenset[bytes] = frozenset()


@dataclass
class _Replica:
    report: ReplicaReport
    routed: int = 0  # requests sent here since the report
    recent: set[bytes] = field(default_factory=set)  # hashes of those requests (cached there soon)

    @property
    def load(self) -> int:
        return self.report.num_running + self.report.num_waiting + self.routed

    def holds(self, h: bytes) -> bool:
        return h in self.report.block_hashes or h in self.recent


class Router:
    """The interface: ``report`` (a replica's state; the first report adds the
    replica), ``remove`` (a replica died or restarted: everything known of it
    is dropped) and ``choose`` (the replica for a request, which the router
    then counts as routed there)."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}

    @property
    def replicas(self) -> list[str]:
        """The replica ids the router knows, sorted."""
        return sorted(self._replicas)

    def load(self, replica_id: str) -> int:
        """Running + waiting at the last report + routed since. Raises KeyError."""
        return self._replicas[replica_id].load

    def report(self, replica_id: str, report: ReplicaReport) -> None:
        """Replaces what the router knows of replica_id with report (the
        requests and hashes routed there before it are part of it now)."""
        self._replicas[replica_id] = _Replica(report)

    def remove(self, replica_id: str) -> None:
        """Forgets replica_id (no-op when unknown)."""
        self._replicas.pop(replica_id, None)

    def choose(self, block_hashes: Sequence[bytes] = ()) -> str:
        """The replica for a request whose prompt has these block hashes
        (prompt_block_hashes). Raises LookupError when no replica is known."""
        if not self._replicas:
            raise LookupError("no replica to route to")
        rid = self._pick(block_hashes)
        r = self._replicas[rid]
        r.routed += 1
        r.recent.update(block_hashes)
        return rid

    def _pick(self, block_hashes: Sequence[bytes]) -> str:
        raise NotImplementedError

    def _least_loaded(self, candidates: Iterable[str]) -> str:
        return min(candidates, key=lambda rid: (self._replicas[rid].load, rid))


class RoundRobinRouter(Router):
    """Each known replica in turn (sorted by id), whatever the request."""

    def __init__(self) -> None:
        super().__init__()
        self._turn = itertools.count()

    def _pick(self, block_hashes: Sequence[bytes]) -> str:
        ids = self.replicas
        return ids[next(self._turn) % len(ids)]


class LeastLoadedRouter(Router):
    """The replica with the lowest load (ties: the lowest id)."""

    def _pick(self, block_hashes: Sequence[bytes]) -> str:
        return self._least_loaded(self._replicas)


class PrefixAffinityRouter(Router):
    """Prefix-cache affinity under a load guard (the module docstring).

    balance_abs_threshold: requests by which the busiest replica's load must
    exceed the idlest's for the guard to act; balance_rel_threshold: and the
    factor (> 1) by which it must. Raises ValueError for thresholds out of range."""

    def __init__(self, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> None:
        super().__init__()
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold <= 1.0:
            raise ValueError(f"balance_rel_threshold must be > 1, got {balance_rel_threshold}")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def imbalanced(self) -> bool:
        """Whether the load guard acts now (both of SGLang's conditions)."""
        loads = [r.load for r in self._replicas.values()]
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest

    def matched_blocks(self, replica_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the request replica_id holds (or was sent). Raises KeyError."""
        r = self._replicas[replica_id]
        n = 0
        for h in block_hashes:
            if not r.holds(h):
                break
            n += 1
        return n

    def _pick(self, block_hashes: Sequence[bytes]) -> str:
        if self.imbalanced():
            return self._least_loaded(self._replicas)
        matched = {rid: self.matched_blocks(rid, block_hashes) for rid in self._replicas}
        best = max(matched.values())
        if best > 0:
            return self._least_loaded(rid for rid, m in matched.items() if m == best)
        # a full miss: spread new prefixes to the replica holding the least, then the least loaded
        return min(self._replicas, key=lambda rid: (len(self._replicas[rid].report.block_hashes)
                                                   + len(self._replicas[rid].recent),
                                                   self._replicas[rid].load, rid))


def make_router(policy: str = "prefix", **kwargs) -> Router:
    """The router of a policy in POLICIES (kwargs: PrefixAffinityRouter's
    thresholds, for "prefix"). Raises ValueError for another name."""
    if policy == "prefix":
        return PrefixAffinityRouter(**kwargs)
    if kwargs:
        raise ValueError(f"the {policy} policy takes no options, got {sorted(kwargs)}")
    if policy == "round-robin":
        return RoundRobinRouter()
    if policy == "least-loaded":
        return LeastLoadedRouter()
    raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
