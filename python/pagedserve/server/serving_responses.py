"""POST /v1/responses (OpenAI's Responses API, stateless, as vLLM and
llama-server serve it): the request is translated into a chat completions
request and run by OpenAIServingChat.respond, the same pipeline as
/v1/chat/completions; its answer, whole or streamed, becomes a Response.

- instructions -> a system message; `input` text -> a user message; input
  items: messages (input_text / output_text parts), `function_call` -> the
  assistant's tool_calls, `function_call_output` -> a `tool` message,
  `reasoning` items are dropped (the model's own thinking is not re-read).
- tools: function tools only; tool_choice as chat's; text.format
  (json_schema, json_object) -> response_format; reasoning.effort -> the
  template's reasoning_effort where the template reads it.
- Output items: `reasoning` (with --reasoning-parser), `message`
  (output_text), `function_call`; status "incomplete" with reason
  max_output_tokens when the output was cut, and so is the item it was cut
  in (the last; in the stream, its response.output_item.done), as OpenAI's.
- Streaming: the typed events (response.created, response.in_progress,
  response.output_item.added, response.content_part.added,
  response.output_text.delta / .done, response.reasoning_text.delta / .done,
  response.function_call_arguments.delta / .done, response.content_part.done,
  response.output_item.done, response.completed or response.incomplete), each
  with a sequence_number.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import APIError
from .protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from .responses_protocol import ResponseObject, ResponsesRequest, new_id
from .chat_render import template_source, template_variables
from .serving_chat import OpenAIServingChat, chat_request


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content or []):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.content.{i}: content of type {kind!r} is not supported (text only)",
                           param=f"{where}.content.{i}")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _messages(req: ResponsesRequest) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}: role must be user, system, developer or assistant", param=where)
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind != "reasoning":
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param=where)
    return out


def _tools(req: ResponsesRequest) -> dict:
    fields: dict = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise APIError(400, f"tools.{i}: only function tools are supported, not {t.get('type')!r}",
                               param=f"tools.{i}.type", code="unsupported_parameter")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        fields["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    return fields


def _format(req: ResponsesRequest) -> dict:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type", "text")
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema")}}}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind != "text":
        raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                       param="text.format.type")
    return {}


class OpenAIServingResponses:
    """Answers ResponsesRequests through an OpenAIServingChat."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def to_chat(self, req: ResponsesRequest) -> ChatCompletionRequest:
        """The chat completions request that runs `req`. Raises APIError 400."""
        for name in ResponsesRequest.UNIMPLEMENTED:
            if getattr(req, name) not in (None, False, "", [], {}):
                raise APIError(400, f"`{name}` is not supported: this server's /v1/responses is stateless",
                               param=name, code="unsupported_parameter")
        if req.store:
            raise APIError(400, "`store: true` is not supported: this server's /v1/responses is stateless "
                                "(send store: false)", param="store", code="unsupported_parameter")
        if req.truncation not in (None, "disabled"):
            raise APIError(400, "`truncation` must be disabled here", param="truncation",
                           code="unsupported_parameter")
        body = {"model": req.model, "messages": _messages(req), "max_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, **_tools(req),
                **_format(req)}
        effort = (req.reasoning or {}).get("effort")
        if effort is not None and "reasoning_effort" in self._template_variables():
            body["reasoning_effort"] = effort
        if req.stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return chat_request(body)

    def _template_variables(self) -> frozenset[str]:
        tok = self.chat.core.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return frozenset()
        return template_variables(template_source(tok))

    async def create(self, req: ResponsesRequest, raw: Request):
        answer = await self.chat.respond(self.to_chat(req), raw)
        if isinstance(answer, ChatCompletionResponse):
            return self._response(req, answer)
        return StreamingResponse(self._events(req, answer), media_type="text/event-stream")

    def _shell(self, req: ResponsesRequest, rid: str, status: str, **kw) -> ResponseObject:
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return ResponseObject(id=rid, status=status, model=self.chat.model_name, instructions=req.instructions,
                              max_output_tokens=req.max_output_tokens, temperature=req.temperature,
                              top_p=req.top_p, tools=req.tools or [], tool_choice=req.tool_choice or "auto",
                              parallel_tool_calls=bool(req.parallel_tool_calls), text={"format": fmt},
                              metadata=req.metadata or {}, **kw)

    @staticmethod
    def _usage(u) -> dict:
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": u.total_tokens}

    @staticmethod
    def _finish(finish_reason: str | None) -> tuple[str, dict | None]:
        if finish_reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _response(self, req: ResponsesRequest, r: ChatCompletionResponse) -> ResponseObject:
        c = r.choices[0]
        output: list[dict] = []
        if c.message.reasoning_content:
            output.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                           "content": [{"type": "reasoning_text", "text": c.message.reasoning_content}]})
        if c.message.content:
            output.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": c.message.content, "annotations": []}]})
        for call in c.message.tool_calls:
            output.append({"type": "function_call", "id": new_id("fc"), "call_id": call.id,
                           "name": call.function.name, "arguments": call.function.arguments, "status": "completed"})
        status, details = self._finish(c.finish_reason)
        if status == "incomplete" and output:  # the item being written when the output was cut
            output[-1]["status"] = "incomplete"
        return self._shell(req, f"resp_{r.id.split('-', 1)[-1]}", status, output=output,
                           incomplete_details=details, usage=self._usage(r.usage))

    async def _events(self, req: ResponsesRequest, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
        seq = 0
        rid = new_id("resp")
        output: list[dict] = []
        open_item: dict | None = None  # the item being streamed (reasoning, message or function_call)
        finish, usage = None, None

        def ev(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        def close(status: str = "completed") -> list[str]:
            """Ends the open item: status "incomplete" for the one the output was cut in."""
            nonlocal open_item
            if open_item is None:
                return []
            item, index, out = open_item, len(output) - 1, []
            if item["type"] in ("message", "reasoning"):
                text_kind = "output_text" if item["type"] == "message" else "reasoning_text"
                part = item["content"][0]
                out.append(ev(f"response.{text_kind}.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"]))
                if item["type"] == "message":
                    out.append(ev("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            else:
                out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"]))
            item["status"] = status
            out.append(ev("response.output_item.done", output_index=index, item=item))
            open_item = None
            return out

        def start(item: dict) -> list[str]:
            nonlocal open_item
            out = close()
            output.append(item)
            open_item = item
            index = len(output) - 1
            out.append(ev("response.output_item.added", output_index=index, item={**item, "status": "in_progress"}))
            if item["type"] == "message":
                out.append(ev("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            return out

        try:
            shell = self._shell(req, rid, "in_progress").model_dump()
            yield ev("response.created", response=shell)
            yield ev("response.in_progress", response=shell)
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    delta = choice.delta
                    for key, kind in (("reasoning_content", "reasoning"), ("content", "message")):
                        if not delta.get(key):
                            continue
                        if open_item is None or open_item["type"] != kind:
                            item = ({"type": "message", "id": new_id("msg"), "role": "assistant",
                                     "content": [{"type": "output_text", "text": "", "annotations": []}]}
                                    if kind == "message" else
                                    {"type": "reasoning", "id": new_id("rs"), "summary": [],
                                     "content": [{"type": "reasoning_text", "text": ""}]})
                            for e in start(item):
                                yield e
                        open_item["content"][0]["text"] += delta[key]
                        text_kind = "output_text" if kind == "message" else "reasoning_text"
                        yield ev(f"response.{text_kind}.delta", item_id=open_item["id"],
                                 output_index=len(output) - 1, content_index=0, delta=delta[key])
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        if call.get("id"):
                            for e in start({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                                            "name": fn.get("name", ""), "arguments": ""}):
                                yield e
                        if fn.get("arguments"):
                            open_item["arguments"] += fn["arguments"]
                            yield ev("response.function_call_arguments.delta", item_id=open_item["id"],
                                     output_index=len(output) - 1, delta=fn["arguments"])
                    finish = choice.finish_reason or finish
            status, details = self._finish(finish)
            for e in close(status):
                yield e
            final = self._shell(req, rid, status, output=output, incomplete_details=details,
                                usage=self._usage(usage) if usage else None)
            yield ev("response.completed" if status == "completed" else "response.incomplete",
                     response=final.model_dump())
        finally:
            await chunks.aclose()
