"""Tool-call formats (`--tool-call-parser`): how a model family writes calls
in its output under `tool_choice: "auto"`, and how that text becomes
`tool_calls`. Each format is a ToolParser:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  anywhere after some text (Hermes, Qwen, PagedServe's chatml-tools template).
- `mistral`: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral
  v0.3 / Nemo; text before the marker is content).
- `llama3_json`: the output is one or more JSON objects {"name", "parameters"}
  (or "arguments") separated by `;`, optionally after `<|python_tag|>`
  (Llama 3.1 / 3.2 JSON tool calling); they must open the output.
- `pythonic`: the output is a Python list of calls, `[f(a=1), g(b="x")]`,
  optionally inside `<|python_start|>…<|python_end|>` (Llama 3.2 pythonic,
  Llama 4); arguments must be literals.

`auto` (the default) picks the format whose marker the chat template contains
when exactly one does, else hermes (choose_tool_parser). A call naming a tool
that was not given, or text that does not parse, leaves the whole output as
content and no calls. Streaming: text before the calls streams as content
(text that may still begin them is held back), calls are sent whole once the
output is complete (tool_calls.ToolCallStreamer).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from ..engine.stop import held_back
from .protocol import FunctionCall, ToolCall


def make_call(name: str, arguments: str) -> ToolCall:
    """A tool call with `arguments` as JSON text."""
    return ToolCall(function=FunctionCall(name=name, arguments=arguments))


def as_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _call_of(obj, names: tuple[str, ...], *arg_keys: str) -> ToolCall | None:
    """{"name": one of names, <arg key>: an object or its JSON text} -> a call; else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in arg_keys if k in obj), None)
    arguments = obj.get(key, {}) if key else {}
    if isinstance(arguments, str) and _json_object(arguments):  # some models write the object's JSON text
        return make_call(obj["name"], arguments)
    return make_call(obj["name"], as_json(arguments)) if isinstance(arguments, dict) else None


@dataclass(frozen=True)
class ToolParser:
    """One tool-call format. Subclasses define the marker and parse()."""

    name: str = ""
    marker: str = ""  # what opens the calls, and what a chat template of this format contains

    def call_start(self, text: str) -> int:
        """Where the calls begin in the text so far; -1 if not (yet)."""
        return text.find(self.marker)

    def held_back(self, text: str) -> int:
        """Characters at the end of the text so far that may still begin the calls."""
        return held_back(text, (self.marker,))

    def parse(self, text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
        """A finished output's (content, calls): content the text before the
        calls (stripped; None when empty), or the whole text and no calls."""
        raise NotImplementedError


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    def parse(self, text, names):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for m in _HERMES_CALL.finditer(text, start):  # the last block may lack its closing tag
            try:
                call = _call_of(json.loads(m.group(1)), names, "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls


class MistralParser(ToolParser):
    def parse(self, text, names):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len(self.marker):])
        except ValueError:
            return text, []
        calls = [_call_of(it, names, "arguments") for it in (items if isinstance(items, list) else [items])]
        if not calls or None in calls:
            return text, []
        return text[:start].strip() or None, calls


class _OpeningParser(ToolParser):
    """A format whose calls must open the output (after whitespace and an
    optional tag): `openers` are the first characters a call may start with."""

    openers: tuple[str, ...] = ()

    def call_start(self, text):
        body = text.lstrip()  # leading whitespace belongs to the calls, not to content
        return 0 if body and any(body.startswith(o) for o in self.openers) else -1

    def held_back(self, text):
        body = text.lstrip()
        if not body or any(o.startswith(body) for o in self.openers):
            return len(text)  # only whitespace, or the start of an opener: undecided
        return 0


class Llama3JsonParser(_OpeningParser):
    openers = ("{", "<|python_tag|>")

    def parse(self, text, names):
        body = text.strip()
        body = body.removeprefix(self.marker).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call_of(obj, names, "parameters", "arguments")
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls


class PythonicParser(_OpeningParser):
    openers = ("[", "<|python_start|>")

    def parse(self, text, names):
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and node.func.id in names and all(k.arg for k in node.keywords)):
                return text, []
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                return text, []
            calls.append(make_call(node.func.id, as_json(arguments)))
        return None, calls


PARSERS: dict[str, ToolParser] = {
    "hermes": HermesParser("hermes", "<tool_call>"),
    "mistral": MistralParser("mistral", "[TOOL_CALLS]"),
    "llama3_json": Llama3JsonParser("llama3_json", "<|python_tag|>"),
    "pythonic": PythonicParser("pythonic", "[func_name("),
}
# what a chat template of each format contains (pythonic templates describe the call syntax with a placeholder)
_TEMPLATE_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",),
                     "pythonic": ("[func_name(", "<|python_start|>")}


def choose_tool_parser(name: str | None, template: str) -> tuple[ToolParser, str]:
    """The ToolParser for --tool-call-parser `name` ("auto" or None: from the
    chat template's markers) and why. Raises ValueError for an unknown name."""
    if name not in (None, "auto"):
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
        return PARSERS[name], "asked for"
    found = [n for n, markers in _TEMPLATE_MARKERS.items() if any(m in template for m in markers)]
    if len(found) == 1:
        return PARSERS[found[0]], f"auto: the chat template writes {found[0]} calls"
    why = "names no known format" if not found else f"matches several formats ({', '.join(found)})"
    return PARSERS["hermes"], f"auto: the chat template {why}; hermes (--tool-call-parser chooses)"
