"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API,
as vLLM and llama-server serve it): the request is translated into a chat
completions request and run by OpenAIServingChat.respond, the same pipeline
(chat template, sampling, structured outputs, tool calls, metrics, disconnect
abort); its answer, whole or streamed, is translated back.

- system -> a system message; `tool_use` blocks -> the assistant's tool_calls
  (input as JSON arguments); `tool_result` blocks -> `tool` messages.
- tools (name, description, input_schema) -> function tools; tool_choice
  auto / any / tool / none -> auto / required / the named function / none;
  disable_parallel_tool_use -> parallel_tool_calls false.
- stop_reason: "end_turn" (EOS or a stop token), "stop_sequence" (with
  stop_sequence), "max_tokens", "tool_use".
- Streaming: message_start, ping, per block content_block_start /
  content_block_delta (text_delta, input_json_delta) / content_block_stop,
  message_delta (stop reason, output tokens), message_stop.
Errors have Anthropic's shape ({"type": "error", "error": {type, message}};
errors.error_response chooses it by path).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from .anthropic_protocol import (
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    event,
)
from .errors import APIError
from .protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from .serving_chat import OpenAIServingChat, chat_request

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish_reason: str | None, stop_reason) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The conversation as chat completions messages. Raises APIError 400 for
    a block in the wrong role."""
    out: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if b.type == "text")
        wrong = "tool_result" if m.role == "assistant" else "tool_use"
        if any(b.type == wrong for b in m.content):
            raise APIError(400, f"messages.{i}: a {m.role} message cannot hold {wrong} blocks",
                           param=f"messages.{i}.content")
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if b.type == "tool_use"]
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                for b in m.content if b.type == "tool_result"]
        if text or not any(b.type == "tool_result" for b in m.content):
            out.append({"role": "user", "content": text})
    return out


def _tools(req: MessagesRequest | CountTokensRequest) -> dict:
    """tools and tool_choice as chat completions fields. Raises APIError 400
    for a tool_choice that forces a tool (any, tool) without tools."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
            raise APIError(400, f"tool_choice type {req.tool_choice.type} needs `tools`", param="tool_choice")
        return {}
    fields: dict = {"tools": [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.input_schema}}
        for t in req.tools]}
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice type tool needs a name", param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


class AnthropicServingMessages:
    """Answers MessagesRequests through an OpenAIServingChat."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def to_chat(self, req: MessagesRequest) -> ChatCompletionRequest:
        """The chat completions request that runs `req`. Raises APIError 400."""
        for name in MessagesRequest.UNIMPLEMENTED:
            if getattr(req, name) not in (None, [], {}):
                raise APIError(400, f"`{name}` is not supported by this server", param=name,
                               code="unsupported_parameter")
        return chat_request({
            "model": req.model, "messages": _messages(req), "max_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k or 0,
            "stop": req.stop_sequences or None, "stream": req.stream, **_tools(req),
            **({"stream_options": {"include_usage": True, "continuous_usage_stats": True}} if req.stream else {})})

    async def create(self, req: MessagesRequest, raw: Request):
        chat_req = self.to_chat(req)
        try:
            answer = await self.chat.respond(chat_req, raw)
        except APIError as e:
            if e.param == "stop":  # the chat field stop_sequences became: named as the client wrote it
                raise APIError(e.status, e.message.replace("`stop`", "`stop_sequences`"), e.type,
                               "stop_sequences", e.code) from e
            raise
        if isinstance(answer, ChatCompletionResponse):
            return self._message(answer)
        return StreamingResponse(self._events(answer), media_type="text/event-stream")

    def _message(self, r: ChatCompletionResponse) -> MessageResponse:
        c = r.choices[0]
        content: list[dict] = []
        if c.message.content:
            content.append({"type": "text", "text": c.message.content})
        for call in c.message.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                            "input": json.loads(call.function.arguments)})
        if not content:
            content.append({"type": "text", "text": ""})
        stop, sequence = _stop_reason(c.finish_reason, c.stop_reason)
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else None
        return MessageResponse(id=f"msg_{r.id.split('-', 1)[-1]}", model=r.model, content=content,
                               stop_reason=stop, stop_sequence=sequence,
                               usage=AnthropicUsage(input_tokens=r.usage.prompt_tokens,
                                                    output_tokens=r.usage.completion_tokens,
                                                    cache_read_input_tokens=cached))

    async def _events(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
        started, block, kind = False, -1, None  # the open content block's index and type
        stop, sequence, output_tokens = "end_turn", None, 0

        def open_block(new_kind: str, content_block: dict):
            nonlocal block, kind
            out = [event("content_block_stop", {"index": block})] if kind is not None else []
            block, kind = block + 1, new_kind
            return out + [event("content_block_start", {"index": block, "content_block": content_block})]

        try:
            async for chunk in chunks:
                if not started:
                    started = True
                    usage = chunk.usage
                    yield event("message_start", {"message": {
                        "id": f"msg_{chunk.id.split('-', 1)[-1]}", "type": "message", "role": "assistant",
                        "content": [], "model": chunk.model, "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": usage.prompt_tokens if usage else 0, "output_tokens": 0}}})
                    yield event("ping", {})
                if chunk.usage is not None:
                    output_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.get("content"):
                        if kind != "text":
                            for e in open_block("text", {"type": "text", "text": ""}):
                                yield e
                        yield event("content_block_delta", {"index": block, "delta": {
                            "type": "text_delta", "text": delta["content"]}})
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        if call.get("id"):
                            for e in open_block("tool_use", {"type": "tool_use", "id": call["id"],
                                                             "name": fn.get("name", ""), "input": {}}):
                                yield e
                        if fn.get("arguments"):
                            yield event("content_block_delta", {"index": block, "delta": {
                                "type": "input_json_delta", "partial_json": fn["arguments"]}})
                    if choice.finish_reason:
                        stop, sequence = _stop_reason(choice.finish_reason, choice.stop_reason)
            if kind is None:  # nothing was said: one empty text block, as the whole answer has
                for e in open_block("text", {"type": "text", "text": ""}):
                    yield e
            yield event("content_block_stop", {"index": block})
            yield event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": sequence},
                                          "usage": {"output_tokens": output_tokens}})
            yield event("message_stop", {})
        finally:
            await chunks.aclose()

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens as /v1/messages would render it (tools included)."""
        self.chat.check_model(req.model)
        chat_req = chat_request({"model": req.model, "messages": _messages(req), **_tools(req)})
        renderer = self.chat.renderer
        tools = renderer.plan(chat_req).tools
        ids = await run_in_threadpool(renderer.render, chat_req.messages, chat_req, False, tools)
        return CountTokensResponse(input_tokens=len(ids))
