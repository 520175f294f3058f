"""KV-cache events (--kv-events-endpoint, engine/kv_events.py, docs/kv-events.md):
the block hash a router can compute itself, and a subscriber written from the
documented wire format (zmq + msgpack only) that sees the engine's events:
BlockStored for a prompt's full blocks, BlockRemoved on eviction, gapless
sequence numbers, and a replay of what it missed."""

from __future__ import annotations

import hashlib
import struct
import time

import msgpack
import pytest
import zmq

from pagedserve import LLM, SamplingParams, _core

PINNED = ("5d553336f3c34e3bca69563207eca2b59250b964d8840a2c19adcf0392ead861",  # tests/cpp/test_prefix_cache.cc
          "c90880cbb1459630967077500707b3ba9bfb1d852ea4c086771a9f5f512849b2")


def block_hash(parent: bytes | None, token_ids: list[int], salt: str = "") -> bytes:
    """The documented block hash, from hashlib (not from the engine)."""
    salt_bytes = salt.encode()
    m = hashlib.sha256(b"\x01" + parent if parent is not None else b"\x00")
    m.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    m.update(struct.pack("<Q", len(salt_bytes)) + salt_bytes)
    return m.digest()


def chain(token_ids: list[int], block_size: int = 16, salt: str = "") -> list[bytes]:
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def test_the_block_hash_is_the_pinned_value_from_hashlib_and_from_the_engine():
    a = block_hash(None, list(range(16)))
    b = block_hash(a, list(range(16, 32)), "tenant-a")
    assert (a.hex(), b.hex()) == PINNED
    assert _core.hash_block(None, list(range(16))) == a
    assert _core.hash_block(a, list(range(16, 32)), "tenant-a") == b
    assert _core.hash_block(a, list(range(16, 32)), "tenant-b") != b  # salts never share a hash
    with pytest.raises(ValueError):
        _core.hash_block(b"short", [1])


def _receive(sub, timeout_s: float = 5.0) -> list[tuple[int, list]]:
    """Every batch the subscriber can read until `timeout_s` passes without one."""
    out = []
    while sub.poll(int(timeout_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        ts, events = msgpack.unpackb(payload)
        assert abs(ts - time.time()) < 600
        out.append((int.from_bytes(seq, "big"), events))
        timeout_s = 0.5
    return out


def test_a_subscriber_sees_stored_and_removed_blocks_and_replays_what_it_missed(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8,
              kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    pub = llm.engine.kv_events
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.3)  # a SUB socket sees only what is sent after it has joined: batch 0 is missed here
    try:
        greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        a = list(range(10, 50))  # 40 tokens: 2 full blocks of 16
        llm.generate([a], greedy)
        live = _receive(sub)
        assert [s for s, _ in live] == [1]
        (stored,) = live[0][1]
        assert stored == ["BlockStored", chain(a), None, a[:32], 16, None, None]
        # two 64-token prompts fill the 8-block pool: a's cached blocks are evicted
        b, c = list(range(100, 164)), list(range(200, 264))
        llm.generate([b], greedy)
        llm.generate([c], greedy)
        later = _receive(sub)
        assert [s for s, _ in later] == list(range(2, 2 + len(later)))  # gapless
        events = [e for _, batch in later for e in batch]
        removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
        assert set(chain(a)) <= set(removed)
        stored_b = [e for e in events if e[0] == "BlockStored" and e[3][:16] == b[:16]]
        assert stored_b and stored_b[0][1][0] == chain(b)[0] and stored_b[0][2] is None
        # the subscriber missed batch 0: the replay socket sends it and everything after, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            delimiter, seq, payload = dealer.recv_multipart()
            assert delimiter == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
        assert [s for s, _ in replayed] == list(range(0, 2 + len(later)))
        assert replayed[0][1] == [["AllBlocksCleared"]]
        assert replayed[1:] == live + later
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_an_endpoint_that_cannot_be_bound_is_a_value_error_naming_the_flag():
    from pagedserve.engine.kv_events import KVEventPublisher

    first = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            KVEventPublisher(first.endpoint)  # in use
        with pytest.raises(ValueError, match="--kv-events-replay-endpoint"):
            KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=first.endpoint)
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            KVEventPublisher("not-an-endpoint")
    finally:
        first.close()


def test_a_replay_of_every_buffered_batch_reaches_a_slow_reader_and_a_req_client_reads_it_too():
    from pagedserve.engine.kv_events import END_OF_REPLAY, KVEventPublisher

    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")  # buffers 10,000 batches
    ctx = zmq.Context()
    try:
        from types import SimpleNamespace

        # BlockStored batches of ~700 bytes (8 blocks of 16 tokens), more than the buffer holds (the first
        # 1,000 are gone): 7 MB of reply, beyond what ZeroMQ's default high-water mark (1,000 messages) and
        # loopback's socket buffers hold for a reader that waits (without sndhwm=0 about 8,500 arrive)
        stored = SimpleNamespace(type="BlockStored", block_hashes=[bytes(32)] * 8, parent_block_hash=None,
                                 token_ids=list(range(128)), block_size=16)
        for _ in range(11_000):
            pub.publish([stored])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        time.sleep(1.0)  # a slow reader: the whole reply waits in the queues
        seqs = []
        while True:
            assert dealer.poll(5000), "the replay stopped before its end marker"
            _, seq, _payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(1000, 11_000))
        dealer.close(0)
        req = ctx.socket(zmq.REQ)  # a REQ client (as vLLM's example subscriber) gets the first message
        req.connect(pub.replay_endpoint)
        req.send((10_999).to_bytes(8, "big"))
        assert req.poll(5000)
        seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 10_999 and msgpack.unpackb(payload)[1][0][0] == "BlockStored"
        req.close(0)
    finally:
        ctx.term()
        pub.close()


def test_the_replay_endpoint_needs_the_events_endpoint():
    from pagedserve.config import EngineArgs

    with pytest.raises(ValueError, match="kv_events_endpoint"):
        EngineArgs(kv_events_replay_endpoint="tcp://127.0.0.1:5558")


def test_each_replica_rank_gets_its_own_endpoint():
    """`serve --replicas N` offsets the endpoints by the replica's rank
    (offset_endpoint): a TCP port + rank, ipc/inproc names suffixed; what
    cannot be offset is a ValueError."""
    from pagedserve.engine.kv_events import offset_endpoint

    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv-2"
    assert offset_endpoint("inproc://kv", 0) == "inproc://kv"
    for endpoint, rank in [("tcp://127.0.0.1:*", 1), ("tcp://127.0.0.1:0", 1), ("tcp://127.0.0.1", 1),
                           ("tcp://127.0.0.1:65535", 1), ("udp://127.0.0.1:5557", 0), ("5557", 0),
                           ("tcp://127.0.0.1:5557", -1)]:
        with pytest.raises(ValueError):
            offset_endpoint(endpoint, rank)
