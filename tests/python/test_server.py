"""The OpenAI-compatible server, as a real uvicorn process on a free loopback
port, driven by the real `openai` client (and raw httpx where bytes matter)."""

import json
import time

import httpx
import pytest

from serverlib import MODEL, metrics, wait_idle

MAX_MODEL_LEN = 2048


def ask_paris(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=40, **kw)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_created_is_the_same_in_every_listing(server):
    first = httpx.get(server + "/v1/models").json()["data"][0]["created"]
    time.sleep(1.1)  # `created` in seconds: a per-response timestamp would move
    assert httpx.get(server + "/v1/models").json()["data"][0]["created"] == first <= time.time()


def test_x_request_id_is_echoed_or_generated_and_names_the_completion(server):
    """vLLM's convention: a client's X-Request-Id comes back in the header and in the response id; without one
    the server makes one up (the same in both). Two requests with one id at once are both served."""
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0}
    mine = httpx.post(server + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-42"
    assert mine.json()["id"] == "cmpl-trace-42"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    made = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60)
    rid = made.headers["x-request-id"]
    assert len(rid) == 32 and made.json()["id"] == f"chatcmpl-{rid}"
    assert httpx.get(server + "/v1/models").headers["x-request-id"] != rid  # one per request, errors included
    bad = httpx.post(server + "/v1/completions", json={**body, "max_tokens": -1}, headers={"X-Request-Id": "t-9"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "t-9"
    unusable = httpx.post(server + "/v1/completions", json=body, headers={"X-Request-Id": "x" * 129}, timeout=60)
    assert unusable.headers["x-request-id"] != "x" * 129 and len(unusable.headers["x-request-id"]) == 32
    streamed = {**body, "stream": True, "max_tokens": 30}

    def send(i):
        r = httpx.post(server + "/v1/completions", json=streamed if i else body, headers={"X-Request-Id": "same"},
                       timeout=60)
        return r.status_code, r.headers["x-request-id"]

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(send, range(2))) == [(200, "same")] * 2


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, endpoint):
    if endpoint == "chat":
        create = lambda **kw: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], **kw)
    else:
        create = lambda **kw: client.completions.create(model=MODEL, prompt="One, two, three,", **kw)  # noqa: E731
    kw = dict(temperature=0, max_tokens=12, stream=True)
    full = create(temperature=0, max_tokens=12).usage
    chunks = list(create(**kw, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None and u.prompt_tokens == full.prompt_tokens for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[0] < counts[-1] == full.completion_tokens
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    plain = list(create(**kw, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == full.completion_tokens
    # without include_usage there is no usage at all (vLLM: continuous stats ride on include_usage)
    assert all(c.usage is None for c in create(**kw, stream_options={"continuous_usage_stats": True}))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_the_stop_string_or_token_and_the_string_may_stay(server, stream):
    """vLLM's stop_reason and include_stop_str_in_output, on both endpoints."""

    def final(path, body):
        r = httpx.post(server + path, json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0], ("text" if "prompt" in body else "message")
        events = [json.loads(b[6:]) for b in r.content.split(b"\n\n") if b.startswith(b"data: {")]
        text_key = "text" if "prompt" in body else "delta"
        joined = "".join((e["choices"][0].get("text") if text_key == "text" else
                          e["choices"][0]["delta"].get("content")) or "" for e in events if e["choices"])
        last = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
        return {**last, "text": joined}, "text"

    def text(choice, key):
        return choice["message"]["content"] if key == "message" else choice["text"]

    base = {"model": MODEL, "prompt": "One, two, three, four, five, six,", "temperature": 0, "max_tokens": 12}
    free, key = final("/v1/completions", base)
    assert " seven" in text(free, key) and free["stop_reason"] is None
    cut, key = final("/v1/completions", {**base, "stop": ["nine", "seven"]})
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == "seven" and "seven" not in text(cut, key)
    kept, key = final("/v1/completions", {**base, "stop": ["seven"], "include_stop_str_in_output": True})
    assert text(kept, key) == text(cut, key) + "seven" and kept["stop_reason"] == "seven"
    token = httpx.post(server + "/tokenize", json={"prompt": " seven", "add_special_tokens": False}).json()["tokens"]
    by_id, key = final("/v1/completions", {**base, "stop_token_ids": token[:1]})
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == token[0]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta"}],
            "temperature": 0, "max_tokens": 40, "stop": ["gamma"], "include_stop_str_in_output": True}
    said, key = final("/v1/chat/completions", chat)
    assert said["stop_reason"] == "gamma" and text(said, key).endswith("beta gamma")


def test_truncate_prompt_tokens_keeps_the_last_k(server):
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy", "temperature": 0, "max_tokens": 5}
    ids = httpx.post(server + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    cut = httpx.post(server + "/v1/completions", json={**body, "truncate_prompt_tokens": 3}, timeout=60).json()
    tail = httpx.post(server + "/v1/completions", json={**body, "prompt": ids[-3:]}, timeout=60).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = httpx.post(server + "/v1/completions", json={**body, "truncate_prompt_tokens": -1}, timeout=60).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)  # -1: up to max_model_len (all of this one)
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 2,
                 "truncate_prompt_tokens": 100}
    r = httpx.post(server + "/v1/chat/completions", json=long_chat, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100  # too long for the context, cut
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        r = httpx.post(server + "/v1/completions", json={**body, "truncate_prompt_tokens": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_token_filters_min_tokens_logit_bias_and_allowed_token_ids(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0,
            "max_tokens": 40, "logprobs": True}
    short = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).json()
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 30  # ends at EOS
    held = httpx.post(server + "/v1/chat/completions", json={**chat, "min_tokens": n + 5, "max_tokens": n + 5},
                      timeout=60).json()
    assert held["usage"]["completion_tokens"] == n + 5 and held["choices"][0]["finish_reason"] == "length"
    first = short["choices"][0]["logprobs"]["content"]  # the same tokens until EOS was due: logprobs stay raw
    assert held["choices"][0]["logprobs"]["content"][:n - 1] == first[:n - 1]
    ids = httpx.post(server + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    body = {"model": MODEL, "prompt": "My favourite fruit is", "temperature": 0, "max_tokens": 4}
    biased = httpx.post(server + "/v1/completions", json={**body, "logit_bias": {str(ids[0]): 100}}, timeout=60)
    assert biased.status_code == 200 and biased.json()["choices"][0]["text"].startswith(" banana")
    free = httpx.post(server + "/v1/completions", json={**body, "logprobs": 0}, timeout=60).json()["choices"][0]
    first = httpx.post(server + "/tokenize", json={"prompt": free["logprobs"]["tokens"][0],
                                                   "add_special_tokens": False}).json()["tokens"][0]
    forbidden = httpx.post(server + "/v1/completions", json={**body, "logprobs": 0, "logit_bias": {str(first): -100}},
                           timeout=60).json()["choices"][0]
    assert forbidden["logprobs"]["tokens"][0] != free["logprobs"]["tokens"][0]  # -100 takes the greedy token away
    allowed = [ids[0], 13, 198]
    only = httpx.post(server + "/v1/completions", json={**body, "allowed_token_ids": allowed, "logprobs": 0},
                      timeout=60).json()
    texts = {httpx.post(server + "/detokenize", json={"tokens": [a]}).json()["prompt"] for a in allowed}
    got = only["choices"][0]["logprobs"]["tokens"]
    assert len(got) == 4 and set(got) <= texts
    # n = 2 sampled choices, streamed: every token allowed, none before min_tokens ends a choice
    streamed = {**body, "allowed_token_ids": allowed + [2], "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 8,
                "min_tokens": 6, "stop_token_ids": [2], "logprobs": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=streamed, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    for i in range(2):
        toks = [t for e in chunks for c in e["choices"] if c["index"] == i and c["logprobs"]
                for t in c["logprobs"]["tokens"]]
        assert 6 <= len(toks) <= 8 and set(toks) <= texts | {httpx.post(server + "/detokenize", json={
            "tokens": [2]}).json()["prompt"]}
    for bad in ({"min_tokens": 5, "max_tokens": 4}, {"logit_bias": {"x": 1}}, {"logit_bias": {"1": 101}},
                {"logit_bias": {"999999": 1}}, {"allowed_token_ids": []}, {"allowed_token_ids": [10**6]}):
        r = httpx.post(server + "/v1/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400, (bad, r.text)


def test_bad_words_are_never_generated_streamed_or_not(server):
    body = {"model": MODEL, "prompt": "The Eiffel Tower is in the city of", "temperature": 0,
            "max_tokens": 12}
    free = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert "Paris" in free
    banned = {**body, "bad_words": ["Paris"], "n": 2, "temperature": 0.7, "seed": 1}
    r = httpx.post(server + "/v1/completions", json=banned, timeout=60)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and all("Paris" not in t for t in texts)
    with httpx.stream("POST", server + "/v1/completions", json={**banned, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    for i in range(2):
        assert "".join(c["text"] for e in chunks for c in e["choices"] if c["index"] == i) == texts[i]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 20}
    said = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"]
    assert "Paris" in said["content"]
    unsaid = httpx.post(server + "/v1/chat/completions", json={**chat, "bad_words": ["Paris"]}, timeout=60).json()
    assert "Paris" not in unsaid["choices"][0]["message"]["content"]
    r = httpx.post(server + "/v1/completions", json={**body, "bad_words": [" "]}, timeout=60)
    assert r.status_code == 400 and "bad_words" in r.text


def test_chat_answers_paris_with_usage(client):
    r = ask_paris(client)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_joined_equals_non_streamed(client):
    full = ask_paris(client).choices[0].message.content
    chunks = list(ask_paris(client, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_completion_stream_joined_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=30)
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == full.choices[0].text and full.usage.completion_tokens == 30


def test_sse_bytes_end_with_done(server):
    with httpx.stream("POST", server + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}) as r:
        body = b"".join(r.iter_bytes())
    events = body.split(b"\n\n")
    assert body.endswith(b"data: [DONE]\n\n")
    assert all(e.startswith(b"data: ") for e in events if e)


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "JSON"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": list(range(10, 10 + MAX_MODEL_LEN + 1)), "max_tokens": 1}, 400, "context length"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": []}, 400, "empty"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2**40}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, client, body, status, needle):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert httpx.get(server + "/health").status_code == 200
    assert "Paris" in ask_paris(client).choices[0].message.content
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def wait_released(base: str, usage_before: float, timeout: float = 1.0) -> dict[str, float]:
    """Polls /metrics for up to `timeout` s until nothing runs and KV usage is back."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base)
        done = m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == usage_before
        if done or time.time() > deadline:
            return m
        time.sleep(0.02)


def test_stream_closed_after_three_chunks_is_aborted_within_a_second(server):
    before = wait_idle(server)
    with httpx.stream("POST", server + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        got = [next(events) for _ in range(3)]
        assert metrics(server)["vllm:num_requests_running"] == 1
    assert all(json.loads(g[6:])["choices"][0]["finish_reason"] is None for g in got)
    m = wait_released(server, before["vllm:kv_cache_usage_perc"])
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]
    assert m["vllm:request_success_total{finished_reason=abort}"] == \
        before["vllm:request_success_total{finished_reason=abort}"] + 1


def test_non_streamed_client_timeout_is_aborted_within_a_second(server):
    before = wait_idle(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", timeout=1.0, json={
            "model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True})
    m = wait_released(server, before["vllm:kv_cache_usage_perc"])
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]


def test_tiny_temperature_is_greedy_not_an_error(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8)
    tiny = client.completions.create(temperature=1e-30, **kw).choices[0].text
    assert tiny == client.completions.create(temperature=0, **kw).choices[0].text


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "Here is a long shared system prompt about dragons and castles. " * 8
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    salted = client.completions.create(extra_body={"cache_salt": "tenant-x"}, **kw)
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_n_choices_carry_their_index_also_when_streamed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8, seed=7, n=3)
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    texts = {i: "" for i in range(3)}
    finished = set()
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert c.index not in finished
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert texts == {c.index: c.text for c in full.choices}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          temperature=0, max_tokens=6)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content
