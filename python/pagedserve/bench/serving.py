"""Serving benchmark: streamed requests against any OpenAI-compatible server
(PagedServe, llama.cpp's llama-server, vLLM), with a token-count check.

Each request streams ``/v1/completions`` (or ``/v1/chat/completions`` with
``--endpoint chat``) as Server-Sent Events: a seeded synthetic prompt of
--input-len plain English words, ``max_tokens`` --output-len, temperature 0,
``ignore_eos: true`` (unless --no-ignore-eos) and ``stream_options:
{"include_usage": true}``. The prompts depend only on --seed, so every server
gets the same text; each run of a sweep (and the warm-up) gets prompts of its
own, so one run does not find the previous one's prompts in a prefix cache.
A second invocation with the same --seed sends the same prompts again, which
both PagedServe and llama-server then answer from their prefix caches (TTFT
of a few ms): give each round of a repeated comparison its own --seed.

    pagedserve bench serving [--base-url URL] [--concurrency C | --sweep 1,8,32 | --request-rate R]
                             [--num-requests N] [--input-len L] [--output-len N] [--json PATH] [--plot PATH]
    pagedserve bench serving --compare pagedserve=http://127.0.0.1:8000/v1 llama.cpp=http://127.0.0.1:8080/v1 ...

(from a checkout, ``python bench/serving.py`` takes the same flags)

Load: closed loop (--concurrency C: C workers, each sends its next request when
its previous one has ended, --num-requests in all; --sweep runs it at several
concurrencies) or open loop (--request-rate R: Poisson arrivals, exponential
inter-arrival times of mean 1/R s from --seed, optionally at most
--max-concurrency requests in flight; a request that waits for a slot starts
its clock when it is sent).

Per run: output tokens/s (the output tokens of all requests / the wall time
from the first send to the last completion), requests/s, and p50/p99 in ms of
TTFT (send -> first chunk with text), ITL (the gaps between text chunks after
the first), TPOT ((E2E - TTFT) / (tokens - 1) per request) and E2E (send ->
end of stream). Token check: a request passes when the server produced exactly
--output-len tokens, counted from the final chunk's ``usage.completion_tokens``
(else, where a server does not send it, the number of text chunks). Requests
that fail (HTTP error, error event, a stream cut short) or produce another
number of tokens are listed, never dropped; the exit status is then 1.

--workload grounded asks for those words repeated word for word (an
input-grounded task, as editing or summarising are; best with --endpoint chat).

Prompt length: --input-len words drawn from a list of common English words,
each one token in the usual BPE vocabularies; the table shows the mean prompt
length that the servers report (``usage.prompt_tokens``: the chat endpoint adds
its template). An unreachable server is a one-line error, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

# Common English words that the usual BPE vocabularies (GPT-2, Llama, SmolLM2,
# Qwen) hold as one token with their leading space: a prompt of N of them is
# about N tokens.
WORDS = tuple("""
the of and to in is was for that on as with by at from his her they this had not are but were which one
all she when there their been has more would will who time can two may only new first other its some
like over than into could about after also made many then them these way years most such used where well
three people state just between both work world each year under great city house part through during
because life while day long high back people same found another small water until large country own
still being around few down place last group end name good four school history power system area
family went never number north second set south take three war land side game five team much fact
public local case point since city took member law line road market play little white real open early
line form music book money early rather party make very half point hand home light field king night
story death young period river company sea army black green blue red church field heart voice river
mind order paper plan room door child friend table window garden morning summer winter spring autumn
""".split())
WORDS = tuple(dict.fromkeys(WORDS))  # drop repeats, keep the order


def synthetic_prompts(count: int, input_len: int, seed: int, start: int = 0) -> list[str]:
    """Prompts number start .. start + count - 1 of seed: each input_len words of
    WORDS, space-separated, capitalised and ending in a full stop. Prompt j depends
    only on (seed, j) (random.Random seeded with a string: the same on every
    machine and Python run)."""
    prompts = []
    for j in range(start, start + count):
        rng = random.Random(f"pagedserve-bench-serving:{seed}:{j}")
        words = [rng.choice(WORDS) for _ in range(input_len)]
        words[0] = words[0].capitalize()
        prompts.append(" ".join(words) + ".")
    return prompts


GROUNDED_INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"


def workload_prompts(workload: str, count: int, input_len: int, seed: int, start: int = 0) -> list[str]:
    """synthetic_prompts(count, input_len, seed, start) for the "words"
    workload; for "grounded" each of them as a passage to repeat after
    GROUNDED_INSTRUCTION (an input-grounded task: the answer quotes the prompt,
    as in editing and summarising, where prompt-lookup speculation pays)."""
    prompts = synthetic_prompts(count, input_len, seed, start)
    if workload == "grounded":
        prompts = [GROUNDED_INSTRUCTION + p for p in prompts]
    return prompts


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of n requests arriving as a Poisson process
    of rate requests/s: the first at 0, then exponential gaps of mean 1/rate,
    drawn from seed (the same list for the same arguments)."""
    if n < 0 or not rate > 0 or math.isinf(rate):
        raise ValueError(f"need n >= 0 and a finite rate > 0, got n={n}, rate={rate}")
    rng = random.Random(f"pagedserve-bench-serving-poisson:{seed}")
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def percentile(values, q: float) -> float:
    """The q-th percentile (q in [0, 100]) of values, interpolating linearly
    between the closest ranks (numpy's default method); nan when values is empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestResult:
    """One streamed request. Times in s (time.perf_counter); nan where unknown."""

    index: int  # its prompt's number
    error: str | None = None  # None: the stream ended normally ([DONE] or a finish_reason)
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    counted_by: str = "chunks"  # "usage" or "chunks": where output_tokens comes from
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the server sent it
    finish_reason: str | None = None
    start: float = math.nan  # when it was sent
    end: float = math.nan  # when its stream ended (or it failed)
    ttft: float = math.nan  # send -> first chunk with text
    itl: list[float] = field(default_factory=list)  # gaps between text chunks after the first

    @property
    def e2e(self) -> float:
        """Send -> end of stream (s)."""
        return self.end - self.start

    @property
    def tpot(self) -> float:
        """Time per output token after the first (s); nan below 2 tokens."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


class ServerUnreachable(Exception):
    """A server did not answer (or answered GET /models with an error): exit status 2."""


@dataclass
class Server:
    label: str
    base_url: str  # ends in /v1 (or wherever /completions lives)
    model: str | None = None  # None: the first of GET /models


def request_body(endpoint: str, model: str, prompt: str, output_len: int, ignore_eos: bool,
                 extra: dict | None = None) -> dict:
    """The JSON body of one streamed request; extra is merged in last (it wins)."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


def _error_message(text: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the text; one line."""
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        text = msg if isinstance(msg, str) else json.dumps(msg)
    except ValueError:
        pass
    text = " ".join(text.split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _chunk_text(choice: dict) -> str:
    """The generated text of one streamed choice: text (completions) or delta content (chat)."""
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(client, url: str, headers: dict, body: dict, index: int) -> RequestResult:
    """Sends one streamed request and times it; never raises for a failed request
    (the failure is in the result's error)."""
    import httpx

    r = RequestResult(index)
    chunk_times: list[float] = []
    usage_tokens = None
    ended = False
    r.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {_error_message(text)}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ended = True
                        break
                    now = time.perf_counter()
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        r.error = f"unparsable stream event: {data[:100]!r}"
                        break
                    if not isinstance(obj, dict):
                        continue
                    if obj.get("error"):
                        r.error = f"error event in the stream: {_error_message(json.dumps(obj))}"
                        break
                    for choice in obj.get("choices") or []:
                        if _chunk_text(choice):
                            chunk_times.append(now)
                        if choice.get("finish_reason"):
                            r.finish_reason = choice["finish_reason"]
                    usage = obj.get("usage")
                    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            r.prompt_tokens = int(usage["prompt_tokens"])
                if r.error is None and not ended and r.finish_reason is None:
                    r.error = "the stream ended without a finish_reason or [DONE]"
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    r.end = time.perf_counter()
    if chunk_times:
        r.ttft = chunk_times[0] - r.start
        r.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if usage_tokens is not None:
        r.output_tokens, r.counted_by = usage_tokens, "usage"
    else:
        r.output_tokens = len(chunk_times)
    return r


async def closed_loop(send, n: int, concurrency: int) -> list[RequestResult]:
    """send(i) for i in 0..n-1 by `concurrency` workers, each sending its next
    request when its previous one has ended; results in index order."""
    results: list[RequestResult | None] = [None] * n
    indices = iter(range(n))

    async def worker():
        for i in indices:  # one shared iterator: each index is taken once
            results[i] = await send(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return results


async def open_loop(send, arrivals: list[float], max_concurrency: int | None = None) -> list[RequestResult]:
    """send(i) at arrivals[i] s after the start (at most max_concurrency in flight:
    a later one waits for a slot and is sent then); results in index order."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        if gate is None:
            return await send(i)
        async with gate:
            return await send(i)

    tasks = []
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    return list(await asyncio.gather(*tasks))


def _ms(x: float) -> float:
    return x * 1000 if math.isfinite(x) else math.nan


def summarize(results: list[RequestResult], output_len: int) -> dict:
    """The metrics of one run (times in ms, rates per s) and its token check."""
    done = [r for r in results if r.error is None]
    exact = [r for r in done if r.output_tokens == output_len]
    starts = [r.start for r in results if math.isfinite(r.start)]
    ends = [r.end for r in results if math.isfinite(r.end)]
    duration = max(ends) - min(starts) if starts and ends else math.nan
    tokens = sum(r.output_tokens for r in done)
    ttft = [r.ttft for r in done if math.isfinite(r.ttft)]
    itl = [g for r in done for g in r.itl]
    tpot = [r.tpot for r in done if math.isfinite(r.tpot)]
    e2e = [r.e2e for r in done]
    prompt = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    out = {
        "num_requests": len(results), "completed": len(done), "errors": len(results) - len(done),
        "exact_tokens": len(exact), "token_check_passed": len(exact) == len(results),
        "counted_by": sorted({r.counted_by for r in done}),
        "duration_s": duration, "output_tokens": tokens,
        "output_tok_s": tokens / duration if duration > 0 else math.nan,
        "request_s": len(done) / duration if duration > 0 else math.nan,
        "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = _ms(percentile(xs, q))
    problems = []  # every request that failed the check, with what went wrong
    for r in results:
        if r.error is not None:
            problems.append({"request": r.index, "problem": r.error})
        elif r.output_tokens != output_len:
            problems.append({"request": r.index, "problem": f"{r.output_tokens} of {output_len} tokens (counted by "
                                                            f"{r.counted_by}, finish_reason {r.finish_reason})"})
    out["problems"] = problems
    return out


def _load_name(run: dict) -> str:
    if run["mode"] == "concurrency":
        return f"c={run['concurrency']}"
    cap = f", max {run['max_concurrency']} in flight" if run.get("max_concurrency") else ""
    return f"{run['request_rate']:g} req/s{cap}"


async def resolve_server(client, server: Server, headers: dict) -> Server:
    """Checks that the server answers GET /models and fills its model (the first
    listed) when none was given. Raises ServerUnreachable (one line)."""
    import httpx

    url = server.base_url + "/models"
    try:
        resp = await client.get(url, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach {server.base_url} ({server.label}): GET {url} failed: "
                                f"{type(e).__name__}{': ' + str(e) if str(e) else ''}") from None
    if server.model is not None:
        return server  # reachable; its /models may be missing or differ
    if resp.status_code != 200:
        raise ServerUnreachable(f"GET {url} ({server.label}) answered HTTP {resp.status_code}: "
                                f"{_error_message(resp.text)} (give --model to skip this)")
    try:
        server.model = resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnreachable(f"GET {url} ({server.label}) listed no model: {resp.text[:200]!r} "
                                f"(give --model)") from None
    return server


async def bench_server(server: Server, args, loads: list[dict], headers: dict, log=print) -> list[dict]:
    """Warm-up, then every load of loads against one server; returns one dict per run."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    url = server.base_url + path
    runs = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await resolve_server(client, server, headers)

        def sender(prompts):
            async def send(i):
                body = request_body(args.endpoint, server.model, prompts[i], args.output_len,
                                    not args.no_ignore_eos, args.extra_body)
                return await send_request(client, url, headers, body, i)
            return send

        if args.warmup:
            warm = workload_prompts(args.workload, args.warmup, args.input_len, args.seed, start=-args.warmup)
            got = await closed_loop(sender(warm), args.warmup, args.warmup)
            failed = [r.error for r in got if r.error]
            if failed:
                log(f"{server.label}: {len(failed)} of {args.warmup} warm-up request(s) failed: {failed[0]}")
        for k, load in enumerate(loads):
            prompts = workload_prompts(args.workload, args.num_requests, args.input_len, args.seed,
                                       start=k * args.num_requests)
            send = sender(prompts)
            if load["mode"] == "concurrency":
                results = await closed_loop(send, args.num_requests, load["concurrency"])
            else:
                arrivals = poisson_arrivals(args.num_requests, load["request_rate"], args.seed + k)
                results = await open_loop(send, arrivals, load.get("max_concurrency"))
            run = {"label": server.label, "base_url": server.base_url, "model": server.model, **load,
                   **summarize(results, args.output_len),
                   "requests": [{**asdict(r), "e2e": r.e2e, "tpot": r.tpot} for r in results]}
            runs.append(run)
            log(f"{server.label} {_load_name(run)}: {run['completed']}/{run['num_requests']} completed in "
                f"{run['duration_s']:.2f} s, {run['output_tok_s']:.1f} output tok/s, "
                f"exact token count {run['exact_tokens']}/{run['num_requests']}")
    return runs


def ratios(runs: list[dict], baseline: str) -> list[dict]:
    """Per load and per other server: baseline/other output tok/s and baseline/other TPOT p50."""
    base = {_load_name(r): r for r in runs if r["label"] == baseline}
    out = []
    for r in runs:
        b = base.get(_load_name(r))
        if r["label"] == baseline or b is None:
            continue
        div = lambda x, y: x / y if y and math.isfinite(x) and math.isfinite(y) else math.nan  # noqa: E731
        out.append({"load": _load_name(r), "baseline": baseline, "other": r["label"],
                    "output_tok_s_ratio": div(b["output_tok_s"], r["output_tok_s"]),
                    "tpot_p50_ratio": div(b["tpot_p50_ms"], r["tpot_p50_ms"])})
    return out


def _f(x, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def format_report(runs: list[dict], rows: list[dict], args) -> str:
    """The Markdown tables (results, then the ratios when several servers ran) and the problems."""
    lines = [f"{args.num_requests} requests per run, prompts of {args.input_len} words ({args.workload}), {args.output_len} output "
             f"tokens, temperature 0{', ignore_eos' if not args.no_ignore_eos else ''}, "
             f"/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'} streamed, seed {args.seed}; "
             f"latencies in ms", "",
             "| server | load | tokens check | prompt tok | output tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 "
             "| ITL p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        check = f"{r['exact_tokens']}/{r['num_requests']}" + ("" if r["token_check_passed"] else " FAIL")
        lines.append(f"| {r['label']} | {_load_name(r)} | {check} | {_f(r['mean_prompt_tokens'])} "
                     f"| {_f(r['output_tok_s'])} | {_f(r['request_s'], '.2f')} | "
                     + " | ".join(_f(r[f"{m}_p{q}_ms"]) for m in ("ttft", "itl", "tpot", "e2e") for q in (50, 99))
                     + " |")
    floor = getattr(args, "floor", None)
    if floor:
        lines += ["", f"bandwidth floor of one user's decode: {floor['bytes'] / 1e6:.1f} MB of {floor['file']} read "
                      f"per token / {floor['bandwidth'] / 1e9:.1f} GB/s read bandwidth = {floor['ms']:.2f} ms"]
        for r in runs:
            if r.get("concurrency") == 1 and isinstance(r["tpot_p50_ms"], float) and math.isfinite(r["tpot_p50_ms"]):
                lines.append(f"  {r['label']} c=1: TPOT p50 {r['tpot_p50_ms']:.2f} ms = "
                             f"{r['tpot_p50_ms'] / floor['ms']:.2f}x the floor")
    if rows:
        lines += ["", "| load | compared | output tok/s ratio | TPOT p50 ratio |", "|---|---|---:|---:|"]
        for x in rows:
            lines.append(f"| {x['load']} | {x['baseline']} / {x['other']} | {_f(x['output_tok_s_ratio'], '.2f')}x "
                         f"| {_f(x['tpot_p50_ratio'], '.2f')}x |")
        first = rows[0]["baseline"]
        lines.append(f"(ratios are {first}'s over the other's: output tok/s ratio above 1, {first} serves more "
                     f"tokens a second; TPOT p50 ratio below 1, {first} takes less time per token)")
    counted = sorted({c for r in runs for c in r["counted_by"]})
    lines += ["", f"tokens check: requests that produced exactly {args.output_len} tokens, counted by "
                  f"{' and '.join(counted) or 'nothing (no request completed)'} (usage = the final chunk's "
                  f"usage.completion_tokens; chunks = text chunks, where the server sent no usage)"]
    for r in runs:
        if not r["problems"]:
            continue
        lines.append(f"{r['label']} {_load_name(r)}: {len(r['problems'])} of {r['num_requests']} request(s) failed "
                     f"the check ({r['errors']} error(s)):")
        grouped: dict[str, list[int]] = {}  # the same problem on many requests: one line
        for p in r["problems"]:
            grouped.setdefault(p["problem"], []).append(p["request"])
        for i, (problem, which) in enumerate(grouped.items()):
            if i == 10:
                lines.append(f"  ... and {len(grouped) - 10} other problem(s) (all in --json)")
                break
            shown = ", ".join(map(str, which[:8])) + (", ..." if len(which) > 8 else "")
            lines.append(f"  {len(which)} request(s) ({shown}): {problem}")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, title: str = "") -> str:
    """Writes a two-panel line PNG to path and returns path: output tokens/s and
    TTFT p99 (ms) against the load (concurrency, or request rate for an open
    loop), one line per server label."""
    from pagedserve.experiments import plots

    labels = list(dict.fromkeys(r["label"] for r in runs))
    closed = runs[0]["mode"] == "concurrency"
    key = "concurrency" if closed else "request_rate"
    xs = sorted({r[key] for r in runs})

    def series(metric):
        by = {(r["label"], r[key]): r[metric] for r in runs}
        return {label: [by.get((label, x), math.nan) for x in xs] for label in labels}

    xlabel = "concurrency (closed loop)" if closed else "request rate (req/s, Poisson)"
    logx = len(xs) > 2 and xs[-1] / xs[0] >= 4
    fig, (tps_ax, ttft_ax) = plots.new_figure(ncols=2)
    plots.draw_lines(tps_ax, xs, series("output_tok_s"), xlabel=xlabel, ylabel="output tokens/s",
                     title="throughput (higher is better)", logx=logx)
    plots.draw_lines(ttft_ax, xs, series("ttft_p99_ms"), xlabel=xlabel, ylabel="TTFT p99 (ms)",
                     title="time to first token, p99 (lower is better)", logx=logx)
    return plots.save(fig, path, suptitle=title)


def _int_at_least(low: int):
    """An argparse type: an integer >= low (ArgumentTypeError otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    values = [_positive_int(t.strip()) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,8,32, got {text!r}")
    return list(dict.fromkeys(values))


def _label_url(text: str) -> Server:
    label, sep, url = text.partition("=")
    if not sep or not label or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected LABEL=URL such as pagedserve=http://127.0.0.1:8000/v1, "
                                         f"got {text!r}")
    return Server(label, url.rstrip("/"))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv: list[str] | None, prog: str | None = None) -> tuple[argparse.Namespace, list[Server],
                                                                         list[dict]]:
    """(flags, the servers in order, the loads: dicts with mode "concurrency" or "rate").
    Bad flags exit through argparse (status 2, one line after the usage)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("servers")
    target.add_argument("--base-url", default=None, help=f"the server's OpenAI API root (default {DEFAULT_BASE_URL})")
    target.add_argument("--label", default=None, help="the server's name in the outputs (default: host:port)")
    target.add_argument("--compare", nargs="+", type=_label_url, metavar="LABEL=URL",
                        help="benchmark several servers, one after another, with the same prompts and loads")
    target.add_argument("--baseline", default=None, metavar="LABEL",
                        help="with --compare: the numerator of the ratios (default: the first label)")
    target.add_argument("--model", default=None, help="model name to send (default: the first of GET /models)")
    target.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    req = ap.add_argument_group("requests")
    req.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                     help="/v1/completions with a prompt, or /v1/chat/completions with one user message")
    req.add_argument("--workload", choices=["words", "grounded"], default="words",
                     help="words: the --input-len words as the prompt (default); grounded: an instruction to repeat "
                          "them word for word (input-grounded output, where --speculative ngram pays)")
    req.add_argument("--num-requests", type=_positive_int, default=32, help="requests per run (default 32)")
    req.add_argument("--input-len", type=_positive_int, default=128,
                     help="prompt length in words, about one token each (default 128)")
    req.add_argument("--output-len", type=_positive_int, default=64, help="max_tokens of each request (default 64)")
    req.add_argument("--seed", type=int, default=0, help="seed of the prompts and the Poisson arrivals")
    req.add_argument("--no-ignore-eos", action="store_true",
                     help="do not send ignore_eos (for a server that refuses it; the model may then stop early)")
    req.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                     help="a JSON object merged into every request body (server-specific options)")
    req.add_argument("--timeout", type=_positive_float, default=600.0,
                     help="seconds one request may wait between two reads (default 600)")
    load = ap.add_argument_group("load (one of --concurrency, --sweep, --request-rate; default --concurrency 4)")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=_positive_int, metavar="C", help="closed loop with C workers")
    mode.add_argument("--sweep", type=_int_list, metavar="C1,C2,...", help="closed loop at each concurrency")
    mode.add_argument("--request-rate", type=_positive_float, metavar="R",
                      help="open loop: Poisson arrivals at R requests/s")
    load.add_argument("--max-concurrency", type=_positive_int, metavar="M",
                      help="with --request-rate: at most M requests in flight")
    load.add_argument("--warmup", type=_non_negative_int, default=2, metavar="K",
                      help="K requests per server before measuring, not counted (default 2)")
    target.add_argument("--weights", metavar="FILE.gguf", default=None,
                        help="the served GGUF file: print one user's memory-bandwidth floor (the bytes a decode step "
                             "reads of it / this machine's read bandwidth, measured before the runs) beside TPOT")
    out = ap.add_argument_group("outputs")
    out.add_argument("--json", metavar="PATH", help="write the configuration, every run and every request to PATH")
    out.add_argument("--plot", metavar="PATH",
                     help="write output tokens/s and TTFT p99 against the load, one line per server, as a PNG")
    args = ap.parse_args(argv)

    if args.max_concurrency is not None and args.request_rate is None:
        ap.error("--max-concurrency needs --request-rate (a closed loop's concurrency is --concurrency)")
    if args.compare:
        if args.base_url is not None or args.label is not None:
            ap.error("give either --compare LABEL=URL ... or --base-url/--label, not both")
        servers = args.compare
        labels = [s.label for s in servers]
        if len(set(labels)) != len(labels):
            ap.error(f"--compare labels must differ, got {', '.join(labels)}")
    else:
        base = (args.base_url or DEFAULT_BASE_URL).rstrip("/")
        if not base.startswith(("http://", "https://")):
            ap.error(f"--base-url must start with http:// or https://, got {base!r}")
        servers = [Server(args.label or base.split("://", 1)[1].split("/", 1)[0], base)]
    if args.baseline is not None and args.baseline not in [s.label for s in servers]:
        ap.error(f"--baseline {args.baseline!r} is none of the labels: {', '.join(s.label for s in servers)}")
    args.baseline = args.baseline or servers[0].label
    for s in servers:
        s.model = args.model
    if args.request_rate is not None:
        loads = [{"mode": "rate", "request_rate": args.request_rate, "max_concurrency": args.max_concurrency}]
    else:
        loads = [{"mode": "concurrency", "concurrency": c} for c in (args.sweep or [args.concurrency or 4])]
    if args.plot:
        from pagedserve.experiments import plots

        try:
            plots._pyplot()
        except ImportError as e:
            ap.error(str(e))
        plots.require_writable(ap, args.plot)
    if args.json:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "a"):
                pass
        except OSError as e:
            ap.error(f"--json: {e}")
    return args, servers, loads


async def run_benchmark(args, servers: list[Server], loads: list[dict], log=print) -> dict:
    """Every load against every server, one server after another; returns the
    results as --json writes them. Raises ServerUnreachable before any
    measurement when a server does not answer."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient() as client:  # all reachable before a long run starts
        for s in servers:
            await resolve_server(client, s, headers)
    runs = []
    for s in servers:
        runs += await bench_server(s, args, loads, headers, log=log)
    config = {k: v for k, v in vars(args).items() if k not in ("compare", "api_key")}
    return {"benchmark": "serving", "config": config,
            "servers": [asdict(s) for s in servers], "runs": runs,
            "ratios": ratios(runs, args.baseline) if len(servers) > 1 else [],
            "token_check_passed": all(r["token_check_passed"] for r in runs)}


def _json_safe(x):
    """nan/inf -> None (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the benchmark with command-line flags argv (default sys.argv[1:]) and
    prints its tables. prog: the command name --help shows (default: the
    script's file name). Exits with status 1 when a request failed the token
    check, 2 on bad flags or an unreachable server."""
    args, servers, loads = parse_args(argv, prog)
    name = prog or os.path.basename(sys.argv[0])
    args.floor = None
    if args.weights:
        from pagedserve.bench import bandwidth

        try:
            nbytes = bandwidth.decode_bytes_per_token(args.weights)
        except (OSError, ValueError) as e:
            print(f"{name}: error: --weights {args.weights}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        bw = bandwidth.read_bandwidth()
        args.floor = {"file": os.path.basename(args.weights), "bytes": nbytes, "bandwidth": bw,
                      "ms": nbytes / bw * 1e3}
    try:
        result = asyncio.run(run_benchmark(args, servers, loads, log=lambda m: print(m, flush=True)))
    except ServerUnreachable as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print()
    print(format_report(result["runs"], result["ratios"], args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json_safe(result), f, indent=1)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(result["runs"], args.plot, title=f"{args.num_requests} requests per point, {args.input_len} words in, "
                                              f"{args.output_len} tokens out")
        print(f"wrote {args.plot}")
    if not result["token_check_passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
