"""`pagedserve bench routing`: request routers side by side on replicas of one
model (`pagedserve serve --replicas N`, scaleout/ray_app.py).

The workload (issue 29): T tenants, each with a system prompt of S tokens;
each request is its tenant's system prompt + a Q-token question, answered with
O tokens (greedy, EOS ignored), arriving as a Poisson process at a stated rate.
Prompts are token ids drawn from a seed (so the ingress and the replicas hash
exactly the same tokens). Each replica's KV store is sized to hold about half
the tenants' system prompts (``--num-kv-blocks``, default: that many blocks
plus room for the requests in flight). For each policy (a fresh application:
cold caches) the same requests are sent; a second run sends 70% of the
traffic from one tenant (``--hot-fraction``), where the prefix router's load
guard has to move work.

Printed: a Markdown table per run (TTFT p50/p99, E2E p50, prefix-cache hit
rate from the replicas' /metrics, requests per replica), whether every greedy
output equals a single engine's, and a last line ``JSON {...}``.

Ray probes a cloud-metadata address when it starts: unless ``--no-netns``,
this command re-runs itself inside a loopback-only network namespace
(``unshare -n``, root) so nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time

BLOCK_SIZE = 16
PORT = 8000
POLICIES = ("prefix", "round-robin", "ray-default")


def make_workload(args, hot_fraction: float) -> tuple[list[list[int]], list[int], list[float]]:
    """(prompts as token ids, each one's tenant, arrival times in s), from args.seed."""
    from .serving import poisson_arrivals

    rng = random.Random(f"pagedserve-bench-routing:{args.seed}")
    low, high = 1000, 40000  # ordinary tokens of SmolLM2's vocabulary (no special tokens)
    systems = [[rng.randrange(low, high) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    tenants = []
    for _ in range(args.num_requests):
        if hot_fraction > 0 and rng.random() < hot_fraction:
            tenants.append(0)
        else:
            tenants.append(rng.randrange(args.tenants))
    prompts = [systems[t] + [rng.randrange(low, high) for _ in range(args.question_tokens)] for t in tenants]
    return prompts, tenants, poisson_arrivals(args.num_requests, args.rate, args.seed)


def replica_counters(base: str) -> dict[str, dict[str, float]]:
    """{replica: {queries, hits, requests}} from the ingress's /metrics (totals so far)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    names = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
             "vllm:request_success_total": "requests", "vllm:num_preemptions_total": "preemptions"}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=60).text):
        for s in family.samples:
            if s.name in names:
                d = out.setdefault(s.labels["replica"], dict.fromkeys(names.values(), 0.0))
                d[names[s.name]] += s.value
    return out


async def send_all(base: str, model: str, prompts, arrivals, output_tokens: int, salts=None):
    """Sends every request at its arrival time (streamed; salts: each one's
    cache_salt); their RequestResults."""
    import httpx

    from .serving import open_loop, send_request

    async with httpx.AsyncClient(timeout=600) as client:
        async def send(i: int):
            body = {"model": model, "prompt": prompts[i], "max_tokens": output_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if salts is not None:
                body["cache_salt"] = salts[i]
            return await send_request(client, base + "/v1/completions", {}, body, i)

        return await open_loop(send, arrivals)


async def greedy_texts(base: str, model: str, prompts, output_tokens: int) -> dict[int, str]:
    """The greedy texts of the first 16 prompts, non-streamed, one at a time."""
    import httpx

    texts: dict[int, str] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(min(len(prompts), 16)):
            r = await client.post(base + "/v1/completions", json={"model": model, "prompt": prompts[i],
                                                                 "max_tokens": output_tokens, "temperature": 0,
                                                                 "ignore_eos": True})
            texts[i] = r.json()["choices"][0]["text"]
    return texts


def run_policy(args, policy: str, prompts, arrivals) -> dict:
    """Runs one policy on a fresh application; its row of the table."""
    import httpx
    from ray import serve

    from ..scaleout.ray_app import build_app
    from ..server.__main__ import build_parser
    from .serving import percentile

    flags = ["--replicas", str(args.replicas), "--routing", policy, "--replica-cpus", str(args.replica_cpus),
             "--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "warning",
             "--balance-abs-threshold", str(args.balance_abs_threshold),
             "--balance-rel-threshold", str(args.balance_rel_threshold)] + args.engine_flags
    sargs = build_parser().parse_args(([args.model] if args.model else []) + flags)
    serve.run(build_app(sargs), name="pagedserve", route_prefix="/")
    base = f"http://127.0.0.1:{PORT}"
    model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
    for _ in range(120):  # every replica answers /metrics
        if len(replica_counters(base)) == args.replicas:
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"only {len(replica_counters(base))} of {args.replicas} replicas answer /metrics")
    # warm-up: first-call costs paid before the timed run, under salts of their own (caches stay cold for it)
    warm = [prompts[0]] * (2 * args.replicas)
    asyncio.run(send_all(base, model, warm, [0.0] * len(warm), args.output_tokens,
                         salts=[f"warm-up-{i}" for i in range(len(warm))]))
    time.sleep(1.0)
    before = replica_counters(base)
    t0 = time.perf_counter()
    results = asyncio.run(send_all(base, model, prompts, arrivals, args.output_tokens))
    wall = time.perf_counter() - t0
    after = replica_counters(base)
    texts = asyncio.run(greedy_texts(base, model, prompts, args.output_tokens))
    serve.delete("pagedserve")
    ok = [r for r in results if r.error is None]
    delta = {rid: {k: after[rid][k] - before.get(rid, {}).get(k, 0.0) for k in after[rid]} for rid in after}
    queries = sum(d["queries"] for d in delta.values())
    hits = sum(d["hits"] for d in delta.values())
    ttfts = [r.ttft * 1e3 for r in ok]
    return {"policy": policy, "requests": len(results), "errors": len(results) - len(ok),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "e2e_p50_ms": percentile([r.e2e * 1e3 for r in ok], 50),
            "hit_rate": hits / queries if queries else 0.0, "wall_s": wall,
            "preemptions": round(sum(d["preemptions"] for d in delta.values())),
            "requests_per_replica": sorted(round(d["requests"]) for d in delta.values()),
            "texts": texts,
            "errors_seen": sorted({r.error for r in results if r.error})[:3]}


def single_engine_texts(args, prompts) -> dict[int, str]:
    """The greedy texts of the first 16 prompts from one in-process engine."""
    import dataclasses

    from ..config import EngineArgs
    from ..llm import LLM
    from ..sampling_params import SamplingParams
    from ..server.__main__ import build_parser

    flags = ([args.model] if args.model else []) + ["--num-kv-blocks", str(args.num_kv_blocks * 2)] + args.engine_flags
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(build_parser().parse_args(flags))))
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([prompts[i] for i in range(min(len(prompts), 16))], params)
    return {i: o.outputs[0].text for i, o in enumerate(outs)}


def table(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "",
             "| policy | TTFT p50 (ms) | TTFT p99 (ms) | E2E p50 (ms) | prefix-cache hit rate | requests per replica "
             "| preemptions | errors |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['e2e_p50_ms']:.0f} "
                     f"| {r['hit_rate']:.2f} | {' / '.join(map(str, r['requests_per_replica']))} | {r['preemptions']} "
                     f"| {r['errors']} |")
    for r in rows:
        if r["errors"]:
            lines.append(f"\n**{r['policy']}: {r['errors']} requests failed** (its percentiles leave them out): "
                         f"{r['errors_seen']}")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> str:
    """Bar charts of TTFT p50/p99 and the prefix-cache hit rate per policy, one
    column per run, from main()'s JSON summary (matplotlib); returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [name for name in ("uniform", "hot-tenant") if name in summary]
    fig, axes = plt.subplots(2, len(runs), figsize=(5 * len(runs), 6), squeeze=False)
    for col, name in enumerate(runs):
        policies = list(summary[name])
        xs = range(len(policies))
        ax = axes[0][col]
        ax.bar([x - 0.2 for x in xs], [summary[name][p]["ttft_p50_ms"] for p in policies], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [summary[name][p]["ttft_p99_ms"] for p in policies], 0.4, label="p99")
        ax.set_xticks(list(xs), policies)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(name)
        ax.legend()
        ax = axes[1][col]
        ax.bar(list(xs), [summary[name][p]["hit_rate"] for p in policies], 0.5, color="tab:green")
        ax.set_xticks(list(xs), policies)
        ax.set_ylabel("prefix-cache hit rate")
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagedserve bench routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the model (default: the default model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    p.add_argument("--hot-fraction", type=float, default=0.7, help="the hot-tenant run: this share from tenant 0")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per replica (default: half the tenants' system prompts + one whole request)")
    p.add_argument("--balance-abs-threshold", type=int, default=4,
                   help="the prefix router's load guard (requests; SGLang's 64 suits far more traffic than one "
                        "CPU replica takes)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PNG", help="write bar charts of the runs there")
    p.add_argument("--no-netns", action="store_true",
                   help="do not re-run inside a loopback-only network namespace (Ray then reaches the network)")
    p.add_argument("--engine-flag", dest="engine_flags", action="append", default=[],
                   help="a flag passed on to every replica (repeatable), e.g. --engine-flag=--dtype=float32")
    args = p.parse_args(argv)
    if args.num_kv_blocks is None:
        per_prompt = -(-(args.system_tokens + args.question_tokens + args.output_tokens) // BLOCK_SIZE)
        args.num_kv_blocks = (args.tenants // 2) * (args.system_tokens // BLOCK_SIZE) + per_prompt
    return args


def reexec_in_netns(argv) -> None:
    """Runs this command again inside `unshare -n` with lo up; exits with its status."""
    if shutil.which("unshare") is None:
        raise SystemExit("pagedserve bench routing: needs `unshare` (util-linux) for a loopback-only network "
                         "namespace, or --no-netns")
    inner = shlex.join([sys.executable, "-m", "pagedserve.bench.routing", "--no-netns", *argv])
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {inner}"], env=env))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.no_netns:
        reexec_in_netns(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    policies = [p for p in args.policies.split(",") if p]
    runs: dict[str, list[dict]] = {}
    ray.init(num_cpus=max(os.cpu_count() or 1, int(args.replicas * args.replica_cpus)), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        for name, hot in (("uniform", 0.0), ("hot-tenant", args.hot_fraction)):
            prompts, tenants, arrivals = make_workload(args, hot)
            runs[name] = [run_policy(args, p, prompts, arrivals) for p in policies]
            print(table(runs[name], f"{name}: {args.num_requests} requests at {args.rate}/s, {args.tenants} tenants "
                                    f"x {args.system_tokens}-token system prompts"
                                    + (f", {hot:.0%} from one tenant" if hot else "")), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    reference = single_engine_texts(args, make_workload(args, 0.0)[0])
    equal = {p["policy"]: p["texts"] == reference for p in runs["uniform"]}
    print(f"\ngreedy outputs equal one engine's (first {len(reference)} prompts): {equal}")
    rr = {r["policy"]: r for r in runs["uniform"]}
    if "prefix" in rr and "round-robin" in rr:
        print(f"prefix vs round-robin: TTFT p50 {rr['prefix']['ttft_p50_ms'] / rr['round-robin']['ttft_p50_ms']:.2f}x"
              f", hit rate {rr['prefix']['hit_rate'] / max(rr['round-robin']['hit_rate'], 1e-9):.2f}x")
    summary = {name: {r["policy"]: {k: r[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "hit_rate",
                                                       "requests_per_replica", "preemptions", "errors")}
                      for r in rows}
               for name, rows in runs.items()}
    summary["outputs_equal_single_engine"] = equal
    summary["config"] = {k: v for k, v in vars(args).items() if k != "no_netns"}
    if args.plot:
        print(f"plot: {plot(summary, args.plot)}")
    print("JSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
