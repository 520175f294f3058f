"""Tool calling on /v1/chat/completions: which tools the chat template shows,
how `tool_choice` constrains the output, and how the output becomes
`message.tool_calls` (whole, or as streamed `delta.tool_calls`).

- "none" (the default without tools): tools are not rendered, the answer is text.
- "auto" (the default with tools): the model decides; calls written in the
  server's tool-call format (tool_parsers.py: hermes `<tool_call>` blocks,
  mistral, llama3_json, pythonic) become tool calls.
- "required": the output is constrained to a JSON array of
  {"name": one of the tools, "arguments": its parameters} (as vLLM does):
  exactly one unless parallel_tool_calls is true (then one or more).
- a named function: the output is constrained to that function's parameters.
A template that never reads `tools` cannot show them to the model: a request
with tools (other than tool_choice "none") is then a 400 that says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..sampling_params import StructuredOutputsParams
from .errors import APIError
from .protocol import ChatCompletionRequest, ToolCall
from .tool_parsers import PARSERS, ToolParser, as_json, make_call
TEMPLATE_HINT = ("start the server with --chat-template chatml-tools (ChatML models such as SmolLM2) or a "
                 "template file that renders tools and tool calls")
_NO_TOOL_FORMAT = ("this model's chat template has no tool format (it never reads `tools`), so the model would "
                   "not see the tools; " + TEMPLATE_HINT)


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its generation.

    Attributes:
        mode: "none", "auto", "required" or "named".
        tools: the tools to render through the chat template (None: render none).
        names: the tools' function names.
        constraint: the output constraint ("required", "named"), else None.
        function_name: the named function ("named" only).
        parallel: parallel_tool_calls (default False here, as llama.cpp's
            server: at most one call; True: one or more).
        parser: the server's tool-call format ("auto").
    """

    mode: str
    tools: list[dict] | None = None
    names: tuple[str, ...] = ()
    constraint: StructuredOutputsParams | None = None
    function_name: str | None = None
    parallel: bool = False
    parser: ToolParser = PARSERS["hermes"]


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_tools(tools: list) -> list[dict]:
    """The tools as OpenAI sends them; raises APIError 400 naming a malformed one."""
    seen = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param=f"tools.{i}")
        name, params = fn.get("name"), fn.get("parameters", {})
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise APIError(400, "a tool's function needs a name of 1 to 64 letters, digits, _ or - (OpenAI's rule)",
                           param=f"tools.{i}.function.name")
        if name in seen:
            raise APIError(400, f"two tools are named `{name}`", param=f"tools.{i}.function.name")
        if not isinstance(params, dict):
            raise APIError(400, "a tool's parameters must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
        seen.add(name)
    return tools


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas: never rewritten


def _rebased(schema, base: str):
    """`schema` moved under the JSON pointer `base` of a larger schema: every
    local $ref ("#" or "#/...") now points to the same place below `base`."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else _rebased(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def plan_tools(req: ChatCompletionRequest, template_reads_tools: bool,
               parser: ToolParser = PARSERS["hermes"]) -> ToolPlan:
    """The ToolPlan of a chat request.

    Args:
        req: the request (tools, tool_choice, parallel_tool_calls).
        template_reads_tools: whether the chat template renders `tools`.
        parser: the server's tool-call format (tool_choice "auto").
    Raises:
        APIError 400: malformed tools or tool_choice, a named function that is
        not among the tools, tool_choice required/named without tools, tools
        the template cannot show.
    """
    tools = check_tools(req.tools or [])
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(400, "`tool_choice` must be none, auto, required or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        mode = "named"
    elif choice in ("none", "auto", "required"):
        mode, name = choice, None
    else:
        raise APIError(400, f"`tool_choice` must be none, auto, required or a named function, got {choice!r}",
                       param="tool_choice")
    if mode == "none" or (mode == "auto" and not tools):
        return ToolPlan("none")
    if not tools:
        raise APIError(400, f"`tool_choice` {mode} needs `tools`", param="tool_choice")
    if not template_reads_tools:
        raise APIError(400, _NO_TOOL_FORMAT, param="tools", code="unsupported_parameter")
    by_name = {t["function"]["name"]: t for t in tools}
    parallel = req.parallel_tool_calls is True  # off unless asked (as llama.cpp's server): small models repeat calls
    plan = ToolPlan(mode, tools, tuple(by_name), parallel=parallel, parser=parser)
    if mode == "named":
        if name not in by_name:
            raise APIError(400, f"`tool_choice` names `{name}`, which is not among the tools",
                           param="tool_choice.function.name")
        plan.function_name = name
        plan.constraint = StructuredOutputsParams(json=_parameters(by_name[name]))
    elif mode == "required":
        # each tool's parameters under $defs (their own $defs and local $refs rebased there)
        defs = {f"tool_{i}": _rebased(_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
        call = [{"type": "object", "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                 "required": ["name", "arguments"]} for i, n in enumerate(by_name)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}, "$defs": defs}
        if not parallel:
            schema["maxItems"] = 1
        plan.constraint = StructuredOutputsParams(json=schema)
    return plan


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's (content, tool calls) under `plan`. Output that does
    not parse (a constrained one cut by max_tokens) stays content, no calls."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [make_call(plan.function_name, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [make_call(it["name"], as_json(it["arguments"])) for it in items]
    if plan.mode == "auto":
        return plan.parser.parse(text, plan.names)
    return text, []


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the choice ended normally with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


class ToolCallStreamer:
    """Turns one choice's streamed text into chat deltas under a ToolPlan.

    named: the function's call opens with the first text, whose every delta is
    a piece of its arguments. required: calls are sent when the output is
    complete (the JSON array must be whole to be parsed). auto: text streams as
    content until the parser's calls open (text that might begin them is held
    back), the calls are sent when the output is complete.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content (auto)
        self.in_call = False  # auto: a <tool_call> has opened
        self.call: ToolCall | None = None  # named: the call being streamed

    def feed(self, delta: str) -> list[dict]:
        """The deltas to send for new text."""
        self.text += delta
        mode = self.plan.mode
        if mode == "none":
            return [{"content": delta}] if delta else []
        if mode == "named":
            if not delta:
                return []
            if self.call is None:
                self.call = make_call(self.plan.function_name, "")
                return [{"tool_calls": [{"index": 0, "id": self.call.id, "type": "function",
                                         "function": {"name": self.call.function.name, "arguments": delta}}]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}]
        if mode == "required" or self.in_call:
            return []
        parser = self.plan.parser
        at = parser.call_start(self.text)
        end = at if at >= 0 else len(self.text) - parser.held_back(self.text)
        self.in_call = at >= 0
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return [{"content": piece}] if piece else []

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas of a finished choice and its finish reason."""
        mode = self.plan.mode
        if mode == "none":
            return [], reason
        if mode == "named":
            calls = parse_output(self.plan, self.text)[1]
            return [], finish_reason(reason, calls)
        content, calls = parse_output(self.plan, self.text)
        if not calls:
            rest = self.text[self.sent:]
            return ([{"content": rest}] if rest else []), reason
        # auto: the text before the first call was sent as content while it streamed
        return [{"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                for i, c in enumerate(calls)]}], finish_reason(reason, calls)
