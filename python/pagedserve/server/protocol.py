"""OpenAI API schemas (pydantic). Out-of-range values fail validation and become
400 errors. An explicit null means "as if absent" for every field (RequestBody).
Fields of OpenAI's and vLLM's request surface that would change the answer are
declared here so that the server can honour them or refuse them by name
(serving.OpenAIServing.reject_unsupported); a field nobody declared is
ignored, as vLLM and other OpenAI-compatible servers do."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _json_object_or_text(text: str):
    """text parsed when it is a JSON object, else text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _one_prompt_error(value, handler):
    """A prompt of none of its four shapes is one error at the field (not one
    per shape, each named after pydantic's type tag, e.g. `prompt.str`)."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("prompt_type", "must be a string, a list of strings, a list of token ids "
                                                 "(integers) or a list of token-id lists") from None


# completions' prompt and embeddings' input
PromptInput = Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]], WrapValidator(_one_prompt_error)]


class RequestBody(BaseModel):
    """Base of every request body (and of the objects inside one): an explicit
    null is the same as leaving the field out, for every field (OpenAI marks
    optional fields nullable and client libraries send explicit nulls). So
    completions `max_tokens: null` is its default 16, as OpenAI documents."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(RequestBody):
    include_usage: bool = False  # one extra chunk with choices [] and the usage before [DONE]
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries the usage so far (vLLM's)


class _Request(RequestBody):
    """Fields both endpoints share. Penalties and min_p follow vLLM's SamplingParams."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)  # None: as many as the context leaves
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None  # requests with different salts never share cached prefixes
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # Structured outputs (server/structured_outputs.py): response_format
    # json_object / json_schema and vLLM's guided_* and structured_outputs.
    # Tools and tool_choice: chat only (server/tool_calls.py); completions
    # refuses them. functions and function_call (OpenAI's deprecated names) are
    # refused when they would change the result.
    logit_bias: dict[str, float] | None = None  # {token id: bias in [-100, 100]} (OpenAI's)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None  # tool_choice required: several calls only when true
    # OpenAI fields that do not change the text: accepted, unused
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    # vLLM's priority: lower is served first, under --scheduling-policy priority
    # (another policy refuses a value other than 0 with a 400, as vLLM does)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # vLLM's structured outputs (older guided_* names and the newer object)
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last K tokens (-1: max_model_len)
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string before this many output tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens that may be sampled
    bad_words: list[str] | None = None  # vLLM's: words never generated (SamplingParams.bad_words)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>"
    # vLLM's: per prompt token its logprob, rank and this many alternatives (not with stream)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    include_stop_str_in_output: bool = False  # vLLM's: keep the stop string that ended the text
    # PagedServe's extension: the response carries each prompt's timeline (engine/timeline.py); streamed, the
    # last chunk before [DONE] does (its choices empty)
    timeline: bool = False
    guided_decoding_backend: str | None = None  # vLLM's: only xgrammar here ("auto" and "xgrammar" accepted)
    # accepted, either value: the detokenizer (tokenizers' fast decoder) never puts spaces between special tokens
    spaces_between_special_tokens: bool = True
    # vLLM extensions that do not apply to this engine: accepted only with the value that means "off", else a
    # 400 names them (UNIMPLEMENTED): beam search, arbitrary logits processors (code), plugins' extra
    # arguments, a whitespace pattern (xgrammar takes none), OpenAI's pre-tools `functions`
    guided_whitespace_pattern: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logits_processors: list | None = None
    vllm_xargs: dict | None = None

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = (
        "functions", "guided_whitespace_pattern", "use_beam_search", "length_penalty", "logits_processors",
        "vllm_xargs")

    def unimplemented_in_use(self) -> str | None:
        """The first UNIMPLEMENTED field set to something other than its default
        (an empty list or object counts as unset), or None."""
        for name in self.UNIMPLEMENTED:
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default and not (default is None and value in ([], {}, "")):
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (stream_options.continuous_usage_stats, which vLLM
        honours together with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Request):
    """POST /v1/completions body. prompt: a string, a list of strings, a list of
    token ids, or a list of token-id lists (one set of n choices per prompt)."""

    prompt: PromptInput
    # OpenAI's and vLLM's default here; 0 (scoring): with echo or prompt_logprobs, nothing generated
    max_tokens: int | None = Field(default=16, ge=0, le=2**31 - 1)
    echo: bool = False  # prepend the prompt to the text (and its logprobs, with logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # top alternatives per token
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = _Request.UNIMPLEMENTED + ("suffix", "tools")


class ChatContentPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCall(RequestBody):
    name: str
    arguments: str  # a JSON object as text (OpenAI's form)


class ToolCall(RequestBody):
    """One tool call of an assistant message (in a request or an answer)."""

    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None  # None: an assistant turn without text
    name: str | None = None  # given to the chat template (most templates do not show it)
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (given back in the next request)
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def template_dict(self) -> dict:
        """The message as the chat template sees it: role, content text, name,
        tool calls (arguments as an object, as Hugging Face templates expect
        them; text that is not a JSON object stays text) and tool_call_id if given."""
        out: dict = {"role": self.template_role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_object_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @property
    def template_role(self) -> str:
        """The role given to the chat template: OpenAI's "developer" is the
        newer name of "system"."""
        return "system" if self.role == "developer" else self.role


class ChatTemplateFields(RequestBody):
    """How the chat template renders `messages` (vLLM's chat extensions, passed
    to transformers' apply_chat_template). A template variable the model's
    template does not read is refused by name, never ignored."""

    add_generation_prompt: bool = True  # open an assistant turn after the messages
    continue_final_message: bool = False  # leave the final (assistant) message open and continue its text
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    documents: list[dict[str, str]] | None = None  # for templates that take retrieval documents
    reasoning_effort: str | None = None  # a template variable of reasoning models' templates
    # vLLM's: a Jinja template replacing the model's for this request (needs --trust-request-chat-template)
    chat_template: str | None = None


class ChatCompletionRequest(_Request, ChatTemplateFields):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_special_tokens: bool = False  # vLLM: tokenizer's BOS etc. around the rendered text (the template has them)
    echo: bool = False  # vLLM's: the answer starts with the final message's text when that is the assistant's
    # do not apply to a text-only model without web access (400 when set)
    audio: dict | None = None
    web_search_options: dict | None = None
    verbosity: str | None = None
    modalities: list[Literal["text"]] | None = None  # only text output
    prediction: dict | None = None  # predicted outputs only make OpenAI faster: accepted, unused

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = _Request.UNIMPLEMENTED + (
        "audio", "web_search_options", "verbosity")


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # output tokens of the thinking (with --reasoning-parser)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    bytes: list[list[int]] = Field(default_factory=list)  # per token, raw bytes (extension; joined: the UTF-8)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs: a token's natural-log probability at
    one prompt position, its 1-based rank there and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first (nothing predicts
# it), else {token id: PromptLogprob} for the prompt's token and the alternatives
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the request's prompt_logprobs


# PagedServe's extension, with the request's `timeline: true`: one RequestTimeline.to_dict() per prompt
# (engine/timeline.py); absent from the JSON otherwise
def _timeline_field():
    return Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    """A completion, or one streamed chunk of it (same object, as OpenAI sends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timeline: list[dict[str, Any]] | None = _timeline_field()


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is only tool calls (or, with a reasoning parser, only thinking)
    reasoning_content: str | None = None  # the thinking, with --reasoning-parser (vLLM's)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the request's prompt_logprobs
    timeline: list[dict[str, Any]] | None = _timeline_field()


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # role, content, or tool_calls (each with its index; see tool_calls.py)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    timeline: list[dict[str, Any]] | None = _timeline_field()  # the last chunk's, with `timeline: true`


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize: `prompt` text, or chat `messages` rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None  # with messages: rendered by the chat template as chat requests render them
    add_special_tokens: bool | None = None  # unset: true for a prompt, false for messages (as the endpoints)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
