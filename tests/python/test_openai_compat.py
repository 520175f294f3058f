"""Issue 5: what an OpenAI client relies on — stop strings, SSE exactness,
context-length errors, echo + logprobs against Hugging Face, seeds, the
parameters we refuse, multi-prompt requests, /metrics — against the real
server process (session fixture `server`), real `openai` client, raw httpx
where the bytes matter."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from serverlib import MODEL, metrics, wait_idle

MAX_MODEL_LEN = 2048  # the session server's --max-model-len
# SmolLM2 does not continue "Continue the alphabet: ABC" on its own; one example line makes it write "DEFGHIJ...".
ALPHABET = "Continue the alphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ\nContinue the alphabet: ABC"


def post(server, path, body, **kw):
    return httpx.post(server + path, json=body, timeout=120, **kw)


def sse_events(server, path, body) -> tuple[bytes, list]:
    """Raw body of a streamed request and its parsed events ("[DONE]" kept as a string)."""
    with httpx.stream("POST", server + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ") and b"\n" not in block, block
        data = block[6:].decode()
        events.append(data if data == "[DONE]" else json.loads(data))
    return raw, events


# ---- stop strings ------------------------------------------------------------
def test_stop_string_is_never_streamed_even_in_part(server):
    body = {"model": MODEL, "prompt": ALPHABET, "temperature": 0, "max_tokens": 12}
    free = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert free.startswith("DEFGHIJ")  # the model does write the stop string
    _, events = sse_events(server, "/v1/completions", {**body, "stop": "DEFGHIJ"})
    chunks = [e for e in events if e != "[DONE]"]
    assert all("D" not in c["choices"][0]["text"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_held_back_for_a_possible_stop_is_released_when_it_cannot_match(server):
    body = {"model": MODEL, "prompt": ALPHABET, "temperature": 0, "max_tokens": 12}
    free = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    # "DEFGHI" could still become "DEFGHIK" and is held back; "J" rules it out and releases it
    _, events = sse_events(server, "/v1/completions", {**body, "stop": "DEFGHIK"})
    texts = [e["choices"][0]["text"] for e in events if e != "[DONE]"]
    first = next(t for t in texts if t)
    assert first.startswith("DEFGHIJ")
    assert "".join(texts) == free


def test_stop_string_ending_inside_a_token(client):
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    free = client.completions.create(**kw).choices[0].text
    assert "Paris" in free
    cut = client.completions.create(stop="Pari", **kw).choices[0]
    assert cut.text == free[:free.index("Pari")]
    assert cut.finish_reason == "stop"


def test_chat_stop_list(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10"}], temperature=0,
              max_tokens=60)
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert "7" in free
    cut = client.chat.completions.create(stop=["7"], **kw).choices[0]
    assert "7" not in cut.message.content and cut.finish_reason == "stop"
    assert cut.message.content == free[:free.index("7")]


# ---- SSE exactness -------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three fruits."}], "temperature": 0,
        "max_tokens": 20}


def test_chat_stream_bytes_and_usage_chunk(server):
    full = post(server, "/v1/chat/completions", CHAT).json()
    raw, events = sse_events(server, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert raw.endswith(b"data: [DONE]\n\n") and events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == full["usage"]["total_tokens"]
    assert usage_chunk["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extra", [{}, {"stream_options": {}}, {"stream_options": {"include_usage": False}}])
def test_no_usage_chunk_unless_asked(server, extra):
    raw, events = sse_events(server, "/v1/chat/completions", {**CHAT, **extra})
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = events[:-1]
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


def test_completion_stream_usage_chunk(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=10)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


# ---- context length, empty input, bad bodies ---------------------------------------
@pytest.mark.parametrize("prompt_len,max_tokens", [(MAX_MODEL_LEN + 1, 1), (10, MAX_MODEL_LEN - 9)])
def test_context_overflow_by_one_names_the_lengths(server, client, prompt_len, max_tokens):
    prompt = [random.Random(prompt_len).randrange(100, 40000) for _ in range(prompt_len)]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in msg and str(prompt_len) in msg and str(prompt_len + max_tokens) in msg
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    ok = client.completions.create(model=MODEL, prompt=prompt[:10], max_tokens=MAX_MODEL_LEN - 10,
                                   temperature=0, extra_body={"stop_token_ids": list(range(49152))})  # any token stops it
    assert ok.choices[0].finish_reason == "stop" and ok.usage.completion_tokens == 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": [""]}, "prompt[0]"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi", ""]}, "prompt[1]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
])
def test_empty_prompts_are_400(server, client, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_one_rejected_prompt_of_several_is_400_and_aborts_the_others(server):
    before = wait_idle(server)
    too_long = [11] * (MAX_MODEL_LEN - 8)
    for stream in (False, True):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": [[2, 3, 4], too_long], "max_tokens": 1500,
                                             "ignore_eos": True, "stream": stream})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        m = wait_idle(server, timeout=1.0)
        assert m["vllm:num_requests_running"] == 0
        assert m["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "\ud800", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/v1/completions", {"model": MODEL, "prompt": [True, False]}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}),
])
def test_more_bad_input_is_400(server, client, path, body):
    # json.dumps writes a lone surrogate as \\ud800: valid JSON, not valid Unicode text
    r = httpx.post(server + path, content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_developer_role_and_assistant_without_content(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None}, {"role": "user", "content": "Hi again"}])
    assert r.usage.completion_tokens >= 1


def test_wrong_method_is_405_with_allow(server):
    r = httpx.get(server + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{"content-type": "application/json"}, {}])
def test_body_that_is_not_json_is_a_json_400(server, headers):
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "hi",', headers=headers, timeout=30)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": " the end"}, "suffix"),
])
def test_unimplemented_parameters_are_refused_by_name(server, path, extra, param):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = post(server, path, {**base, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_harmless_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
        max_completion_tokens=3, temperature=0, user="u-1", response_format={"type": "text"},
        extra_body={"some_unknown_field": 1, "ignore_eos": True})
    assert r.usage.completion_tokens == 3


# ---- echo + logprobs, chat logprobs ----------------------------------------------
@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(smollm2_dir))


def test_echo_prompt_logprobs_match_hugging_face(client, hf_model):
    model, tok = hf_model
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tok(prompt).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):  # the second time the prompt is in the prefix cache: still scored
        r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=2,
                                      temperature=0)
        c = r.choices[0]
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens[:len(ids)]) == prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4
            assert 3 <= len(lp.top_logprobs[i]) <= 4
        tops = [tuple(sorted(t)) for t in lp.top_logprobs[1:]]
        assert len(set(tops)) > 1  # the alternatives change with the position
        # the first output token is greedy: the most likely after the prompt
        assert abs(lp.token_logprobs[len(ids)] - ref[-1].max().item()) < 1e-4


def test_logprobs_without_echo_cover_only_the_output(client):
    r = client.completions.create(model=MODEL, prompt="Hello", logprobs=0, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) == 1 for t in lp.top_logprobs)  # 0 alternatives + the sampled token


def test_chat_logprobs(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=6,
              logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy picks the top one
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token
    streamed = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    assert [t.logprob for c in streamed for t in c.choices[0].logprobs.content] == [t.logprob for t in content]


# ---- seeds, penalties, multi-prompt ----------------------------------------------------
def test_seed_is_reproducible_next_to_unseeded_traffic(client):
    seeded = dict(model=MODEL, prompt="My favourite animal is", temperature=0.8, max_tokens=16, seed=1234)
    unseeded = dict(model=MODEL, prompt="A short poem:", temperature=1.0, max_tokens=24)
    texts = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(4):
            a, b = pool.submit(client.completions.create, **seeded), pool.submit(client.completions.create, **unseeded)
            texts.append(a.result().choices[0].text)
            b.result()
    assert len(set(texts)) == 1 and texts[0]
    other = client.completions.create(**{**seeded, "seed": 99}).choices[0].text
    assert other != texts[0]


def test_penalties_and_min_p_are_honoured(client):
    kw = dict(model=MODEL, prompt="List of fruits: apple, banana,", temperature=0, max_tokens=16,
              extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].text
    assert base.count(" pear") >= 3  # greedy SmolLM2 loops on " pear"
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 1.5, "ignore_eos": True}}):
        text = client.completions.create(**{**kw, **extra}).choices[0].text
        assert text.count(" pear") < base.count(" pear"), (extra, text)
    # min_p 1.0 keeps only the most likely token: sampling at temperature 1 becomes greedy
    mp = client.completions.create(**{**kw, "temperature": 1.0, "seed": 5,
                                      "extra_body": {"min_p": 1.0, "ignore_eos": True}})
    assert mp.choices[0].text == base


def test_several_prompts_give_choices_in_order(client):
    prompts = ["The capital of France is", "One, two, three,"]
    kw = dict(model=MODEL, temperature=0, max_tokens=6)
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    single_usage = sum(client.completions.create(prompt=p, **kw).usage.prompt_tokens for p in prompts)
    assert r.usage.prompt_tokens == 2 * single_usage // 2
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert list(streamed.values()) == [c.text for c in r.choices]
    tok = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize", json={"prompt": prompts[1]}).json()
    by_ids = client.completions.create(prompt=[tok["tokens"]], **kw)
    assert by_ids.choices[0].text == singles[1]


# ---- other endpoints ------------------------------------------------------------------
def test_tokenize_detokenize_version(server):
    t = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    usage = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert httpx.get(server + "/version").json()["version"]


def test_metrics_move_by_the_known_request(server):
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
             "vllm:generation_tokens_total", "vllm:num_preemptions_total",
             "vllm:request_success_total{finished_reason=length}"]
    hists = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
             "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
             "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]
    before = wait_idle(server)
    for n in names + [h + "_count" for h in hists]:
        assert n in before, n
    prompt = [random.Random(7).randrange(1000, 40000) for _ in range(37)]  # random ids: no prefix-cache hit
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 9, "ignore_eos": True,
                                         "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 9
    after = wait_idle(server)
    delta = {k: after[k] - before[k] for k in after if k in before}
    assert delta["vllm:prompt_tokens_total"] == 37 and delta["vllm:generation_tokens_total"] == 9
    assert delta["vllm:prefix_cache_queries_total"] == 37 and delta["vllm:prefix_cache_hits_total"] == 0
    assert delta["vllm:request_success_total{finished_reason=length}"] == 1
    assert delta["vllm:request_prompt_tokens_sum"] == 37 and delta["vllm:request_generation_tokens_sum"] == 9
    for h in ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens"]:
        assert delta[h + "_count"] == 1, h
    assert delta["vllm:inter_token_latency_seconds_count"] == 8
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_completions_default_to_16_tokens_like_openai(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
