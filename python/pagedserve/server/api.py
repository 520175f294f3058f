"""The FastAPI app: OpenAI-compatible endpoints (completions, chat, responses,
embeddings; Anthropic's messages) over an AsyncLLMEngine, plus
/health, /version, /tokenize, /detokenize, /tokenizer_info, Prometheus /metrics and a web chat
page at / (its files in static/, served under /static).

Errors are OpenAI-shaped JSON ({"error": {message, type, param, code}}) with a
4xx status; the engine keeps serving after any of them. A client that goes
away (streaming or not) has its requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..engine.async_engine import AsyncLLMEngine
from ..engine.kv_map import kv_map
from .anthropic_protocol import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from .chat_render import template_source
from .embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from .errors import APIError, install_error_handlers
from .middleware import APIKeyMiddleware, BodySizeLimitMiddleware, RequestIdMiddleware
from .protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from .responses_protocol import ResponseObject, ResponsesRequest
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_embedding import OpenAIServingEmbedding
from .serving_messages import AnthropicServingMessages
from .serving_responses import OpenAIServingResponses
from .tool_calls import check_tools

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
STATIC_DIR = Path(__file__).parent / "static"  # the web chat page (plain HTML/CSS/JS)

# What /openapi.json documents (schemathesis checks the server against it): every
# error is an ErrorResponse; a streamed answer is text/event-stream.
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}
_SCHEMA_REF = "#/components/schemas/{model}"


def _sse(chunk: type[BaseModel]) -> dict:
    """OpenAPI content of a stream of `chunk`s as server-sent events, in the form
    FastAPI's own SSE endpoints use (OpenAPI 3.2's itemSchema: one event): each
    event's data is a chunk's JSON, the last one's `[DONE]`."""
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"$ref": _SCHEMA_REF.format(model=chunk.__name__)}}}
    return {"text/event-stream": {"itemSchema": {"type": "object", "required": ["data"],
                                                 "properties": {"data": data}}}}


def _typed_events() -> dict:
    """OpenAPI content of a stream of typed server-sent events (Anthropic's and
    the Responses API's): an `event:` name and a JSON object with a `type`."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}}
    return {"text/event-stream": {"itemSchema": {"type": "object", "required": ["data"],
                                                 "properties": {"event": {"type": "string"}, "data": data}}}}


# /v1/messages answers errors in Anthropic's shape
_ANTHROPIC_ERRORS = {status: {"model": AnthropicError} for status in (400, 401, 404, 413, 503)}


def _answers(model: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """OpenAPI responses of an endpoint answering `model` as JSON (or, when
    streamed, `chunk`s as server-sent events), or one of the errors."""
    return {200: {"model": model, "content": _sse(chunk)}, **_ERRORS}


def _document_models(app: FastAPI, *models: type[BaseModel]) -> None:
    """Adds `models` (and the models they use) to the components of the app's
    OpenAPI schema, for the streams' $refs: FastAPI adds only body models."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = build().setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=_SCHEMA_REF)
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
        return app.openapi_schema

    app.openapi = openapi


def create_app(engine: AsyncLLMEngine, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """Builds the app.

    Args:
        engine: the AsyncLLMEngine to serve.
        api_key: when set (not None or ""), /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise).
        max_body_bytes: larger request bodies get 413.
    """
    app = FastAPI(title="PagedServe", version=__version__)
    _document_models(app, ChatCompletionChunk)
    install_error_handlers(app)
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # last added = outermost: every response carries X-Request-Id
    core = engine.engine
    completion, chat = OpenAIServingCompletion(engine), OpenAIServingChat(engine)
    messages, responses = AnthropicServingMessages(chat), OpenAIServingResponses(chat)
    embedding = OpenAIServingEmbedding(engine)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def web_chat():
        """The web chat page (outside /v1: it asks for the API key itself when /v1 answers 401)."""
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        """Prometheus text format, vLLM's metric names (pagedserve.metrics)."""
        body, content_type = core.metrics.render()
        return Response(body, media_type=content_type)

    created = int(time.time())  # the model's `created`: when this server loaded it, the same in every listing

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models():
        return ModelList(data=[ModelCard(id=core.model_name, created=created, max_model_len=core.max_model_len)])

    @app.post("/v1/completions", response_model=None, responses=_answers(CompletionResponse, CompletionResponse))
    async def completions(req: CompletionRequest, raw: Request):
        return await completion.create(req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_answers(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await chat.create(req, raw)

    @app.post("/v1/messages", response_model=None,
              responses={200: {"model": MessageResponse, "content": _typed_events()}, **_ANTHROPIC_ERRORS})
    async def anthropic_messages(req: MessagesRequest, raw: Request):
        """Anthropic's Messages API over the chat pipeline (serving_messages.py)."""
        return await messages.create(req, raw)

    @app.post("/v1/responses", response_model=None,
              responses={200: {"model": ResponseObject, "content": _typed_events()}, **_ERRORS})
    async def openai_responses(req: ResponsesRequest, raw: Request):
        """OpenAI's Responses API, stateless, over the chat pipeline (serving_responses.py)."""
        return await responses.create(req, raw)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(req: EmbeddingRequest, raw: Request):
        """The served model's final hidden states pooled into one unit vector per
        input (--embedding-pooling), through the same engine (serving_embedding.py)."""
        return await embedding.create(req, raw)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ANTHROPIC_ERRORS)
    async def anthropic_count_tokens(req: CountTokensRequest):
        return await messages.count_tokens(req)

    @app.get("/v1/kv", responses={200: {"content": {"application/json": {}}}, 400: _ERRORS[400], 401: _ERRORS[401]})
    async def kv(hashes: bool = False):
        """The KV block pool block by block (engine/kv_map.py), read on the
        engine thread between two steps; hashes=true adds each cached block's
        prefix-cache hash prefix."""
        return await engine.call(lambda: kv_map(core.scheduler, hashes))

    @app.get("/v1/requests", responses={200: {"content": {"application/json": {}}}, 401: _ERRORS[401]})
    async def request_ids():
        """The ids of the requests that have a timeline: running ones, and the
        last --request-timelines N finished (oldest first)."""
        timelines = core.timelines
        return {"running": list(timelines.live), "finished": list(timelines.finished)}

    @app.get("/v1/requests/{request_id:path}/timeline", responses={200: {"content": {"application/json": {}}},
                                                             **_ERRORS})
    async def request_timeline(request_id: str):
        """A request's timeline (engine/timeline.py): while it runs, if it
        records one, and for the last --request-timelines N finished. Its id
        is the response's `id` (with `-<i>` for prompt i of a several-prompt
        completion)."""
        timeline = core.timelines.get(request_id)
        if timeline is None:
            shown = request_id if len(request_id) <= 100 else request_id[:100] + "..."
            raise APIError(404, f"no timeline for request `{shown}`: it is unknown, finished more than "
                                f"--request-timelines ({core.args.request_timelines}) requests ago, or recorded none",
                           "not_found_error", "request_id")
        return timeline.to_dict()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest):
        """Text (`prompt`) or chat `messages` -> token ids, as the endpoints would see them."""
        completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", param="prompt")
        if core.tokenizer is None:
            raise APIError(400, "this server has no tokenizer")

        def encode() -> list[int]:
            if req.messages is not None:
                return chat.renderer.render(req.messages, req, bool(req.add_special_tokens),
                                   check_tools(req.tools) if req.tools else None)
            try:
                return core.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens is not False).input_ids
            except (ValueError, TypeError) as e:
                raise APIError(400, f"cannot tokenize the prompt: {e}", param="prompt") from e

        ids = await run_in_threadpool(encode)  # off the event loop
        return TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=ids)

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info():
        """The tokenizer's special tokens, chat template and limits (vLLM's
        /tokenizer_info): what a client that tokenizes through /tokenize
        (lm-evaluation-harness's remote tokenizer) reads first."""
        tok = core.tokenizer
        if tok is None:
            raise APIError(400, "this server has no tokenizer")
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": template_source(tok) or None,
                "model_max_length": core.max_model_len, "vocab_size": len(tok)}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest):
        """Token ids -> text (special tokens kept)."""
        completion.check_model(req.model)
        if core.tokenizer is None:
            raise APIError(400, "this server has no tokenizer")
        try:
            ids = core.tokenize(req.tokens)  # validates the ids against the vocabulary
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from e
        return DetokenizeResponse(prompt=core.tokenizer.decode(ids))

    return app
