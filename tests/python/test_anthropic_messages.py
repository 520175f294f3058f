"""Issue 33 part 1: Anthropic's Messages API (/v1/messages,
/v1/messages/count_tokens) with the official `anthropic` SDK (whose create()
no longer takes temperature: greedy requests send it in extra_body): greedy text
equal to /v1/chat/completions for the same conversation, streaming equal to
the whole answer, stop reasons, count_tokens, Anthropic-shaped errors, and a
tool-use round trip (a tiny model under --chat-template chatml-tools, its
call constrained by tool_choice any)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from serverlib import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def chat_text(server, messages, system=None, **kw):
    msgs = ([{"role": "system", "content": system}] if system else []) + messages
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "temperature": 0, **kw},
                   timeout=60).json()
    return r["choices"][0]


def test_greedy_text_equals_chat_completions(server, claude):
    system = "You are a geography teacher."
    greedy = {"temperature": 0}
    m = claude.messages.create(model=MODEL, max_tokens=30, extra_body=greedy, system=system, messages=QUESTION)
    ref = chat_text(server, QUESTION, system, max_tokens=30)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.content[0].text == ref["message"]["content"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref["finish_reason"]]
    assert m.usage.input_tokens > 10 and m.usage.output_tokens >= 1
    cut = claude.messages.create(model=MODEL, max_tokens=3, extra_body={"temperature": 0}, messages=QUESTION)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    words = m.content[0].text.split()
    stopped = claude.messages.create(model=MODEL, max_tokens=30, extra_body=greedy, system=system,
                                     messages=QUESTION, stop_sequences=[words[2]])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[2]
    assert words[2] not in stopped.content[0].text


def test_stream_equals_the_whole_message(claude):
    kw = dict(model=MODEL, max_tokens=40, extra_body={"temperature": 0}, messages=QUESTION)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_equals_the_rendered_prompt(server, claude):
    n = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=QUESTION).input_tokens
    ids = httpx.post(server + "/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}]
                                                 + QUESTION}).json()["tokens"]
    assert n == len(ids)


def test_errors_have_anthropics_shape(server, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, "messages": QUESTION}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model=MODEL, max_tokens=5, messages=QUESTION,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).usage.output_tokens >= 1


WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


def test_tool_use_round_trip(tiny_tools_server):
    base, model = tiny_tools_server
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model, max_tokens=40, extra_body={"temperature": 0}, tools=[WEATHER],
              tool_choice={"type": "any"})
    m = client.messages.create(messages=messages, **kw)
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str) and call.id
    with client.messages.stream(messages=messages, **kw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input) and final.stop_reason == "tool_use"
    turn = messages + [{"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                          "input": call.input}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                     "content": "sunny, 21 C"}]}]
    after = client.messages.create(model=model, max_tokens=5, messages=turn, tools=[WEATHER])
    assert after.usage.input_tokens > m.usage.input_tokens  # the call and its result were rendered
    counted = client.messages.count_tokens(model=model, messages=turn, tools=[WEATHER]).input_tokens
    assert counted == after.usage.input_tokens
    named = client.messages.create(messages=messages, **{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.stop_reason == "tool_use" and named.content[-1].name == "get_weather"
