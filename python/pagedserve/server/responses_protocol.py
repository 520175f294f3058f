"""OpenAI Responses API bodies (POST /v1/responses, stateless): the request
and the Response object, as OpenAI documents them. An explicit null is the
same as leaving a field out (RequestBody)."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from .protocol import RequestBody


class ResponsesRequest(RequestBody):
    """POST /v1/responses. Stateless: `store: true`, `previous_response_id`,
    `conversation` and `background` are refused by name (nothing is kept
    between requests); built-in tools (web search, file search, computer use)
    are refused."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: the template's reasoning_effort, if it reads one
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    truncation: str | None = None  # "disabled" (default) or "auto": the prompt's oldest tokens are cut to fit

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ("previous_response_id", "conversation", "background")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseObject(BaseModel):
    """A Response: status, its output items (reasoning, message, function_call)
    and usage, echoing the request's settings as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)
    usage: dict[str, Any] | None = None
