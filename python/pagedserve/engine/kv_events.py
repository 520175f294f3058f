"""KV-cache events (--kv-events-endpoint): which prefixes this engine's KV
cache holds, published for routers outside the engine, in vLLM's event schema
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``: the one llm-d's
scheduler, NVIDIA Dynamo's KV router and SGLang's gateway read).

The C++ KV cache records the events (csrc/core/kv_events.h); the engine takes
them after each step (``Scheduler.take_kv_events``) and publishes one batch
per step that has any. Wire format (docs/kv-events.md):

- a ZeroMQ PUB socket bound at the endpoint sends each batch as three frames:
  the topic (bytes, default empty), the batch's sequence number (8 bytes,
  big-endian unsigned; 0 for the first batch, gapless) and the payload;
- the payload is msgpack: ``[ts, [event, ...]]`` with ``ts`` the wall-clock
  time in seconds (float) and each event an array whose first element is its
  type: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``; hashes are the prefix cache's 32-byte chained
  SHA-256 (``_core.hash_block``), ``parent_block_hash`` None for a prompt's
  first block, ``lora_id`` and ``medium`` None (no adapters, GPU/CPU tiers);
- the first batch (sequence 0) is ``[AllBlocksCleared]``: a subscriber that
  sees it knows the engine (re)started with an empty cache;
- a ROUTER socket at the replay endpoint (optional) answers a request whose
  last frame is the first sequence number wanted (8 bytes, big-endian) with
  one message ``[b"", sequence, payload]`` per buffered batch from that
  number on (the last ``buffer_batches`` batches), then ``[b"", -1 as 8
  signed big-endian bytes, b""]`` to end the reply (the empty first frame is
  the delimiter REQ-style clients expect; a DEALER reads the three frames as
  they are). A subscriber that notices a gap asks for the missing batches
  there. The replay socket queues a whole reply (no high-water mark): 10,000
  buffered batches reach a client that reads slowly.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def encode_event(event) -> list:
    """One ``_core.KVCacheEvent`` as the msgpack array of its vLLM type
    (module docstring). Raises ValueError for an unknown type."""
    if event.type == "BlockStored":
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, None, None]
    if event.type == "BlockRemoved":
        return ["BlockRemoved", list(event.block_hashes), None]
    if event.type == "AllBlocksCleared":
        return ["AllBlocksCleared"]
    raise ValueError(f"unknown KV event type {event.type!r}")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint replica `rank` of `pagedserve serve --replicas N` binds for
    a configured endpoint (vLLM offsets its data-parallel ranks' publishers the
    same way): ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT+rank``; ``ipc://PATH``
    and ``inproc://NAME`` get ``-rank`` appended. Rank 0 keeps the endpoint.
    Raises ValueError for rank < 0, another transport, a TCP endpoint without a
    numeric port (a wildcard port cannot be offset), or a port past 65535."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    transport, sep, address = endpoint.partition("://")
    if not sep or transport not in ("tcp", "ipc", "inproc") or not address:
        raise ValueError(f"{endpoint!r}: not a tcp://, ipc:// or inproc:// ZeroMQ endpoint")
    if transport != "tcp":
        return endpoint if rank == 0 else f"{endpoint}-{rank}"
    host, colon, port = address.rpartition(":")
    if not colon or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        raise ValueError(f"{endpoint!r}: one endpoint per replica needs a TCP port number (1-65535), got {port!r}")
    if int(port) + rank > 65535:
        raise ValueError(f"{endpoint!r}: replica {rank} would bind port {int(port) + rank}, past 65535")
    return f"tcp://{host}:{int(port) + rank}"


class KVEventPublisher:
    """Publishes KV-cache event batches on a ZeroMQ PUB socket and serves
    replays of the last ``buffer_batches`` batches on a ROUTER socket (a
    background thread). Sequence numbers count batches from 0, gapless.

    Raises ValueError when an endpoint cannot be bound (in use, malformed)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000) -> None:
        import msgpack
        import zmq

        self._packb = msgpack.packb
        self._ctx = zmq.Context()
        self._pub = None
        try:  # a bind that fails leaves no socket or context behind
            self._pub = self._bind(zmq.PUB, endpoint, "--kv-events-endpoint")
            replay = (self._bind(zmq.ROUTER, replay_endpoint, "--kv-events-replay-endpoint", sndhwm=0)
                      if replay_endpoint is not None else None)
        except ValueError:
            if self._pub is not None:
                self._pub.close(0)
            self._ctx.term()
            raise
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # tcp://127.0.0.1:0 resolved
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._lock = threading.Lock()  # the buffer, shared with the replay thread
        self._stop = threading.Event()
        self._thread = None
        self.replay_endpoint = None
        if replay is not None:
            self.replay_endpoint = replay.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve_replay, args=(replay,), name="kv-events-replay",
                                            daemon=True)
            self._thread.start()

    def _bind(self, kind: int, endpoint: str, flag: str, sndhwm: int | None = None):
        """A socket of `kind` bound at endpoint (sndhwm: its send high-water
        mark, 0 = unlimited; ZeroMQ's default 1,000 otherwise); ValueError
        naming the flag when it cannot be bound (in use, malformed), its own
        socket closed (the caller cleans up the rest)."""
        import zmq

        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            raise ValueError(f"{flag} {endpoint!r}: cannot bind there ({e})") from e
        return sock

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (= batches sent so far)."""
        return self._seq

    def publish_cleared(self) -> None:
        """Sends ``[AllBlocksCleared]`` (the engine's first batch: its cache is empty)."""
        self._send([["AllBlocksCleared"]])

    def publish(self, events) -> None:
        """Sends one batch of ``_core.KVCacheEvent``s (nothing for an empty list)."""
        if events:
            self._send([encode_event(e) for e in events])

    def _send(self, encoded: list) -> None:
        payload = self._packb([time.time(), encoded], use_bin_type=True)
        seq = self._seq
        with self._lock:
            self._buffer.append((seq, payload))
        self._seq += 1
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self, sock) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart()
                client, request = frames[0], frames[-1]
                if len(request) != 8:
                    logger.warning("KV events replay: a request of %d bytes (want 8): ignored", len(request))
                    continue
                start = int.from_bytes(request, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in batches:
                    sock.send_multipart([client, b"", s.to_bytes(8, "big"), p])
                sock.send_multipart([client, b"", END_OF_REPLAY, b""])
        finally:
            sock.close(0)

    def close(self) -> None:
        """Stops the replay thread and closes the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(0)
        self._ctx.term()
