"""Issue 33 part 2: OpenAI's Responses API (/v1/responses, stateless) with
the official `openai` SDK: greedy text equal to /v1/chat/completions, the
streamed events' text equal to the whole response, a json_schema output, a
function-call round trip (a tiny model under --chat-template chatml-tools,
tool_choice required), an incomplete response at max_output_tokens, and the
stateless refusals."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serverlib import MODEL

QUESTION = "What is the capital of France?"


def test_greedy_text_equals_chat_completions(server, client):
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", temperature=0,
                                max_output_tokens=30)
    ref = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert r.object == "response" and r.output_text == ref.choices[0].message.content
    assert r.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == ref.usage.prompt_tokens and r.usage.output_tokens == ref.usage.completion_tokens
    items = client.responses.create(model=MODEL, temperature=0, max_output_tokens=30, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == r.output_text
    cut = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [o.status for o in cut.output] == ["incomplete"]  # the message it was cut in says so too


def test_a_cut_stream_marks_its_item_incomplete(client):
    done, final = [], None
    for event in client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2,
                                         stream=True):
        if event.type == "response.output_item.done":
            done.append(event.item)
        if event.type in ("response.completed", "response.incomplete"):
            final = event
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in done] == [("message", "incomplete")]
    assert [o.status for o in final.response.output] == ["incomplete"]
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40)
    assert whole.status == "completed" and [o.status for o in whole.output] == ["completed"]


def test_stream_events_add_up_to_the_response(client):
    kw = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40)
    whole = client.responses.create(**kw)
    deltas, kinds, final = [], [], None
    for event in client.responses.create(stream=True, **kw):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=QUESTION + " Answer in JSON.", temperature=0,
                                max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["city"], str)


def test_stateless_refusals(server, client):
    for extra, param in [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [{"type": "web_search"}]}, "tools.0.type")]:
        r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "hi", **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "message", "role": "user",
                                                     "content": [{"type": "input_image", "image_url": "x"}]}])


TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}]


def test_function_call_round_trip(tiny_tools_server):
    base, model = tiny_tools_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model, tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=40)
    r = client.responses.create(input=question, **kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str) and call.call_id
    streamed = None
    for event in client.responses.create(input=question, stream=True, **kw):
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            streamed = event.item
    assert (streamed.name, json.loads(streamed.arguments)) == (call.name, json.loads(call.arguments))
    turn = question + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
                       {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    after = client.responses.create(model=model, input=turn, tools=TOOLS, max_output_tokens=5)
    assert after.usage.input_tokens > r.usage.input_tokens  # the call and its output were rendered
