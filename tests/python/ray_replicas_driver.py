"""Runs `pagedserve serve --replicas 2` (the Ray Serve application) on a model
and records what its endpoint answers, for tests/python/test_ray_replicas.py.

Run it only inside a loopback-only network namespace (Ray probes a
cloud-metadata address at start): the test starts it as
``unshare -n sh -c 'ip link set lo up; exec python ray_replicas_driver.py MODEL OUT'``.
It writes OUT (JSON): the answers to REQUESTS (test_ray_replicas.py sends the
same ones to a single server), the replica of each of four requests sharing a
prefix, each replica's prefix-cache hits, the KV-cache events each replica
rank published meanwhile (--kv-events-endpoint: replica i at port + i) and its
replay from sequence 0, and a replica killed during a stream: how the stream
ended, whether later requests succeeded, whether Serve started a replacement
(publishing at the dead one's ports), and the survivors' KV usage once idle.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx

PORT = 8000
BASE = f"http://127.0.0.1:{PORT}"
# --kv-events-endpoint and its replay endpoint: replica i binds each port + i
KV_EVENTS_PORT, KV_REPLAY_PORT = 5557, 5567

# (name, path, body): answered by the replicas here and by one server in the test
REQUESTS = [
    ("completion", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}),
    ("completion_stream", "/v1/completions",
     {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True}),
    ("chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0}),
    ("chat_stream", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 12, "temperature": 0,
      "stream": True}),
    ("anthropic_messages", "/v1/messages",
     {"model": "MODEL", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
      "temperature": 0}),
    ("bad_request", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("unknown_model", "/v1/chat/completions",
     {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
]
# two prefixes of ~240 tokens (several full blocks each), asked in turn
PREFIXES = {name: " ".join(f"{name}{i}" for i in range(120)) for name in ("alpha", "beta")}


def answer(client: httpx.Client, base: str, path: str, body: dict, model: str = "") -> dict:
    """{status, body (JSON) or events (the data of each server-sent event), replica};
    a body's "model": "MODEL" becomes model."""
    if body.get("model") == "MODEL":
        body = {**body, "model": model}
    r = client.post(base + path, json=body)
    out = {"status": r.status_code, "replica": r.headers.get("x-pagedserve-replica")}
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        out["events"] = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    else:
        out["body"] = r.json()
    return out


def replica_samples(client: httpx.Client, metric: str, **labels: str) -> dict[str, float]:
    """{replica id: value} of one metric in the ingress's /metrics (of the
    samples that carry these labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(client.get(BASE + "/metrics").text):
        for s in family.samples:
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()):
                values[s.labels["replica"]] = s.value
    return values


def disconnect_during_stream(client: httpx.Client) -> dict:
    """Closes a long stream after its first events; then how long until no
    replica runs a request and none holds a KV block."""
    body = {"prompt": "Tell another long story.", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    aborted_before = sum(replica_samples(client, "vllm:request_success_total", finished_reason="abort").values())
    with client.stream("POST", BASE + "/v1/completions", json=body) as r:
        replica = r.headers.get("x-pagedserve-replica")
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection
    start = time.monotonic()
    running = usage = None
    while time.monotonic() - start < 30:
        running = replica_samples(client, "vllm:num_requests_running")
        usage = replica_samples(client, "vllm:kv_cache_usage_perc")
        if sum(running.values()) == 0 and sum(usage.values()) == 0:
            break
        time.sleep(0.2)
    aborted = sum(replica_samples(client, "vllm:request_success_total", finished_reason="abort").values())
    return {"replica": replica, "seconds_until_idle": time.monotonic() - start, "running": running,
            "kv_usage": usage, "aborted": aborted - aborted_before}


def subscribe_kv_events(ctx) -> list:
    """One ZeroMQ SUB socket per replica rank (0, 1), subscribed to everything."""
    import zmq

    subs = []
    for rank in range(2):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{KV_EVENTS_PORT + rank}")
        subs.append(sub)
    time.sleep(1.0)  # ZeroMQ's slow joiner: the subscriptions reach the publishers before any event
    return subs


def read_kv_events(subs) -> list[dict]:
    """What each SUB socket received (until 2 s of quiet): the sequence
    numbers and the event types."""
    import msgpack
    import zmq

    seen = []
    for sub in subs:
        seqs, types = [], set()
        while sub.poll(2000, zmq.POLLIN):
            _topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            types.update(event[0] for event in msgpack.unpackb(payload)[1])
        seen.append({"seqs": seqs, "types": sorted(types)})
    return seen


def replay_kv_events(ctx, tokenizer) -> list:
    """Each replica rank's replay endpoint asked for every batch from sequence
    0: per rank {"batches": [(sequence, event types), ...], "stored_text": the
    text of every stored block}, or None where nothing answered within 5 s."""
    import msgpack
    import zmq

    replies = []
    for rank in range(2):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{KV_REPLAY_PORT + rank}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        reply = {"batches": [], "stored_text": []}
        while True:
            if not dealer.poll(5000, zmq.POLLIN):
                reply = None
                break
            _empty, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            events = msgpack.unpackb(payload)[1]
            reply["batches"].append((int.from_bytes(seq, "big"), [e[0] for e in events]))
            # BlockStored: [type, hashes, parent, token_ids, block_size, lora, medium]
            reply["stored_text"] += [tokenizer.decode(e[3]) for e in events if e[0] == "BlockStored"]
        dealer.close(0)
        replies.append(reply)
    return replies


def kill_during_stream(client: httpx.Client, ray) -> dict:
    """Kills the replica serving a long stream after its first events."""
    body = {"prompt": "Tell a long story.", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events, killed, done = [], None, False
    start = time.monotonic()
    with client.stream("POST", BASE + "/v1/completions", json=body) as r:
        killed = r.headers.get("x-pagedserve-replica")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            if len(events) >= 3 and not done:
                done = True
                names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if killed in a["name"]]
                if not names:
                    raise RuntimeError(f"no actor for replica {killed}: {ray.util.list_named_actors(all_namespaces=True)}")
                ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    seconds = time.monotonic() - start
    after = [answer(client, BASE, "/v1/completions",
                    {"prompt": f"Question {i}", "max_tokens": 4, "temperature": 0}) for i in range(4)]
    return {"killed": killed, "events": events[-3:], "num_events": len(events), "seconds": seconds,
            "after": [{"status": a["status"], "replica": a["replica"]} for a in after]}


def main(model: str, out_path: str) -> None:
    import ray
    import zmq
    from ray import serve
    from transformers import AutoTokenizer

    from pagedserve.scaleout.ray_app import build_app
    from pagedserve.server.__main__ import build_parser

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = build_parser().parse_args([model, "--replicas", "2", "--routing", "prefix", "--dtype", "float32",
                                      "--max-model-len", "2048", "--log-level", "warning",
                                      "--kv-events-endpoint", f"tcp://127.0.0.1:{KV_EVENTS_PORT}",
                                      "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{KV_REPLAY_PORT}"])
    serve.run(build_app(args), name="pagedserve", route_prefix="/")
    result: dict = {}
    with httpx.Client(timeout=120) as client:
        for _ in range(60):  # both replicas known to the ingress's router
            if len(replica_samples(client, "vllm:kv_cache_usage_perc")) == 2:
                break
            time.sleep(0.5)
        result["answers"] = {name: answer(client, BASE, path, body, model) for name, path, body in REQUESTS}
        kv_ctx = zmq.Context()
        subs = subscribe_kv_events(kv_ctx)
        result["prefix_replicas"] = {name: [] for name in PREFIXES}
        for i in range(3):
            for name, prefix in PREFIXES.items():
                a = answer(client, BASE, "/v1/completions",
                           {"prompt": prefix + f" question {i}?", "max_tokens": 2, "temperature": 0})
                result["prefix_replicas"][name].append(a["replica"])
        tokenizer = AutoTokenizer.from_pretrained(model)
        result["kv_events"] = read_kv_events(subs)
        result["kv_replay"] = replay_kv_events(kv_ctx, tokenizer)
        result["prefix_cache_hits"] = replica_samples(client, "vllm:prefix_cache_hits_total")
        result["replicas_in_metrics"] = sorted(replica_samples(client, "vllm:kv_cache_usage_perc"))
        result["disconnect"] = disconnect_during_stream(client)
        result["kill"] = kill_during_stream(client, ray)
        restarted = False
        for _ in range(120):
            states = serve.status().applications["pagedserve"].deployments["EngineReplica"].replica_states
            if states.get("RUNNING", 0) == 2:
                restarted = True
                break
            time.sleep(0.5)
        result["kill"]["restarted"] = restarted
        for _ in range(60):  # the ingress's router learns of the new replica
            if len(replica_samples(client, "vllm:kv_cache_usage_perc")) == 2:
                break
            time.sleep(0.5)
        result["kill"]["replicas_in_metrics_after"] = sorted(replica_samples(client, "vllm:kv_cache_usage_perc"))
        result["kill"]["kv_usage_after"] = replica_samples(client, "vllm:kv_cache_usage_perc")
        result["kill"]["kv_replay_after"] = replay_kv_events(kv_ctx, tokenizer)  # the replacement: its rank's ports
        for sub in subs:
            sub.close(0)
        kv_ctx.term()
    serve.shutdown()
    ray.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main(sys.argv[1], sys.argv[2])
