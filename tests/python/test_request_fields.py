"""Issue 30: the last vLLM request fields honoured: return_tokens_as_token_ids,
guided_decoding_backend (xgrammar only), chat `echo`, a request's own
`chat_template` (only under --trust-request-chat-template), and
spaces_between_special_tokens accepted either way. Against the session SmolLM2
server (no trust flag) and a tiny chat model's server with it."""

from __future__ import annotations

import json

import httpx
import pytest

from serverlib import MODEL


def post(base, path, body):
    return httpx.post(base + path, json=body, timeout=60)


def test_text_offsets_count_characters_of_the_text(server):
    body = {"model": MODEL, "prompt": "Say 日本語 and héllo:", "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "echo": True}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    ids = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    offsets, text = plain["logprobs"]["text_offset"], plain["text"]
    assert ids["logprobs"]["text_offset"] == offsets  # not the length of "token_id:..." strings
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for off, tok in zip(offsets, plain["logprobs"]["tokens"]):
        if "\ufffd" not in tok:  # a token that is whole characters starts where its text is
            assert text[off:].startswith(tok), (off, tok)


def test_return_tokens_as_token_ids(server):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "echo": True, "prompt_logprobs": 1}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    ids = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    prompt = post(server, "/tokenize", {"prompt": "Hello there"}).json()["tokens"]
    assert ids["text"] == plain["text"]
    assert ids["logprobs"]["tokens"][:len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(k.startswith("token_id:") for top in ids["logprobs"]["top_logprobs"][1:] for k in top)
    assert ids["prompt_logprobs"][1][str(prompt[1])]["decoded_token"] == f"token_id:{prompt[1]}"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(e["token"].startswith("token_id:") for e in content)


def test_guided_decoding_backend_is_xgrammar(server):
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 5, "guided_choice": ["yes", "no"]}
    for name in ("xgrammar", "auto"):
        r = post(server, "/v1/completions", {**body, "guided_decoding_backend": name})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    r = post(server, "/v1/completions", {**body, "guided_decoding_backend": "outlines"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_decoding_backend"


def test_spaces_between_special_tokens_is_accepted_either_way(server):
    body = {"model": MODEL, "prompt": [1, 2, 1, 2], "max_tokens": 2, "temperature": 0, "skip_special_tokens": False,
            "echo": True}
    texts = {post(server, "/v1/completions", {**body, "spaces_between_special_tokens": v}).json()["choices"][0]["text"]
             for v in (True, False)}
    assert len(texts) == 1


def test_chat_echo_prepends_the_final_assistant_message(server):
    messages = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Red, green" + plain
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "echo": True, "stream": True},
                      timeout=60) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(d.get("content") or "" for d in deltas) == echoed
    # echo with a user turn last: nothing to prepend
    user_last = {"model": MODEL, "messages": messages[:1], "max_tokens": 4, "temperature": 0}
    assert (post(server, "/v1/chat/completions", {**user_last, "echo": True}).json()["choices"][0]["message"]
            == post(server, "/v1/chat/completions", user_last).json()["choices"][0]["message"])


def test_tools_are_checked_on_tokenize_and_names_follow_openais_rule(server):
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/tokenize", {"messages": messages, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0"
    bad_name = [{"type": "function", "function": {"name": "a b", "parameters": {}}}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": bad_name,
                                              "tool_choice": "none"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.name"


def test_a_request_chat_template_needs_the_trust_flag(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "chat_template": "{{ messages[0]['content'] }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def trusting_server(smollm2_dir, tmp_path_factory):
    from conftest import make_tiny_chat_model
    from serverlib import start_server, stop_server

    path = make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_trust"), 256)
    proc, base = start_server("--model", path, "--dtype", "float32", "--max-model-len", "256",
                              "--trust-request-chat-template", "--log-level", "warning")
    yield base
    stop_server(proc)


def test_a_trusted_request_chat_template_renders_the_prompt(trusting_server):
    template = "Q: {{ messages[-1]['content'] }}\nA:{% if tools %} TOOLS{% endif %}"
    messages = [{"role": "user", "content": "What is two plus two?"}]
    ids = post(trusting_server, "/tokenize", {"messages": messages, "chat_template": template}).json()["tokens"]
    text = post(trusting_server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == "Q: What is two plus two?\nA:"
    r = post(trusting_server, "/v1/chat/completions", {"messages": messages, "chat_template": template,
                                                       "max_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    # tools reach a request template that reads them; the model's own (no tools) would refuse them
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = post(trusting_server, "/v1/chat/completions", {"messages": messages, "chat_template": template,
                                                       "tools": tools, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200
    r = post(trusting_server, "/v1/chat/completions", {"messages": messages, "chat_template": template,
                                                       "chat_template_kwargs": {"unused": 1}, "max_tokens": 2})
    assert r.status_code == 400 and "unused" in r.text  # variables are checked against the request's template


@pytest.mark.parametrize("template,needle", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x", "longer than"),
    ("{{ 'x' * 100000000 }}", "operator"),
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "failed"),
    ("{% for i in range(100000000) %}x{% endfor %}", "failed"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}" + "{% for i in range(60000) %}abcdef{% endfor %}",
     "more than the messages"),
])
def test_a_request_template_that_runs_away_is_a_400(trusting_server, template, needle):
    import time

    messages = [{"role": "user", "content": "hi"}]
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        t = time.monotonic()
        r = post(trusting_server, path, {"messages": messages, "chat_template": template, **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert time.monotonic() - t < 30
    assert post(trusting_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).status_code == 200
