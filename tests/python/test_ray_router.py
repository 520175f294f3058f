"""PagedServeRequestRouter (scaleout/ray_router.py): our router behind Ray
Serve's RequestRouter interface, driven with fake replicas (no Ray cluster):
reports taken once per report_seq, affinity on packed hash prefixes, a
request Ray routes twice counted once, replicas Ray drops or reports dead
forgotten; and the ingress's block hashes against the token ids the server
itself builds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pagedserve[ray]')")

from pagedserve.scaleout.ray_router import (  # noqa: E402
    PagedServeRequestRouter,
    pack_hash_prefixes,
    report_from_stats,
    unpack_hash_prefixes,
)
from pagedserve.scaleout.router import prompt_block_hashes  # noqa: E402


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


@dataclass
class FakeReplica:
    replica_id: FakeReplicaID
    routing_stats: dict = field(default_factory=dict)


@dataclass
class FakeMetadata:
    internal_request_id: str | None = None


@dataclass
class FakePending:
    kwargs: dict
    metadata: FakeMetadata = field(default_factory=FakeMetadata)


def make_router(*ids: str) -> tuple[PagedServeRequestRouter, dict[str, FakeReplica]]:
    """A router over fake replicas, without RequestRouter.__init__ (which needs a
    running Serve): only what choose_replicas and on_replica_actor_died read."""
    router = PagedServeRequestRouter.__new__(PagedServeRequestRouter)
    replicas = {i: FakeReplica(FakeReplicaID(i)) for i in ids}
    router._replicas = {r.replica_id: r for r in replicas.values()}
    router._replicas_list = list(replicas.values())
    router._replica_id_set = set(router._replicas)
    router._queue_len_gauge_last_update = {}
    router.initialize_state(policy="prefix")
    return router, replicas


def choose(router, replicas, hashes=(), request_id=None) -> list[list[str]]:
    ranks = asyncio.run(router.choose_replicas(list(replicas.values()),
                                               FakePending({"block_hashes": hashes}, FakeMetadata(request_id))))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


TENANT_A = prompt_block_hashes(list(range(64)), 16)
TENANT_B = prompt_block_hashes(list(range(1000, 1064)), 16)


def test_the_replica_reporting_the_prefix_ranks_first():
    router, replicas = make_router("r0", "r1")
    replicas["r1"].routing_stats = {"report_seq": 1, "num_running": 3,
                                    "block_hash_prefixes": pack_hash_prefixes(TENANT_A[:3])}
    assert choose(router, replicas, TENANT_A) == [["r1"], ["r0"]]
    assert choose(router, replicas, TENANT_B)[0] == ["r0"]  # a miss goes where less is cached


def test_a_report_is_taken_once_per_report_seq():
    router, replicas = make_router("r0", "r1")
    replicas["r0"].routing_stats = {"report_seq": 7, "block_hash_prefixes": pack_hash_prefixes(TENANT_A)}
    choose(router, replicas, TENANT_A)
    assert router.router.load("r0") == 1  # routed since the report
    choose(router, replicas, TENANT_A)
    assert router.router.load("r0") == 2  # the same report was not taken again (it would reset the count)
    replicas["r0"].routing_stats = {"report_seq": 8, "num_running": 1,
                                    "block_hash_prefixes": pack_hash_prefixes(TENANT_A)}
    choose(router, replicas, TENANT_B)
    assert router.router.load("r0") == 1  # the new report replaced what the router counted


def test_a_request_ray_routes_twice_counts_once():
    """Ray calls choose_replicas again for a request a replica turned away: the
    same choice, counted once."""
    router, replicas = make_router("r0", "r1")
    first = choose(router, replicas, TENANT_A, request_id="req-1")
    assert choose(router, replicas, TENANT_A, request_id="req-1") == first
    assert router.router.load(first[0][0]) == 1
    assert choose(router, replicas, TENANT_A, request_id="req-2")[0] == first[0]  # affinity: it holds A now
    assert router.router.load(first[0][0]) == 2


def test_replicas_dropped_or_dead_are_forgotten():
    router, replicas = make_router("r0", "r1", "r2")
    replicas["r2"].routing_stats = {"report_seq": 1, "block_hash_prefixes": pack_hash_prefixes(TENANT_A)}
    choose(router, replicas, TENANT_A)
    assert router.router.replicas == ["r0", "r1", "r2"]
    router.on_replica_actor_died(FakeReplicaID("r2"))
    assert router.router.replicas == ["r0", "r1"]
    del replicas["r2"]
    router._replicas.pop(FakeReplicaID("r1"))  # Ray no longer lists r1
    assert choose(router, replicas, TENANT_A)[0] == ["r0"]
    assert router.router.replicas == ["r0"]


def test_hash_prefixes_pack_and_unpack():
    packed = pack_hash_prefixes(TENANT_A + TENANT_B)
    assert len(packed) == 8 * 8 and unpack_hash_prefixes(packed) == {h[:8] for h in TENANT_A + TENANT_B}
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_hash_prefixes(b"123")


def test_report_from_stats_reads_an_empty_report():
    report = report_from_stats({})
    assert (report.num_running, report.num_waiting, report.num_free_blocks, report.block_hashes) == (0, 0, 0,
                                                                                                       frozenset())


def test_the_ingress_hashes_the_tokens_the_server_serves(server):
    """The ingress's block hashes (ray_app.Ingress.block_hashes: its own
    tokenization, and the server's ChatRenderer for chats) equal the hashes of the token ids the
    server itself builds for the same request (/tokenize), salts included:
    otherwise the router would chase prefixes no replica caches."""
    import json

    import httpx

    from pagedserve.scaleout.ray_app import Ingress
    from pagedserve.server.__main__ import build_parser

    ingress = Ingress(None, build_parser().parse_args([]))
    messages = [{"role": "system", "content": "You answer in one word. " * 12}, {"role": "user", "content": "Hi"}]
    # content as parts: the server joins them (ChatMessage.template_dict) before the template sees them
    parts = [{**messages[0], "content": [{"type": "text", "text": "You answer "},
                                         {"type": "text", "text": "in one word. " * 12}]}, messages[1]]
    prompt = "paged attention " * 30
    for path, body, tokenize in (("/v1/chat/completions", {"messages": messages}, {"messages": messages}),
                                 ("/v1/chat/completions", {"messages": parts}, {"messages": parts}),
                                 ("/v1/completions", {"prompt": prompt}, {"prompt": prompt})):
        ids = httpx.post(server + "/tokenize", json=tokenize, timeout=60).json()["tokens"]
        hashes = ingress.block_hashes(path, json.dumps(body).encode())
        assert len(hashes) >= 2 and hashes == prompt_block_hashes(ids, 16)
        salted = ingress.block_hashes(path, json.dumps({**body, "cache_salt": "tenant-a"}).encode())
        assert salted == prompt_block_hashes(ids, 16, "tenant-a") and salted[0] != hashes[0]
    assert ingress.block_hashes("/v1/completions", b"not json") == []  # a miss, not an error
    assert ingress.block_hashes("/v1/completions", json.dumps({"prompt": list(range(40))}).encode()) == \
        prompt_block_hashes(list(range(40)), 16)


def test_kv_events_with_replicas_need_one_free_port_per_replica():
    """check_args: --kv-events-endpoint with --replicas N binds port + i for
    replica i, so the events and replay ports must leave N ports between
    them; a replay endpoint alone, or a port that cannot be offset, is refused
    before Ray starts."""
    from pagedserve.scaleout.ray_app import check_args, replica_kv_events_args
    from pagedserve.server.__main__ import build_parser

    def args(*flags):
        return build_parser().parse_args(["some-model", "--replicas", "2", *flags])

    ok = args("--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint", "tcp://127.0.0.1:5559")
    check_args(ok)
    second = replica_kv_events_args(ok, 1)
    assert (second.kv_events_endpoint, second.kv_events_replay_endpoint) == ("tcp://127.0.0.1:5558",
                                                                             "tcp://127.0.0.1:5560")
    assert ok.kv_events_endpoint == "tcp://127.0.0.1:5557"  # the caller's flags are not changed
    for flags, match in [(("--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint",
                           "tcp://127.0.0.1:5558"), "overlap"),
                         (("--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"), "needs --kv-events-endpoint"),
                         (("--kv-events-endpoint", "tcp://127.0.0.1:0"), "port number")]:
        with pytest.raises(ValueError, match=match):
            check_args(args(*flags))
    # an engine flag every replica would refuse is refused here, before Ray starts
    with pytest.raises(ValueError, match="name two linear methods"):
        check_args(args("--quantization", "q4", "--linear-impl", "torch"))
