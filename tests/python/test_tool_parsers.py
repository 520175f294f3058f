"""Issue 30 part 5: tool-call formats (--tool-call-parser hermes | mistral |
llama3_json | pythonic). Each parser on fixed texts, streamed in random pieces
equal to the whole; the format chosen from the chat template; and end to end,
a tiny random model served with each bundled family template (the parser
chosen automatically from it), its output forced by a regex to that family's
call text: tool_calls come back whole and streamed with index / id / type, and
the call and its result render back through the template."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tool_calls import ToolCallStreamer, plan_tools
from pagedserve.server.tool_parsers import PARSERS, choose_tool_parser
from pagedserve.templates import load_chat_template

NAMES = ("get_weather", "get_time")
PARIS, OSLO = ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})
TEXTS = {  # parser -> [(output, expected content, expected calls)]
    "hermes": [('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "Sure.",
                [PARIS])],
    "mistral": [('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}]', "Checking.", [PARIS, OSLO]),
                ('[TOOL_CALLS][{"name": "nope", "arguments": {}}]', None, None),
                ("[TOOL_CALLS][{broken", None, None)],
    "llama3_json": [('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                     '{"name": "get_time", "parameters": {"city": "Oslo"}}', None, [PARIS, OSLO]),
                    ('  {"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
                    ('The answer is {"name": "get_weather"}', None, None),
                    ('{"answer": 42}', None, None)],
    "pythonic": [('[get_weather(city="Paris"), get_time(city="Oslo")]', None, [PARIS, OSLO]),
                 ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [PARIS]),
                 ("[get_weather(city=input())]", None, None),
                 ("[1, 2, 3] are numbers", None, None),
                 ("Paris is sunny.", None, None)],
}


def _calls(calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def _stream(parser, text, rng):
    """Feeds text in random pieces through an auto-mode ToolCallStreamer:
    (content, [(name, arguments)], finish reason)."""
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                            tools=[{"type": "function", "function": {"name": n}} for n in NAMES]),
                      True, parser)
    streamer, deltas, i = ToolCallStreamer(plan), [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        deltas += streamer.feed(text[i:j])
        i = j
    last, reason = streamer.finish("stop")
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for d in deltas for c in d.get("tool_calls", [])]
    indices = [c["index"] for d in deltas for c in d.get("tool_calls", [])]
    assert indices == list(range(len(indices)))
    assert all(c["type"] == "function" and c["id"] for d in deltas for c in d.get("tool_calls", []))
    return content, calls, reason


@pytest.mark.parametrize("name", list(TEXTS))
def test_each_parser_on_fixed_texts_whole_and_streamed(name):
    parser, rng = PARSERS[name], random.Random(0)
    for text, content, calls in TEXTS[name]:
        got_content, got_calls = parser.parse(text, NAMES)
        if calls is None:  # not a call: the whole text is the answer
            assert (got_content, got_calls) == (text, [])
        else:
            assert got_content == content and _calls(got_calls) == calls
        for _ in range(20):
            streamed = _stream(parser, text, rng)
            if calls is None:
                assert streamed == (text, [], "stop")
            else:
                assert streamed == ((content or "") if name in ("hermes", "mistral") else "", calls, "tool_calls")


def test_the_format_is_chosen_from_the_chat_template():
    for template, name in [("chatml-tools", "hermes"), ("mistral-tools", "mistral"),
                           ("llama3-json-tools", "llama3_json"), ("pythonic-tools", "pythonic")]:
        assert choose_tool_parser("auto", load_chat_template(template))[0].name == name
    parser, why = choose_tool_parser("auto", "{{ messages }}")
    assert parser.name == "hermes" and "no known format" in why
    assert choose_tool_parser("pythonic", load_chat_template("mistral-tools"))[0].name == "pythonic"
    with pytest.raises(ValueError, match="unknown"):
        choose_tool_parser("nope", "")


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}" else ch for ch in text)


FAMILIES = [  # bundled template, forced output, expected content, the call as the template renders it back
    ("chatml-tools", 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
     "Let me look.", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    ("mistral-tools", 'One moment.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "One moment.", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("llama3-json-tools", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("pythonic-tools", '[get_weather(city="Paris")]', None, '[get_weather(city="Paris")]'),
]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for n in NAMES]


@pytest.fixture(scope="module")
def tiny_chat_dir(smollm2_dir, tmp_path_factory):
    from conftest import make_tiny_chat_model

    return make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_tools"), 512)


@pytest.mark.parametrize("template,output,content,rendered", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_template_end_to_end(tiny_chat_dir, template, output, content, rendered):
    from serverlib import start_server, stop_server

    proc, base = start_server("--model", tiny_chat_dir, "--dtype", "float32", "--max-model-len", "512",
                              "--chat-template", template, "--log-level", "warning")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        kw = dict(model=tiny_chat_dir, messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                  extra_body={"structured_outputs": {"regex": _regex(output)}})
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        streamed, ids, text, reason = [], set(), "", None
        for chunk in client.chat.completions.create(**kw, stream=True):
            c = chunk.choices[0]
            text += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                streamed.append((d.index, d.type, d.function.name, json.loads(d.function.arguments)))
                ids.add(d.id)
            reason = c.finish_reason or reason
        assert streamed == [(0, "function", "get_weather", {"city": "Paris"})] and len(ids) == 1
        assert text == (content or "") and reason == "tool_calls"
        # the call and its result go back through the family's template
        turn = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        ids = httpx.post(base + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()["tokens"]
        prompt = httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert rendered in prompt and "sunny, 21 C" in prompt and '"get_time"' in prompt
    finally:
        stop_server(proc)
