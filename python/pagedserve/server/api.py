"""The FastAPI app: OpenAI-compatible endpoints over an AsyncLLMEngine.

Errors are OpenAI-shaped JSON ({"error": {message, type, param, code}}) with a
4xx status; the engine keeps serving after any of them. A client that goes
away (streaming or not) has its request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncLLMEngine
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its request is aborted)."""


class APIError(Exception):
    """An error answered as OpenAI-style JSON with HTTP status `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('msg')}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    return f"{param}: {e.get('msg')}" if param else str(e.get("msg")), param


def create_app(engine: AsyncLLMEngine) -> FastAPI:
    """Builds the app. engine.engine gives the model name, tokenizer and limits."""
    app = FastAPI(title="PagedServe", version="0.1.0")
    core = engine.engine
    model_name = core.model_name

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {exc}", "internal_server_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           "not_found_error", "model", "model_not_found")

    def sampling_params(req, max_tokens: int | None, prompt_len: int) -> SamplingParams:
        if max_tokens is None:  # OpenAI/vLLM: as many as the context allows
            max_tokens = max(1, core.max_model_len - prompt_len)
        try:
            return SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  seed=req.seed, max_tokens=max_tokens, stop=req.stop or [],
                                  stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def tokenize(prompt: str | list[int]) -> list[int]:
        if not prompt:  # "" or []
            raise APIError(400, "the prompt is empty", param="prompt")
        try:
            return core.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e

    async def first_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Awaits the first output, turning a rejected request into a 400."""
        try:
            return await gen.__anext__()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except RuntimeError as e:
            raise APIError(503, str(e), "service_unavailable") from e

    async def until_disconnect(raw: Request, coro, request_id: str):
        """Awaits coro; if the client goes away first, cancels it, aborts the
        request and raises ClientDisconnected."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    raise ClientDisconnected(request_id)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                engine.abort(request_id)

    async def final_output(raw: Request, gen: AsyncIterator[RequestOutput], request_id: str) -> RequestOutput:
        """Consumes the stream to its last output; aborts if the client disconnects."""
        async def consume() -> RequestOutput:
            out = await first_output(gen)
            async for out in gen:
                pass
            return out

        try:
            return await until_disconnect(raw, consume(), request_id)
        finally:
            await gen.aclose()

    async def outputs_from(first: RequestOutput, gen: AsyncIterator[RequestOutput], request_id: str):
        """Yields `first`, then gen's outputs through the finished one. Closing or
        cancelling it (a client that went away) closes gen, which aborts the request."""
        try:
            out = first
            while True:
                yield out
                if out.finished:
                    return
                out = await gen.__anext__()
        finally:
            engine.abort(request_id)  # no-op once finished; frees the blocks of a client that left
            await gen.aclose()

    def usage(out: RequestOutput) -> UsageInfo:
        n_out = sum(len(c.token_ids) for c in out.outputs)
        return UsageInfo(prompt_tokens=len(out.prompt_token_ids), completion_tokens=n_out,
                         total_tokens=len(out.prompt_token_ids) + n_out,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))

    async def start_stream(raw: Request, gen: AsyncIterator[RequestOutput], request_id: str) -> RequestOutput:
        """The first output of a streamed request; aborts if the client leaves while it queues."""
        try:
            return await until_disconnect(raw, first_output(gen), request_id)
        except BaseException:
            await gen.aclose()
            raise

    def sse(obj) -> str:
        return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        """Engine counters (KV blocks, queues, preemptions), read between steps
        (the GIL serialises them with the engine thread's C++ calls)."""
        return {"num_kv_blocks": core.num_kv_blocks, "num_free_blocks": core.num_free_blocks,
                "num_running": core.scheduler.num_running, "num_waiting": core.scheduler.num_waiting,
                "num_preemptions": core.num_preemptions}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name, max_model_len=core.max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported yet; send one prompt",
                               param="prompt")
            prompt = prompt[0]
        ids = tokenize(prompt)
        params = sampling_params(req, req.max_tokens, len(ids))
        request_id = random_id("cmpl")
        gen = engine.generate(ids, params, request_id, req.cache_salt)
        if not req.stream:
            out = await final_output(raw, gen, request_id)
            return CompletionResponse(id=request_id, model=model_name, usage=usage(out), choices=[
                CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason) for c in out.outputs])
        first = await start_stream(raw, gen, request_id)

        async def stream():
            done: set[int] = set()
            async for out in outputs_from(first, gen, request_id):
                for c in out.outputs:
                    if c.index in done or not (c.delta_text or c.finish_reason):
                        continue
                    if c.finish_reason:
                        done.add(c.index)
                    yield sse(CompletionResponse(id=request_id, model=model_name, choices=[
                        CompletionChoice(index=c.index, text=c.delta_text, finish_reason=c.finish_reason)]))
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if core.tokenizer is None or not getattr(core.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        text = core.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                                  tokenize=False, add_generation_prompt=True)
        ids = core.tokenizer(text, add_special_tokens=False).input_ids
        params = sampling_params(req, req.max_completion_tokens or req.max_tokens, len(ids))
        request_id = random_id("chatcmpl")
        gen = engine.generate(ids, params, request_id, req.cache_salt)
        if not req.stream:
            out = await final_output(raw, gen, request_id)
            return ChatCompletionResponse(id=request_id, model=model_name, usage=usage(out), choices=[
                ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason)
                for c in out.outputs])
        first = await start_stream(raw, gen, request_id)

        def chunk(index: int, delta: dict, finish_reason: str | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model_name, choices=[
                ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)]))

        async def stream():
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            done: set[int] = set()
            async for out in outputs_from(first, gen, request_id):
                for c in out.outputs:
                    if c.index in done:
                        continue
                    if c.delta_text:
                        yield chunk(c.index, {"content": c.delta_text})
                    if c.finish_reason:
                        done.add(c.index)
                        yield chunk(c.index, {}, c.finish_reason)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app
