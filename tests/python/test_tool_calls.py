"""Tool calls on /v1/chat/completions: the weather-lookup round trip with the
real openai client against SmolLM2 served with --chat-template chatml-tools
(tool_choice required and named, streamed and not), and the parsing and
streaming rules of server/tool_calls.py on fixed texts."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tool_calls import ToolCallStreamer, parse_output, plan_tools
from pagedserve.server.tool_parsers import PARSERS
from serverlib import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def tool_client():
    from serverlib import start_server, stop_server

    proc, base = start_server("--dtype", "float32", "--max-model-len", "2048", "--chat-template", "chatml-tools",
                              "--log-level", "warning")
    yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stop_server(proc)


def _streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """Accumulates delta.tool_calls by index as OpenAI clients do."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        reason = c.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


def test_required_tool_call_round_trip(tool_client):
    r = tool_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            max_tokens=100, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "get_time")
    schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # the follow-up turn: the assistant's call and the tool's result rendered by the template
    follow = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"city": "Paris", "temperature": 21, "unit": "celsius"})}]
    r2 = tool_client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=60,
                                             temperature=0)  # tool_choice auto: the model answers in text
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 20  # the call and its result were rendered
    assert "21" in r2.choices[0].message.content  # ... and read: the temperature the tool reported


def test_required_tool_call_streamed_equals_non_streamed(tool_client):
    kw = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0)
    whole = tool_client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls, reason, content = _streamed_calls(tool_client.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(whole.function.name, whole.function.arguments)]
    assert calls[0]["id"]


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_streams_its_arguments(tool_client, stream):
    kw = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=100, temperature=0.8, seed=4,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls, reason, _ = _streamed_calls(tool_client.chat.completions.create(**kw, stream=True))
    else:
        choice = tool_client.chat.completions.create(**kw).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        reason = choice.finish_reason
    assert reason == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(tool_client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, **extra)
    assert e.value.body["param"] == param


def test_a_template_without_tools_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=5)
    assert e.value.body["param"] == "tools" and "--chat-template" in e.value.body["message"]
    # tool_choice none needs no tool format: the tools are not shown
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                       max_tokens=5)
    assert r.choices[0].message.content


# ---- parsing and streaming rules, on fixed texts -------------------------------------------------
NAMES = ("get_weather", "get_time")


def test_tagged_calls_are_parsed_with_the_text_before_them():
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}'  # the last one unclosed (EOS)
    content, calls = PARSERS["hermes"].parse(text, NAMES)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2
    for bad in ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>"):
        assert PARSERS["hermes"].parse(bad, NAMES) == (bad, [])
    assert PARSERS["hermes"].parse("plain answer", NAMES) == ("plain answer", [])


def _plan(**kw):
    return plan_tools(ChatCompletionRequest(messages=QUESTION, tools=TOOLS, **kw), template_reads_tools=True)


def test_auto_streaming_holds_back_a_possible_tag_and_sends_calls_at_the_end():
    s = ToolCallStreamer(_plan(tool_choice="auto"))
    pieces = ["Sure", ". <tool", "_call>", '{"name": "get_time", ', '"arguments": {"city": "Rome"}}', "</tool_call>"]
    sent = [d for p in pieces for d in s.feed(p)]
    assert sent == [{"content": "Sure"}, {"content": ". "}]  # "<tool" held back, then the call opened
    deltas, reason = s.finish("stop")
    assert reason == "tool_calls"
    (call,) = deltas[0]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": '{"city": "Rome"}'}
    # text that only looked like a tag start is sent after all
    s = ToolCallStreamer(_plan(tool_choice="auto"))
    assert s.feed("a <to") == [{"content": "a "}]
    assert s.feed("p") == [{"content": "<top"}]
    assert s.finish("stop") == ([], "stop")


def test_required_plan_constrains_to_one_call_unless_parallel():
    one = _plan(tool_choice="required").constraint.json
    assert one["maxItems"] == 1 and one["minItems"] == 1
    assert {v["properties"]["name"]["const"] for v in one["items"]["anyOf"]} == set(NAMES)
    assert "maxItems" not in _plan(tool_choice="required", parallel_tool_calls=True).constraint.json
    assert _plan(tool_choice={"type": "function", "function": {"name": "get_weather"}}).constraint.json == WEATHER
    assert _plan(tool_choice="none").tools is None
    with pytest.raises(APIError):
        plan_tools(ChatCompletionRequest(messages=QUESTION, tools=TOOLS), template_reads_tools=False)


def test_required_keeps_each_tools_own_refs(smollm2_dir):
    """Parameters with $defs and local $refs (as openai.pydantic_function_tool
    writes them) are moved under the wrapper's $defs with their refs rebased."""
    from transformers import AutoTokenizer

    from pagedserve.structured_output import StructuredOutputManager

    unit = {"type": "object", "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}},
            "properties": {"unit": {"$ref": "#/$defs/Unit"}, "again": {"$ref": "#/properties/unit"},
                           "same": {"const": {"$ref": "#/x"}}},  # a value, not a reference: untouched
            "required": ["unit", "again"]}
    tree = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["child"]}
    tools = [{"type": "function", "function": {"name": "w", "parameters": unit}},
             {"type": "function", "function": {"name": "t", "parameters": tree}}]
    plan = plan_tools(ChatCompletionRequest(messages=QUESTION, tools=tools, tool_choice="required"), True)
    defs = plan.constraint.json["$defs"]
    assert defs["tool_0"]["properties"]["unit"]["$ref"] == "#/$defs/tool_0/$defs/Unit"
    assert defs["tool_0"]["properties"]["again"]["$ref"] == "#/$defs/tool_0/properties/unit"
    assert defs["tool_0"]["properties"]["same"] == {"const": {"$ref": "#/x"}}
    assert defs["tool_1"]["properties"]["child"]["anyOf"][0] == {"$ref": "#/$defs/tool_1"}
    manager = StructuredOutputManager(AutoTokenizer.from_pretrained(smollm2_dir), 49152, [2])
    compiled = manager.compile(plan.constraint)
    for text, ok in [('[{"name": "w", "arguments": {"unit": "celsius", "again": "fahrenheit"}}]', True),
                     ('[{"name": "t", "arguments": {"child": {"child": null}}}]', True),
                     ('[{"name": "w", "arguments": {"unit": "kelvin"', False)]:
        assert manager.new_states(compiled, 1)[0].matcher.accept_string(text) is ok, text


def test_arguments_are_always_json_object_text():
    plan = plan_tools(ChatCompletionRequest(messages=QUESTION, tools=[
        {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}], tool_choice="required"),
        True)
    assert parse_output(plan, '[{"name": "s", "arguments": "Paris"}]')[1][0].function.arguments == '"Paris"'
    for args in ("null", "[1]", '"text"'):  # auto: a call whose arguments are not an object is not a call
        text = '<tool_call>{"name": "get_time", "arguments": ' + args + '}</tool_call>'
        assert PARSERS["hermes"].parse(text, NAMES) == (text, [])
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    assert PARSERS["hermes"].parse(text, NAMES)[1][0].function.arguments == '{"city": "Rome"}'
