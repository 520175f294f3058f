"""Issue 30 part 1, scoring: `echo` with `max_tokens: 0` returns the prompt and
its logprobs and generates nothing; vLLM's `prompt_logprobs` on completions and
chat; /tokenizer_info (what lm-evaluation-harness's remote tokenizer reads).
Against the session SmolLM2 server (float32)."""

from __future__ import annotations

import json

import httpx
import pytest

from serverlib import MODEL

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of"]


def post(server, path, body):
    return httpx.post(server + path, json=body, timeout=120)


def tokenize(server, text):
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def ordinary_echo(server, prompt, logprobs=2):
    """An echo request that generates 2 tokens: its prompt part is the reference."""
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": logprobs,
                                         "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]


def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs_of_an_ordinary_request(server):
    body = {"model": MODEL, "prompt": PROMPTS, "echo": True, "logprobs": 2, "max_tokens": 0, "n": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 4
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == sum(len(tokenize(server, p)) for p in PROMPTS)
    for c in out["choices"]:
        prompt = PROMPTS[c["index"] // 2]
        n = len(tokenize(server, prompt))
        ref = ordinary_echo(server, prompt)
        assert c["text"] == prompt and c["finish_reason"] == "length"
        lp = c["logprobs"]
        assert len(lp["tokens"]) == n and "".join(lp["tokens"]) == prompt
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"] == ref["token_logprobs"][:n]  # the same floats: same forward, same kernels
        assert lp["top_logprobs"] == ref["top_logprobs"][:n]


def test_echo_with_max_tokens_0_streams_only_the_prompt(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == PROMPTS[0]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 0
    tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == len(tokenize(server, PROMPTS[0]))


def check_prompt_logprobs(entries, ids, k, ref_logprobs):
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}}
    with the prompt's token and the k most likely (ranks 1..k)."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        d = {int(t): v for t, v in entries[i].items()}
        assert ids[i] in d and k <= len(d) <= k + 1
        mine = d[ids[i]]
        assert mine["logprob"] == ref_logprobs[i] and mine["rank"] >= 1
        others = sorted((v for t, v in d.items() if t != ids[i] or v["rank"] <= k), key=lambda v: v["rank"])
        assert [v["rank"] for v in others][:k] == list(range(1, k + 1))
        best = max(v["logprob"] for v in d.values())
        assert (mine["rank"] == 1) == (mine["logprob"] == best)


def test_prompt_logprobs_on_completions_without_echo(server):
    ids = tokenize(server, PROMPTS[0])
    ref = ordinary_echo(server, PROMPTS[0])["token_logprobs"]
    for max_tokens in (0, 3):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "prompt_logprobs": 3,
                                             "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert (c["text"] == "") == (max_tokens == 0)
        check_prompt_logprobs(c["prompt_logprobs"], ids, 3, ref)


def test_echo_and_prompt_logprobs_each_keep_their_own_number_of_alternatives(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "echo": True, "logprobs": 1,
                                         "prompt_logprobs": 4, "max_tokens": 0})
    c = r.json()["choices"][0]
    assert all(len(t) <= 2 for t in c["logprobs"]["top_logprobs"][1:])
    check_prompt_logprobs(c["prompt_logprobs"], tokenize(server, PROMPTS[1]), 4,
                          c["logprobs"]["token_logprobs"])


def test_prompt_logprobs_on_chat_cover_the_rendered_prompt(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "prompt_logprobs": 0,
                                              "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    assert all(list(map(int, e)) == [t] for e, t in zip(entries[1:], ids[1:]))
    # the same prompt through completions (token ids) scores the same
    ref = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 0,
                                           "max_tokens": 0}).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == ref[1:]


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_scoring_requests_that_cannot_be_answered_are_400s(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") or param in err["message"]


def test_scoring_a_prompt_that_fills_the_context_says_why_not(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [504] * 2048, "max_tokens": 0,
                                         "prompt_logprobs": 0})
    assert r.status_code == 400 and "one token of the context free" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [504] * 2048, "max_tokens": 0,
                                         "prompt_logprobs": 0, "truncate_prompt_tokens": 2047})
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == 2047


def test_tokenizer_info_names_the_special_tokens(server):
    info = httpx.get(server + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] and tokenize(server, info["eos_token"])[-1] in range(info["vocab_size"])
    assert "{%" in info["chat_template"] and info["model_max_length"] == 2048
