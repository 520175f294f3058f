"""Anthropic Messages API bodies (POST /v1/messages, /v1/messages/count_tokens):
the request, the message, and the streamed events, as Anthropic documents them.
An explicit null is the same as leaving a field out (RequestBody)."""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from .protocol import RequestBody


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock


class AnthropicMessage(RequestBody):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(RequestBody):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class AnthropicToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(RequestBody):
    """POST /v1/messages. `thinking`, `container`, `mcp_servers` and
    `service_tier` other than auto do not apply and are refused by name."""

    model: str | None = None
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None  # user_id: accepted, unused
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list | None = None
    service_tier: str | None = None

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ("thinking", "container", "mcp_servers")


class CountTokensRequest(RequestBody):
    """POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None  # prompt tokens served from the prefix cache


class MessageResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]  # text and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def event(name: str, data: dict) -> str:
    """One server-sent event as Anthropic streams them: `event:` and `data:` lines."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"

