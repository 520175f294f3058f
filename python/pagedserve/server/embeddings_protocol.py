"""OpenAI embeddings bodies (POST /v1/embeddings), as OpenAI documents them,
with vLLM's extra request fields. An explicit null is the same as leaving a
field out (RequestBody)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from .protocol import PromptInput, PromptTokensDetails, RequestBody, random_id

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings. input: a string, a list of strings, a list of token
    ids or a list of token-id lists (one embedding each, in order).
    `dimensions` (shortening the vector, for models trained for it) is refused
    by name: the served model's vectors have its hidden size."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, unused
    # vLLM's: keep the prompt's last K tokens (-1: max_model_len); tokenizer's BOS etc.; scheduling priority
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    normalize: bool = True  # vLLM's: False returns the pooled vector as it is


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32s


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # cached_tokens: read from the prefix cache


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
