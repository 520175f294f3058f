"""Soak: a long seeded mixed load against a real server, every completed answer
checked against a solo reference, the server's memory and KV cache watched.

Starts `python -m pagedserve.server --server-args ...` (or uses --base-url) and
builds a seeded pool of --distinct request bodies: both endpoints, n = 1 or 2,
greedy (temperature 0) or seeded sampling (temperature 0.8 + seed), half of
them behind a shared system prompt (prefix-cache hits). Each pool entry is first
sent alone, not streamed: its texts are the entry's reference. Then --requests
requests, --concurrency at a time, each drawing a pool entry, streamed or not at
random; an --abandon share of them is abandoned by the client at a random point
(a stream closed after 0..max_tokens chunks, a plain request cancelled after
0..--abandon-delay s), which the server must abort and free. The server's RSS is
read from its /metrics (process_resident_memory_bytes) at the start, after
--warmup requests, every --sample-every requests, and at the end.

It fails (exit 1) when a completed answer (streamed ones reassembled per choice
index) differs from its entry's reference in any choice, when any answer is a
5xx or a non-abandoned request gets anything but 200, when the server is not
idle at the end (requests running or waiting, KV usage above its idle value at
the start), when the first entries answer differently when re-sent alone at the
end, or, if --bound-mib > 0, when RSS grows by more than that after the warm-up
(--bound-mib 0 only reports it: a few hundred requests are too few for a bound).
The last line is the summary: PASS, or FAIL with the reasons.

    python bench/soak.py [--requests 10000] [--distinct 200] [--abandon 0.2] [--concurrency 8]
                         [--warmup 1000] [--bound-mib 50] [--json summary.json]
                         [--server-args "--dtype float32 --num-kv-blocks 48 --max-num-seqs 16"] [--base-url URL]

The server runs in float32 by default: in bfloat16 the GEMMs round differently
for different batch shapes, so a batched greedy answer may differ from the solo
one without anything being wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

WORDS = ("river mountain garden paper window quiet bright thunder silver orange market engine planet "
         "forest lantern harbor pencil ocean violin meadow castle").split()
SYSTEM = "You are a careful assistant. " * 12  # a shared prefix of a few blocks
CHAT = "/v1/chat/completions"
ABORTS = "vllm:request_success_total{finished_reason=abort}"

SERVER_PID: int | None = None  # set when this script started the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.server", "--port", str(port), "--log-level", "warning",
                             *shlex.split(args)], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server died while starting")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def metrics(base: str) -> dict[str, float]:
    """/metrics as {'name' or 'name{label=value}': value}, the model_name label left out."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def rss_mib(base: str) -> float:
    """The server's resident memory: its /metrics, or /proc for a server started
    here whose /metrics lacks the process figures."""
    m = metrics(base)
    if "process_resident_memory_bytes" in m:
        return m["process_resident_memory_bytes"] / 2**20
    if SERVER_PID is None:
        raise SystemExit("the server's /metrics has no process_resident_memory_bytes")
    with open(f"/proc/{SERVER_PID}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def make_pool(rng: random.Random, model: str, distinct: int, max_tokens: int) -> list[tuple[str, dict]]:
    """`distinct` different (path, body) pairs, without "stream"."""
    pool, seen = [], set()
    while len(pool) < distinct:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
        shared = rng.random() < 0.5
        body = {"model": model, "max_tokens": rng.randrange(4, max_tokens + 1), "n": rng.choice([1, 1, 2])}
        if rng.random() < 0.5:
            body.update(temperature=0.0)
        else:
            body.update(temperature=0.8, seed=rng.randrange(10**6))
        if rng.random() < 0.5:
            path = CHAT
            body["messages"] = ([{"role": "system", "content": SYSTEM}] if shared else []) + [
                {"role": "user", "content": text}]
        else:
            path = "/v1/completions"
            body["prompt"] = (SYSTEM if shared else "") + text
        key = json.dumps([path, body], sort_keys=True)
        if key not in seen:
            seen.add(key)
            pool.append((path, body))
    return pool


def texts_of(path: str, answer: dict) -> list[str]:
    """A non-streamed answer's texts, by choice index."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [c["message"]["content"] or "" if path == CHAT else c["text"] for c in choices]


async def send(client: httpx.AsyncClient, path: str, body: dict, stream: bool,
               abandon: float | None) -> tuple[int, list[str] | None]:
    """One request: (HTTP status or 0 when abandoned before the end, its texts
    by choice index or None). abandon: for a stream, the number of chunks read
    before closing it; for a plain request, the seconds before cancelling it."""
    if not stream:
        call = client.post(path, json=body)
        try:
            r = await (call if abandon is None else asyncio.wait_for(call, timeout=abandon))
        except asyncio.TimeoutError:
            return 0, None
        return r.status_code, texts_of(path, r.json()) if r.status_code == 200 else None
    texts = [""] * body["n"]
    chunks = 0
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return 200, texts
            if abandon is not None and chunks >= abandon:
                return 0, None  # leaving the block closes the connection: the server must abort
            chunks += 1
            for c in json.loads(line[6:]).get("choices", []):
                texts[c["index"]] += (c["delta"].get("content") or "") if path == CHAT else c["text"]
    return 0, None  # the stream ended without [DONE]


async def references(client: httpx.AsyncClient, pool: list[tuple[str, dict]]) -> list[list[str]]:
    """Each entry's texts, sent alone and not streamed."""
    out = []
    for path, body in pool:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            raise SystemExit(f"reference request failed with {r.status_code}: {r.text[:300]}")
        out.append(texts_of(path, r.json()))
    return out


def show_diff(i: int, body: dict, want: list[str], got: list[str], how: str) -> str:
    kind = "greedy" if body["temperature"] == 0 else f"seed {body['seed']}"
    lines = [f"  pool entry {i} ({kind}, n={body['n']}, {how}):"]
    for k, (w, g) in enumerate(zip(want, got)):
        if w != g:
            at = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            lines.append(f"    choice {k}, first difference at character {at}:\n      reference {w!r}\n"
                         f"      soak      {g!r}")
    return "\n".join(lines)


async def soak(base: str, args) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        m0 = metrics(base)
        idle_kv = m0["vllm:kv_cache_usage_perc"]
        pool = make_pool(rng, model, args.distinct, args.max_tokens)
        t0 = time.time()
        refs = await references(client, pool)
        print(f"{len(pool)} solo references in {time.time() - t0:.0f} s", flush=True)
        m1 = metrics(base)
        plan = []  # (pool index, stream, abandon point or None), drawn up front: the load is seeded
        for _ in range(args.requests):
            i, stream = rng.randrange(len(pool)), rng.random() < 0.5
            abandon = None
            if rng.random() < args.abandon:
                abandon = rng.randint(0, pool[i][1]["max_tokens"]) if stream else rng.uniform(0, args.abandon_delay)
            plan.append((i, stream, abandon))

        series = [("start", rss_mib(base))]
        print(f"RSS at start: {series[0][1]:.1f} MiB", flush=True)
        gate = asyncio.Semaphore(args.concurrency)
        statuses: dict[int, int] = {}
        mismatches: list[str] = []
        counts = {"done": 0, "completed": 0, "abandoned": 0, "abandon_planned": 0, "unexpected": 0}
        t1 = time.time()

        async def one(i, stream, abandon):
            path, body = pool[i]
            async with gate:
                status, texts = await send(client, path, body, stream, abandon)
            statuses[status] = statuses.get(status, 0) + 1
            counts["abandon_planned"] += abandon is not None
            if texts is not None:
                counts["completed"] += 1  # an abandon point past the end completes too: checked as well
                if texts != refs[i]:
                    mismatches.append(show_diff(i, body, refs[i], texts, "streamed" if stream else "not streamed"))
            elif status == 0 and abandon is not None:
                counts["abandoned"] += 1
            else:
                counts["unexpected"] += 1
            counts["done"] += 1
            done = counts["done"]
            if done == args.warmup or (done > args.warmup and done % args.sample_every == 0):
                series.append((done, rss_mib(base)))
                print(f"  {done} requests ({time.time() - t1:.0f} s): RSS {series[-1][1]:.1f} MiB, "
                      f"{len(mismatches)} mismatches", flush=True)

        await asyncio.gather(*(one(*p) for p in plan))
        elapsed = time.time() - t1
        for _ in range(300):  # abandoned requests are aborted within a step
            m = metrics(base)
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        series.append(("end", rss_mib(base)))
        k = min(3, len(pool))
        recheck = await references(client, pool[:k])
        m_end = metrics(base)

    warm = next((v for n, v in series if n == args.warmup), None)
    s = {
        "requests": args.requests, "distinct": len(pool), "concurrency": args.concurrency, "seconds": elapsed,
        "statuses": statuses, "completed": counts["completed"], "abandoned": counts["abandoned"],
        "abandon_planned": counts["abandon_planned"], "unexpected": counts["unexpected"],
        "mismatches": len(mismatches), "recheck_changed": sum(a != b for a, b in zip(recheck, refs[:k])),
        "running": m_end["vllm:num_requests_running"], "waiting": m_end["vllm:num_requests_waiting"],
        "kv_usage_idle": idle_kv, "kv_usage_end": m_end["vllm:kv_cache_usage_perc"],
        "preemptions": m_end.get("vllm:num_preemptions_total", 0) - m1.get("vllm:num_preemptions_total", 0),
        "prefix_cache_hit_tokens": m_end.get("vllm:prefix_cache_hits_total", 0) - m1.get(
            "vllm:prefix_cache_hits_total", 0),
        "aborted": m_end.get(ABORTS, 0) - m1.get(ABORTS, 0),
        "rss_series": series, "rss_start": series[0][1], "rss_warm": warm, "rss_end": series[-1][1],
        "rss_growth": series[-1][1] - warm if warm is not None else None, "bound_mib": args.bound_mib,
    }
    print(f"\n{args.requests} requests over {len(pool)} distinct bodies in {elapsed:.0f} s, {args.concurrency} at a "
          f"time: {s['completed']} completed, {s['abandoned']} abandoned ({s['abandon_planned']} planned), "
          f"statuses {statuses}")
    print(f"mismatches against the solo references: {len(mismatches)}; solo re-check at the end changed: "
          f"{s['recheck_changed']} of {k}")
    for d in mismatches[:5]:
        print(d)
    print(f"at the end: {s['running']:.0f} running, {s['waiting']:.0f} waiting, KV usage {s['kv_usage_end']:.4f} "
          f"(idle {idle_kv:.4f}); during the soak: {s['preemptions']:.0f} preemptions, "
          f"{s['prefix_cache_hit_tokens']:.0f} prefix-cache hit tokens, {s['aborted']:.0f} choices aborted by the "
          "server")
    print("RSS series (requests: MiB): " + ", ".join(f"{n}: {v:.1f}" for n, v in series))
    growth = "n/a (warm-up not reached)" if warm is None else f"{s['rss_growth']:+.1f} MiB"
    print(f"RSS at start {series[0][1]:.1f} MiB, at the end {series[-1][1]:.1f} MiB; growth after the "
          f"{args.warmup}-request warm-up: {growth} (bound: {args.bound_mib if args.bound_mib > 0 else 'none'})")

    failures = []
    if mismatches:
        failures.append(f"{len(mismatches)} answers differ from their solo reference")
    if s["recheck_changed"]:
        failures.append(f"{s['recheck_changed']} solo answers changed after the soak")
    if any(st >= 500 for st in statuses):
        failures.append("5xx answers")
    if s["unexpected"]:
        failures.append(f"{s['unexpected']} requests failed (statuses {statuses})")
    if s["running"] or s["waiting"] or s["kv_usage_end"] > idle_kv:
        failures.append(f"not idle at the end ({s['running']:.0f} running, {s['waiting']:.0f} waiting, "
                        f"KV usage {s['kv_usage_end']:.4f} vs idle {idle_kv:.4f})")
    if args.bound_mib > 0:
        if warm is None:
            failures.append("no RSS bound check: the warm-up was not reached")
        elif s["rss_growth"] > args.bound_mib:
            failures.append(f"RSS grew {s['rss_growth']:.1f} MiB after the warm-up (bound {args.bound_mib} MiB)")
    s["failures"] = failures
    print("PASS" if not failures else "FAIL: " + "; ".join(failures), flush=True)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--distinct", type=int, default=200, help="request bodies in the pool (one solo reference each)")
    ap.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a pool entry")
    ap.add_argument("--abandon", type=float, default=0.2, help="share of requests the client abandons")
    ap.add_argument("--abandon-delay", type=float, default=2.0, help="longest wait before cancelling a plain request")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=200, help="requests before the RSS baseline")
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--bound-mib", type=float, default=50.0,
                    help="RSS growth bound after the warm-up; <= 0: report only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the summary to this file")
    # float32: batched answers equal solo ones only there (bf16 GEMMs round by batch shape)
    ap.add_argument("--server-args", default="--dtype float32 --num-kv-blocks 48 --max-num-seqs 16")
    ap.add_argument("--base-url", default=None, help="soak a running server instead of starting one")
    args = ap.parse_args()
    proc = None
    base = args.base_url
    if base is None:
        global SERVER_PID
        proc, base = start_server(args.server_args)
        SERVER_PID = proc.pid
    try:
        summary = asyncio.run(soak(base, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    raise SystemExit(1 if summary["failures"] else 0)


if __name__ == "__main__":
    main()
