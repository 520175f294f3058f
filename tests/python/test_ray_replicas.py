"""`pagedserve serve --replicas 2` under Ray Serve (scaleout/ray_app.py), two
tiny-model replicas: the same answers as one server (completions and chat,
streamed and not, errors), prefix affinity, /metrics with a replica label, and
a replica killed during a stream (a clean error event, later requests served by
the survivor, Serve's replacement joining the router, no KV blocks left held).

Ray probes a cloud-metadata address when it starts, so the Ray side runs in a
loopback-only network namespace (`unshare -n`): ray_replicas_driver.py does the
requests there and writes what it saw; this test compares that with one
server outside. Skips when Ray is not installed or the namespace cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import make_tiny_chat_model
from ray_replicas_driver import PREFIXES

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pagedserve[ray]')")

HERE = Path(__file__).parent


def _can_unshare() -> str | None:
    """None when a loopback-only network namespace can be made, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot make a network namespace: {r.stderr.strip()[:200]}"


@pytest.fixture(scope="module")
def tiny_model(smollm2_dir, tmp_path_factory):
    return make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("ray_tiny_chat"), 2048)


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory):
    """What ray_replicas_driver.py saw of two replicas (its JSON)."""
    why = _can_unshare()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("ray") / "out.json"
    cmd = f"ip link set lo up && exec {sys.executable} {HERE / 'ray_replicas_driver.py'} {tiny_model} {out}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run(["unshare", "-n", "sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tiny_model):
    """The same requests answered by one `python -m pagedserve.server`."""
    from ray_replicas_driver import REQUESTS, answer
    from serverlib import start_server, stop_server

    proc, base = start_server("--model", tiny_model, "--dtype", "float32", "--max-model-len", "2048",
                              "--log-level", "warning")
    try:
        with httpx.Client(timeout=120) as client:
            yield {name: answer(client, base, path, body, tiny_model) for name, path, body in REQUESTS}
    finally:
        stop_server(proc)


def _text(answer: dict) -> str:
    """The generated text of a completion or chat answer, streamed or not."""
    if "body" in answer and "content" in answer["body"]:  # Anthropic's Messages API
        return "".join(part.get("text", "") for part in answer["body"]["content"])
    if "body" in answer:
        choice = answer["body"]["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    text = ""
    for data in answer["events"]:
        if data == "[DONE]":
            continue
        choice = json.loads(data)["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


@pytest.mark.parametrize("name", ["completion", "completion_stream", "chat", "chat_stream", "anthropic_messages"])
def test_replicas_answer_as_one_server(replicas, single, name):
    mine, ref = replicas["answers"][name], single[name]
    assert mine["status"] == ref["status"] == 200
    assert mine["replica"]  # the header names the replica that answered
    assert _text(mine) == _text(ref) and _text(ref)
    if "events" in ref:
        assert mine["events"][-1] == "[DONE]"
        assert len(mine["events"]) == len(ref["events"])


@pytest.mark.parametrize("name", ["bad_request", "unknown_model"])
def test_replicas_answer_errors_as_one_server(replicas, single, name):
    mine, ref = replicas["answers"][name], single[name]
    assert mine["status"] == ref["status"] >= 400
    assert mine["body"]["error"]["type"] == ref["body"]["error"]["type"]
    assert mine["body"]["error"]["param"] == ref["body"]["error"]["param"]


def test_each_prefix_stays_on_its_own_replica(replicas):
    """Two ~240-token prefixes asked in turn, three times each: the prefix
    router spreads the two new prefixes over the two replicas, then keeps each
    on its own, whose cache serves it twice more."""
    chosen = replicas["prefix_replicas"]
    assert len(set(chosen["alpha"])) == 1 and len(set(chosen["beta"])) == 1, chosen
    assert chosen["alpha"][0] != chosen["beta"][0]
    for name in chosen:
        assert replicas["prefix_cache_hits"][chosen[name][0]] >= 2 * 208  # >= 13 of its blocks, twice


def test_each_replica_publishes_its_own_kv_events_at_its_rank_port(replicas):
    """--kv-events-endpoint with --replicas 2: replica i publishes at port + i.
    Each prefix's blocks are announced by exactly one rank (its replay from
    sequence 0, which starts with AllBlocksCleared), a different one for the
    two prefixes (the prefix router put them on different replicas); what a
    subscriber read live meanwhile is gapless and is in the replay. After a
    replica is killed its replacement publishes at the same rank's ports,
    starting again at sequence 0."""
    live, replay = replicas["kv_events"], replicas["kv_replay"]
    assert all(r is not None for r in replay)
    ranks = {name: [rank for rank, r in enumerate(replay) if any(name in text for text in r["stored_text"])]
             for name in PREFIXES}
    assert all(len(r) == 1 for r in ranks.values()), ranks
    assert ranks["alpha"] != ranks["beta"]
    for seen, r in zip(live, replay):
        seqs = [seq for seq, _ in r["batches"]]
        assert r["batches"][0] == [0, ["AllBlocksCleared"]] and seqs == list(range(len(seqs)))
        assert seen["seqs"] and seen["types"] == ["BlockStored"], seen
        assert seen["seqs"] == list(range(seen["seqs"][0], seen["seqs"][-1] + 1))
        assert set(seen["seqs"]) <= set(seqs)
    after = replicas["kill"]["kv_replay_after"]
    assert all(r is not None and r["batches"][0] == [0, ["AllBlocksCleared"]] for r in after)
    # the killed replica's rank starts again (fewer batches than it had); the survivor's does not shrink
    assert sorted(len(a["batches"]) < len(b["batches"]) for a, b in zip(after, replay)) == [False, True]


def test_metrics_carry_a_replica_label(replicas):
    assert len(replicas["replicas_in_metrics"]) == 2


def test_a_client_gone_mid_stream_frees_its_replica(replicas):
    """A client that closes a stream at the ingress: the replica aborts the
    request (it does not run on to its 1,500 tokens) and gives back its KV
    blocks within seconds."""
    gone = replicas["disconnect"]
    assert gone["aborted"] == 1
    assert gone["replica"] in gone["running"]
    assert sum(gone["running"].values()) == 0 and sum(gone["kv_usage"].values()) == 0, gone
    assert gone["seconds_until_idle"] < 10


def test_a_replica_killed_during_a_stream(replicas):
    kill = replicas["kill"]
    error = json.loads(kill["events"][-2])
    assert "error" in error and error["error"]["type"] == "server_error"  # a clean error event, then [DONE]
    assert kill["events"][-1] == "[DONE]"
    assert kill["seconds"] < 60  # no hang
    assert all(a["status"] == 200 and a["replica"] != kill["killed"] for a in kill["after"])
    assert kill["restarted"]  # Serve started a replacement ...
    after = kill["replicas_in_metrics_after"]
    assert len(after) == 2 and kill["killed"] not in after  # ... the router knows it, and forgot the dead one
    assert all(v == 0.0 for v in kill["kv_usage_after"].values())  # idle replicas hold no KV blocks
