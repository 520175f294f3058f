"""Scheduling policies through the whole engine (tiny Llama, float32): a policy
changes the order of service, never the tokens; priority serves a late
high-priority request ahead of the queue; the request field and CLI flag reach
the C++ scheduler."""

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.errors import RequestRejectedError

PROMPT_LENS = [5, 40, 70, 18, 130, 9, 64, 33, 100, 12, 51, 27]


def prompts(vocab: int = 512, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def engine(model_dir, policy: str, **kw) -> LLM:
    # a small pool and step so the FCFS run preempts and chunks
    args = dict(model=model_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=20,
                max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, scheduling_policy=policy)
    args.update(kw)
    return LLM(**args)


def greedy(llm: LLM, ps, priority=None) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * (i % 4), ignore_eos=True) for i in range(len(ps))]
    outs = llm.generate(ps, params, use_tqdm=False, priority=priority)
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def fcfs_outputs(tiny_llama_dir):
    llm = engine(tiny_llama_dir, "fcfs")
    out = greedy(llm, prompts())
    assert llm.engine.num_preemptions > 0, "the scenario must make FCFS preempt"
    return out


def test_priority_policy_changes_order_not_tokens(tiny_llama_dir, fcfs_outputs):
    llm = engine(tiny_llama_dir, "priority")
    ps = prompts()
    assert greedy(llm, ps, priority=[(7 * i) % 5 - 2 for i in range(len(ps))]) == fcfs_outputs


def test_memory_aware_policy_changes_order_not_tokens(tiny_llama_dir, fcfs_outputs):
    llm = engine(tiny_llama_dir, "memory-aware", watermark=0.1, high_watermark=0.6)
    assert greedy(llm, prompts()) == fcfs_outputs


def test_high_priority_request_overtakes_a_full_queue(tiny_llama_dir):
    """33 requests on an engine that runs 4 at a time: the last one, with the
    best priority, gets its first token before most of the 32 ahead of it."""
    llm = engine(tiny_llama_dir, "priority", num_kv_blocks=64, max_num_seqs=4)
    eng = llm.engine
    ps = prompts(seed=3) * 3  # 36 prompts
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(32):
        eng.add_request(ps[i], params, request_id=f"low-{i}", priority=10)
    for _ in range(3):  # the engine is full and busy
        eng.step()
    assert eng.scheduler.num_running == 4 and eng.scheduler.num_waiting == 28
    eng.add_request(ps[32], params, request_id="high", priority=0)
    first_token_order = []
    while eng.has_unfinished_requests():
        for out in eng.step():  # an output = the request sampled this step
            if out.request_id not in first_token_order:
                first_token_order.append(out.request_id)
    assert len(first_token_order) == 33
    rank = first_token_order.index("high")
    # the 4 running when it arrived may already have sampled; it preempts one of them
    assert rank <= 5, first_token_order
    assert eng.num_preemptions >= 1
    assert eng.num_free_blocks == eng.num_kv_blocks


def test_priority_needs_the_priority_policy(tiny_llama_dir):
    llm = engine(tiny_llama_dir, "fcfs")
    with pytest.raises(RequestRejectedError, match="priority scheduling policy"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=3)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="priorities for"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 1])


@pytest.mark.parametrize("bad,exc", [(1.5, TypeError), ("1", TypeError), (True, TypeError), ([None, 1], TypeError),
                                     (2**31, ValueError), (-2**31 - 1, ValueError), ([0, 1, 2], ValueError)])
def test_bad_priorities_are_refused_cleanly(tiny_llama_dir, bad, exc):
    llm = engine(tiny_llama_dir, "priority")
    with pytest.raises(exc, match="priorit"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2), use_tqdm=False, priority=bad)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=(-2**31,))) == 1


def test_n_above_max_num_seqs_is_refused(tiny_llama_dir):
    llm = engine(tiny_llama_dir, "fcfs", max_num_seqs=2)
    with pytest.raises(RequestRejectedError, match="max_num_seqs"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, n=3), use_tqdm=False)


@pytest.mark.parametrize("bad", [dict(scheduling_policy="lifo"), dict(watermark=1.0), dict(watermark=-0.5),
                                 dict(high_watermark=0.0), dict(high_watermark=float("nan")),
                                 dict(watermark=True), dict(watermark="0.1")])
def test_bad_policy_arguments_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        EngineArgs(**bad)


def test_cli_flags():
    import argparse

    ap = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(ap.parse_args(["--scheduling-policy", "memory-aware", "--watermark", "0.2",
                                                   "--high-watermark", "0.8"]))
    assert (args.scheduling_policy, args.watermark, args.high_watermark) == ("memory-aware", 0.2, 0.8)
    with pytest.raises(SystemExit):
        ap.parse_args(["--scheduling-policy", "random"])


# ---- through the server ----------------------------------------------------------------
def test_server_honours_priority_under_the_priority_policy(tiny_llama_dir):
    import httpx
    from serverlib import metrics, start_server, stop_server

    proc, base = start_server("--model", tiny_llama_dir, "--dtype", "float32", "--skip-tokenizer-init",
                              "--scheduling-policy", "priority", "--num-kv-blocks", "32")
    try:
        body = {"model": tiny_llama_dir, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}
        plain = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert plain.status_code == 200, plain.text
        for prio in (-3, 0, 7):
            r = httpx.post(base + "/v1/completions", json={**body, "priority": prio}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        m = metrics(base)
        for prio in ("-3", "0", "7"):
            assert m[f"pagedserve:request_queue_time_by_priority_seconds_count{{priority={prio}}}"] >= 1
        r = httpx.post(base + "/v1/completions", json={**body, "priority": 2**31}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    finally:
        stop_server(proc)


def test_server_refuses_priority_under_fcfs(server):
    import httpx
    from serverlib import MODEL

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(server + "/v1/chat/completions", json={**body, "priority": 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    assert httpx.post(server + "/v1/chat/completions", json={**body, "priority": 0}, timeout=60).status_code == 200
    assert "request_queue_time_by_priority" not in httpx.get(server + "/metrics", timeout=10).text


def test_server_refuses_n_above_max_num_seqs(tiny_llama_dir):
    import httpx
    from serverlib import start_server, stop_server

    proc, base = start_server("--model", tiny_llama_dir, "--dtype", "float32", "--skip-tokenizer-init",
                              "--max-num-seqs", "2", "--num-kv-blocks", "16")
    try:
        body = {"model": tiny_llama_dir, "prompt": [5, 6, 7], "max_tokens": 2}
        r = httpx.post(base + "/v1/completions", json={**body, "n": 3}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert httpx.post(base + "/v1/completions", json={**body, "n": 2}, timeout=60).status_code == 200
    finally:
        stop_server(proc)
