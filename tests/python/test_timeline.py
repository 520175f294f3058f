"""Issue 31 part 1: per-request timelines. Through a tiny KV pool a request's
timeline shows its chunked prefill, its preemption (with the scheduler's
reason) and the recompute after it, and a second request with the same prompt
shows its prefix-cache hit at its first step; the step numbers are the
engine's. Over HTTP: `timeline: true` returns it with the response, GET
/v1/requests/{id}/timeline shows a running request's, and a finished one's
is gone without --request-timelines."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from pagedserve import LLM, SamplingParams
from serverlib import MODEL

BLOCK = 16


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(eng, on_step=None) -> dict:
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if on_step is not None:
                on_step(out)
            if out.finished:
                final[out.request_id] = out
    return final


def test_chunked_prefill_preemption_recompute_and_prefix_hit(tiny_llama_dir, tmp_path):
    trace = tmp_path / "steps.jsonl"  # the scheduler's own record of each step, to check the timelines against
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8,
              max_num_batched_tokens=BLOCK, request_timelines=4, trace_steps=str(trace))
    eng = llm.engine
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    a, b = _prompt(1, 40), _prompt(2, 40)
    eng.add_request(a, params, "a")
    eng.add_request(b, params, "b")
    steps_run = []
    final = _run(eng, on_step=lambda out: steps_run.append(eng.num_steps))
    assert eng.num_preemptions > 0
    timelines = {rid: out.timeline for rid, out in final.items()}
    victims = [rid for rid, t in timelines.items() if t["num_preemptions"]]
    assert victims, timelines
    for rid, t in timelines.items():
        assert t["status"] == "finished" and t["num_prompt_tokens"] == 40
        steps = t["steps"]
        assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})  # one entry per step (n = 1)
        assert all(1 <= s["step"] <= eng.num_steps for s in steps)
        first_prefill = [s for s in steps if s["phase"] == "prefill"]
        # the prompt's chunks: at most 16 tokens each, contiguous, covering the 40 prompt tokens once
        assert first_prefill[0]["num_computed_tokens"] == 0
        assert all(s["num_scheduled_tokens"] <= BLOCK for s in first_prefill)
        assert sum(s["num_scheduled_tokens"] for s in first_prefill) >= 40
        decodes = [s for s in steps if s["phase"] == "decode"]
        assert all(s["num_scheduled_tokens"] == 1 for s in decodes)
        assert t["num_output_tokens"] == [60]
        assert 0 <= t["queue_time_s"] <= t["ttft_s"] <= t["e2e_s"] and t["tpot_s"] > 0
        assert max(s["num_blocks"] for s in steps) == t["peak_num_blocks"] <= 8
        assert t["events"][-1]["event"] == "finished" and t["events"][-1]["finish_reasons"] == ["length"]
    # each entry at the step the scheduler decided it (its decision as the step trace recorded it)
    decisions = {r["step"]: r["decision"] for r in map(json.loads, trace.read_text().splitlines())
                 if r["op"] == "schedule" and r["decision"]["request_ids"]}
    for rid, t in timelines.items():
        for s in t["steps"]:
            d = decisions[s["step"]]
            b = d["request_ids"].index(rid)
            assert (s["num_computed_tokens"], s["num_scheduled_tokens"]) == (d["num_computed_tokens"][b],
                                                                              d["num_scheduled_tokens"][b])
        for e in t["events"]:
            if e["event"] == "preempted":
                d = decisions[e["step"]]
                assert rid in d["preempted_request_ids"]
                assert d["preemption_reasons"][d["preempted_request_ids"].index(rid)] == e["reason"]
    v = timelines[victims[0]]
    preempted = [e for e in v["events"] if e["event"] == "preempted"]
    recomputes = [e for e in v["events"] if e["event"] == "recompute"]
    assert preempted[0]["reason"] == "kv_blocks" and len(recomputes) == v["num_preemptions"] == len(preempted)
    # the recompute is the victim's first step after the preemption, and recomputes what it had
    for p, r in zip(preempted, recomputes):
        after = [s for s in v["steps"] if s["step"] >= p["step"]]
        assert after[0]["step"] == r["step"] > p["step"]
        before = [s for s in v["steps"] if s["step"] < p["step"]][-1]
        had = before["num_computed_tokens"] + before["num_scheduled_tokens"]
        assert r["num_tokens_to_recompute"] == had - after[0]["num_computed_tokens"] > 0
        assert after[0]["phase"] == "recompute"
    # a third request with a's prompt reads a's full blocks from the prefix cache at its first step
    eng.add_request(a, params, "c")
    c = _run(eng)["c"].timeline
    hit = [e for e in c["events"] if e["event"] == "prefix_cache_hit"]
    # (as many of its 2 full blocks as the 8-block pool still holds after b)
    assert hit and hit[0]["step"] == c["steps"][0]["step"] and hit[0]["num_tokens"] in (16, 32)
    assert c["steps"][0]["num_computed_tokens"] == hit[0]["num_tokens"] == c["num_cached_tokens"]
    # kept: the last 4 finished
    assert eng.timelines.get("a") is not None and eng.timelines.get("c") is not None


def test_off_by_default_records_nothing(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)
    out = llm.generate([_prompt(3, 20)], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert out.timeline is None and not llm.engine.timelines.live and not llm.engine.timelines.finished
    eng = llm.engine
    eng.add_request(_prompt(3, 20), SamplingParams(max_tokens=4), "asked", timeline=True)
    assert _run(eng)["asked"].timeline["status"] == "finished"
    assert eng.timelines.get("asked") is None  # nothing kept without request_timelines


def test_timeline_over_http(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "timeline": True}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    (t,) = r["timeline"]
    assert t["request_id"] == r["id"] and t["status"] == "finished"
    assert t["num_output_tokens"] == [r["usage"]["completion_tokens"]]
    assert t["steps"][0]["phase"] == "prefill" and t["steps"][-1]["phase"] == "decode"
    plain = httpx.post(server + "/v1/completions", json={**body, "timeline": False}, timeout=60).json()
    assert "timeline" not in plain
    chat = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "timeline": True}).json()
    assert chat["timeline"][0]["request_id"] == chat["id"]
    # finished, and this server keeps none (--request-timelines 0)
    gone = httpx.get(f"{server}/v1/requests/{r['id']}/timeline", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "request_id"


def _events(server, route, body):
    with httpx.stream("POST", server + route, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_a_streamed_request_gets_its_timeline_in_the_last_chunk(server):
    body = {"model": MODEL, "prompt": ["Once upon a time", "The capital of France"], "max_tokens": 8,
            "temperature": 0, "timeline": True, "stream_options": {"include_usage": True}}
    events = _events(server, "/v1/completions", body)
    last = events[-1]
    assert last["choices"] == [] and len(last["timeline"]) == 2 and "timeline" not in events[-2]
    usage = events[-2]["usage"]  # the usage chunk comes before it
    for i, t in enumerate(last["timeline"]):
        assert t["status"] == "finished" and t["request_id"] == f"{last['id']}-{i}"
        assert t["steps"][0]["phase"] == "prefill"
    assert sum(t["num_output_tokens"][0] for t in last["timeline"]) == usage["completion_tokens"]
    assert all("timeline" not in e for e in _events(server, "/v1/completions", {**body, "timeline": False}))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "timeline": True}
    events = _events(server, "/v1/chat/completions", chat)
    (t,) = events[-1]["timeline"]
    assert events[-1]["choices"] == [] and t["request_id"] == events[-1]["id"] and t["status"] == "finished"
    assert 1 <= t["num_output_tokens"][0] <= 4
    # the openai SDK reads the stream as it always does; the extension rides on the last chunk
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(stream=True, extra_body={"timeline": True},
                                                 **{k: v for k, v in chat.items() if k != "timeline"}))
    assert chunks[-1].choices == [] and chunks[-1].model_extra["timeline"][0]["status"] == "finished"


def test_running_request_timeline(server):
    done = {}

    def long_request():
        done["r"] = httpx.post(server + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "timeline": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    seen = None
    deadline = time.time() + 60
    while time.time() < deadline and thread.is_alive() and seen is None:
        for rid in httpx.get(server + "/v1/requests", timeout=10).json()["running"]:
            got = httpx.get(f"{server}/v1/requests/{rid}/timeline", timeout=10)
            if got.status_code == 200 and len(got.json()["steps"]) > 3:
                seen = got.json()
        time.sleep(0.05)
    thread.join()
    assert seen is not None and seen["status"] == "running" and "e2e_s" not in seen
    final = done["r"].json()["timeline"][0]
    assert final["request_id"] == seen["request_id"] == done["r"].json()["id"]
    assert final["steps"][:len(seen["steps"])] == seen["steps"]  # the live view was a prefix of the whole


def test_refused_requests_record_nothing_and_client_ids_are_found(tiny_llama_dir):
    from pagedserve import PoolingParams
    from pagedserve.engine.timeline import Timelines

    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=4,
              request_timelines=2)
    eng = llm.engine
    with pytest.raises(ValueError):  # more blocks than the pool: the scheduler refuses it
        eng.add_request(_prompt(7, 100), SamplingParams(max_tokens=2), "refused", timeline=True)
    assert not eng.timelines.live and eng.timelines.get("refused") is None
    eng.add_request(_prompt(8, 10), PoolingParams(), "embedding")
    _run(eng)
    assert eng.timelines.get("embedding").to_dict()["ttft_s"] is None  # an embedding has no first token
    assert eng.timelines.get("embedding").to_dict()["num_output_tokens"] == [0]
    # the server's engine id for a client's X-Request-Id "abc" is "cmpl-abc-<8 hex>"; the response id finds it
    tl = Timelines(2)
    tl.start("cmpl-abc-0123abcd", 3, 0.0)
    assert tl.get("cmpl-abc") is tl.get("cmpl-abc-0123abcd") is not None and tl.get("cmpl-ab") is None
