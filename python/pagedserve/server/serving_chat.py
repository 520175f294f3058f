"""POST /v1/chat/completions (vLLM's serving_chat.py): the model's chat template
(through transformers) renders the messages; n choices, logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import RequestOutput
from .errors import APIError
from .logprobs import chat_logprobs
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    random_id,
)
from .serving import SSE_DONE, OpenAIServing, sse, usage_of


class OpenAIServingChat(OpenAIServing):
    """Answers ChatCompletionRequests."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Messages -> prompt token ids through the tokenizer's chat template.
        Raises APIError 400 when empty or when the model has no chat template."""
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        tok = self.core.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if any(m.content is None and m.role != "assistant" for m in messages):
            raise APIError(400, "only assistant messages may have no content", param="messages")
        try:
            text = tok.apply_chat_template([{"role": m.template_role, "content": m.text()} for m in messages],
                                           tokenize=False, add_generation_prompt=add_generation_prompt)
            return tok(text, add_special_tokens=False).input_ids
        except (ValueError, TypeError) as e:  # e.g. text that is not valid Unicode (a lone surrogate)
            raise APIError(400, f"cannot render the messages: {e}", param="messages") from e

    async def create(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        self.reject_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        ids = await run_in_threadpool(self.render, req.messages)  # off the event loop
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.max_completion_tokens or req.max_tokens, len(ids), logprobs=logprobs)
        request_id = random_id("chatcmpl")
        if not req.stream:
            (out,) = await self.generate_final(raw, [ids], [params], request_id, req.cache_salt)

            def response() -> ChatCompletionResponse:
                return ChatCompletionResponse(id=request_id, model=self.model_name, usage=usage_of([out]), choices=[
                    ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                               logprobs=chat_logprobs(c.logprobs, self.token_text) if req.logprobs else None,
                               finish_reason=c.finish_reason) for c in out.outputs])

            return await run_in_threadpool(response) if req.logprobs else response()
        _, outputs = await self.generate_stream(raw, [ids], [params], request_id, req.cache_salt)
        return StreamingResponse(self._stream(req, request_id, outputs), media_type="text/event-stream")

    async def _stream(self, req: ChatCompletionRequest, request_id: str,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        exclude = None if req.include_usage else {"usage"}

        def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]), exclude)

        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            done: set[int] = set()
            last: RequestOutput | None = None  # the outputs always hold at least the first one
            async for _, out in outputs:
                last = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    lp = chat_logprobs(c.delta_logprobs, self.token_text) if req.logprobs and c.delta_token_ids else None
                    if c.delta_text or lp:
                        yield chunk(c.index, {"content": c.delta_text}, logprobs=lp)
                    if c.finish_reason:
                        done.add(c.index)
                        yield chunk(c.index, {}, c.finish_reason)
            if req.include_usage:
                yield sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                              usage=usage_of([last])))
            yield SSE_DONE
        finally:
            await outputs.aclose()
