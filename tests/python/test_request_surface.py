"""Issue 15: the whole request surface is decided, field by field. Explicit
null means "as if absent" for every field of both endpoints; logprob `bytes`
are each token's raw bytes (joined: the UTF-8 of the text); the chat-template
extras (add_generation_prompt, continue_final_message, chat_template_kwargs,
documents) are honoured through the template or refused by name; every
declared field is honoured, harmless, or refused when set. Against the real
server (session fixture `server`), the real `openai` client and raw httpx."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from serverlib import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0,
        "max_tokens": 3, "seed": 3}
COMPLETION = {"model": MODEL, "prompt": "The colours of the rainbow are", "temperature": 0, "max_tokens": 3,
              "seed": 3}
# What the server does with each declared field. A field added to a request
# schema without a decision here fails test_every_field_is_decided.
HONOURED = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "n", "seed", "stop", "stop_token_ids", "cache_salt", "ignore_eos", "skip_special_tokens",
    "stream", "stream_options", "add_special_tokens", "priority", "include_stop_str_in_output",
    "truncate_prompt_tokens", "min_tokens", "logit_bias", "allowed_token_ids", "prompt_logprobs", "bad_words",
    "return_tokens_as_token_ids", "guided_decoding_backend", "chat_template",
    # completions
    "prompt", "echo", "logprobs", "best_of",
    # chat
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "documents", "reasoning_effort", "modalities",
    # structured outputs (test_structured_outputs.py) and tools (test_tool_calls.py)
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "tools", "tool_choice", "parallel_tool_calls",
    # PagedServe's extension: the request's timeline in the response (test_timeline.py)
    "timeline",
}
# accepted because they cannot change the text (or are refused in the cases where they would)
HARMLESS = {"user", "store", "metadata", "service_tier", "prediction", "function_call",
            "spaces_between_special_tokens"}
# a value that turns each refused field on
TURNED_ON = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "functions": [{"name": "f", "parameters": {}}],
    "guided_whitespace_pattern": " ",
    "use_beam_search": True, "length_penalty": 0.5,
    "logits_processors": ["x"],
    "priority": 1, "vllm_xargs": {"a": 1}, "suffix": " end",
    "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {"search_context_size": "low"}, "verbosity": "low",
}


def post(server, path, body):
    return httpx.post(server + path, json=body, timeout=120)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(b[6:]) for b in r.content.split(b"\n\n") if b.startswith(b"data: {")]
        return "".join(c.get("text") or c.get("delta", {}).get("content", "") for e in events for c in e["choices"])
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def optional_fields(model) -> list[str]:
    return sorted(name for name, f in model.model_fields.items() if not f.is_required())


# ---- null is absent ----------------------------------------------------------------
@pytest.mark.parametrize("path,body,model", [("/v1/chat/completions", CHAT, ChatCompletionRequest),
                                             ("/v1/completions", COMPLETION, CompletionRequest)])
def test_every_optional_field_set_to_null_is_as_if_absent(server, path, body, model):
    base = text_of(post(server, path, body))
    checked = 0
    for name in optional_fields(model):
        absent = {k: v for k, v in body.items() if k != name}
        expected = base if name not in body else text_of(post(server, path, absent))
        got = post(server, path, {**absent, name: None})
        assert got.status_code == 200, (name, got.text)
        assert text_of(got) == expected, name
        checked += 1
    assert checked >= 50  # the schemas declare this many optional fields
    everything_null = {**body, **{name: None for name in optional_fields(model) if name not in body}}
    assert text_of(post(server, path, everything_null)) == base


def test_nested_nulls_and_the_openai_client_sending_none(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour.", "name": None}], temperature=0,
              max_tokens=5)
    expected = client.chat.completions.create(**kw).choices[0].message.content
    nulls = dict(top_p=None, n=None, presence_penalty=None, frequency_penalty=None, logprobs=None, seed=None,
                 top_logprobs=None, stop=None, user=None)
    assert client.chat.completions.create(**kw, **nulls).choices[0].message.content == expected
    streamed = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": None})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    kw = dict(model=MODEL, prompt="The colours of the rainbow are", temperature=0, max_tokens=5)
    expected = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw, echo=None, n=None, logprobs=None, best_of=None).choices[0].text == expected


def test_completions_max_tokens_null_is_its_default_16(server):
    r = post(server, "/v1/completions", {**COMPLETION, "max_tokens": None, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16


# ---- logprob bytes -----------------------------------------------------------------------
WATER = {"model": MODEL, "temperature": 0, "max_tokens": 12,
         "messages": [{"role": "user", "content": "Translate 'water' into Chinese characters."}]}


def test_chat_logprob_bytes_join_to_the_utf8_of_the_content(server):
    r = post(server, "/v1/chat/completions", {**WATER, "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["message"]["content"]
    entries = r["choices"][0]["logprobs"]["content"]
    assert any(ord(ch) > 0x7FF for ch in content), content  # a 3-byte character, split across tokens
    assert any(e["token"] == "\ufffd" for e in entries)  # ... whose pieces show as U+FFFD on their own
    assert b"".join(bytes(e["bytes"]) for e in entries) == content.encode()
    for e in entries:
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]  # greedy: the top alternative is the token
    with httpx.stream("POST", server + "/v1/chat/completions", json={**WATER, "logprobs": True, "stream": True},
                      timeout=120) as s:
        events = [json.loads(b[6:]) for b in s.read().split(b"\n\n") if b.startswith(b"data: {")]
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert b"".join(bytes(e["bytes"]) for e in streamed) == content.encode()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprob_bytes_join_to_the_utf8_of_the_text(server, stream):
    prompt = "English: fire\nChinese: 火\nEnglish: water\nChinese:"
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 4, "logprobs": 1, "echo": True,
            "stream": stream}
    if not stream:
        choice = post(server, "/v1/completions", body).json()["choices"][0]
        text, joined = choice["text"], b"".join(bytes(b) for b in choice["logprobs"]["bytes"])
        assert len(choice["logprobs"]["bytes"]) == len(choice["logprobs"]["tokens"])
    else:
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as s:
            events = [json.loads(b[6:]) for b in s.read().split(b"\n\n") if b.startswith(b"data: {")]
        choices = [c for e in events for c in e["choices"]]
        text = "".join(c["text"] for c in choices)
        joined = b"".join(bytes(b) for c in choices if c["logprobs"] for b in c["logprobs"]["bytes"])
    assert "火" in text  # the echoed prompt holds a multi-byte character
    assert joined == text.encode()


# ---- chat template extras --------------------------------------------------------------
GIVEN = "The capital of France is"
CONTINUE = {"model": MODEL, "temperature": 0, "max_tokens": 6,
            "messages": [{"role": "user", "content": "Tell me about France."},
                         {"role": "assistant", "content": GIVEN}]}


def test_continue_final_message_continues_the_given_text(server):
    new_turn = post(server, "/v1/chat/completions", CONTINUE).json()
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    cont = post(server, "/v1/chat/completions", {**CONTINUE, **flags}).json()
    assert cont["usage"]["prompt_tokens"] < new_turn["usage"]["prompt_tokens"]
    ids = post(server, "/tokenize", {"model": MODEL, "messages": CONTINUE["messages"], **flags}).json()["tokens"]
    assert len(ids) == cont["usage"]["prompt_tokens"]
    rendered = post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]
    assert rendered.endswith(GIVEN)  # the prompt stops inside the assistant's message
    # the reply is what a plain completion of that very prompt writes
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 6})
    assert cont["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]


@pytest.mark.parametrize("extra,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "hi"}]}, "continue_final_message"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"documents": [{"title": "t", "text": "x"}]}, "documents"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"messages": [{"role": "assistant", "content": None,  # SmolLM2's own template shows no tool calls
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
])
def test_template_requests_the_template_cannot_do_are_refused_by_name(server, extra, param):
    r = post(server, "/v1/chat/completions", {**CONTINUE, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_template_variables_are_passed_when_the_template_reads_them(smollm2_dir):
    """SmolLM2's own template reads none of them, so this renders with one that does."""
    from transformers import AutoTokenizer

    from pagedserve.server.chat_render import ChatRenderer
    from pagedserve.server.protocol import ChatTemplateFields
    from pagedserve.server.tool_parsers import PARSERS

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = ("{% for d in documents or [] %}[doc {{ d.title }}]{% endfor %}"
                         "{% if enable_thinking %}<think>{% endif %}{{ reasoning_effort or '' }}"
                         "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}")
    chat = ChatRenderer(tok, PARSERS["hermes"])
    messages = ChatCompletionRequest.model_validate(CONTINUE).messages

    def text(**fields) -> str:
        return tok.decode(chat.render(messages, ChatTemplateFields(**fields)))

    assert text() == "user:Tell me about France.|assistant:The capital of France is|"
    assert text(chat_template_kwargs={"enable_thinking": True}).startswith("<think>user:")
    assert text(documents=[{"title": "A", "text": "x"}], reasoning_effort="high").startswith("[doc A]high")


# ---- every field decided -------------------------------------------------------------------
def test_every_field_is_decided():
    for model in (CompletionRequest, ChatCompletionRequest):
        refused = set(model.UNIMPLEMENTED)
        undecided = set(model.model_fields) - HONOURED - HARMLESS - refused
        assert not undecided, f"{model.__name__}: decide {sorted(undecided)} (honour, or list in UNIMPLEMENTED)"
        assert refused <= set(TURNED_ON), sorted(refused - set(TURNED_ON))


@pytest.mark.parametrize("path,body,model", [("/v1/chat/completions", CHAT, ChatCompletionRequest),
                                             ("/v1/completions", COMPLETION, CompletionRequest)])
def test_every_refused_field_is_refused_by_name_when_set_and_accepted_when_off(server, path, body, model):
    expected = text_of(post(server, path, body))
    for name in model.UNIMPLEMENTED:
        r = post(server, path, {**body, name: TURNED_ON[name]})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"], r.json()
        off = model.model_fields[name].default
        assert text_of(post(server, path, {**body, name: off})) == expected, name
