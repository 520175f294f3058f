"""POST /v1/chat/completions (vLLM's serving_chat.py): the model's chat template
renders the messages and the tools (ChatRenderer, chat_render.py); n choices,
logprobs, structured outputs, tool calls, streaming."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import RequestOutput
from ..reasoning import ReasoningParser, ReasoningStreamer, reasoning_token_count
from .chat_render import ChatRenderer
from .errors import APIError
from .logprobs import chat_logprobs, prompt_logprobs
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTemplateFields,
)
from .serving import SSE_DONE, OpenAIServing, response_id, sse, usage_of
from .structured_outputs import check_compiles, constraint_of
from .tool_calls import ToolCallStreamer, ToolPlan, finish_reason, parse_output


logger = logging.getLogger(__name__)

def chat_request(body: dict) -> ChatCompletionRequest:
    """A ChatCompletionRequest built from another API's request (/v1/messages,
    /v1/responses). Raises APIError 400 naming what does not validate."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from e


class OpenAIServingChat(OpenAIServing):
    """Answers ChatCompletionRequests."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.renderer, why = ChatRenderer.for_server(self.core.tokenizer, self.core.args)
        logger.info("tool calls: %s format (%s)", self.renderer.tool_parser.name, why)

    def reasoning_closed(self, messages: list[ChatMessage], template: ChatTemplateFields,
                         tools: list[dict] | None) -> bool:
        """With a reasoning parser: whether the prompt itself closed the
        reasoning, so the output is all answer. Only what the template adds
        after the messages counts (the generation prompt, e.g. an empty
        <think></think> when thinking is off), or, continuing a final assistant
        message, that message's own text; a tag in a user's text does not. A
        template that names neither of the parser's tags (SmolLM2's) never
        lets its model think in that format: the output is all answer,
        constrained from its first token (docs/serving.md, "Reasoning")."""
        parser = self.core.reasoning_parser
        if parser is None:
            return False
        source = self.renderer.template_of(template)
        if parser.start not in source and parser.end not in source:
            return True
        if template.continue_final_message:
            return parser.ended_in_prompt(messages[-1].text())
        if not template.add_generation_prompt:
            return False
        whole, head = (self.renderer.render_text(messages, template, tools, flag) for flag in (True, False))
        return whole.startswith(head) and parser.ended_in_prompt(whole[len(head):])

    def _logprobs(self, entries, req: ChatCompletionRequest) -> ChatLogprobs:
        return chat_logprobs(entries, self.token_text_of(req), self.token_bytes)

    async def create(self, req: ChatCompletionRequest, raw: Request):
        """The OpenAI answer: a ChatCompletionResponse, or Server-Sent Events of
        ChatCompletionChunks ending in [DONE]."""
        answer = await self.respond(req, raw)
        if isinstance(answer, ChatCompletionResponse):
            return answer
        return StreamingResponse(self._sse(req, answer), media_type="text/event-stream")

    @staticmethod
    async def _sse(req: ChatCompletionRequest, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
        exclude = None if req.include_usage else {"usage"}
        try:
            async for chunk in chunks:
                yield sse(chunk, exclude)
            yield SSE_DONE
        finally:
            await chunks.aclose()

    async def respond(self, req: ChatCompletionRequest, raw: Request
                      ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk]:
        """Runs a chat request: the whole ChatCompletionResponse, or (stream)
        an iterator of its ChatCompletionChunks, the usage chunk last with
        include_usage; closing it aborts the request. What other APIs
        (/v1/messages, /v1/responses) translate from. Raises APIError (4xx),
        ClientDisconnected."""
        self.check_model(req.model)
        self.reject_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(400, "`prompt_logprobs` is not available with `stream: true` (as vLLM)",
                           param="prompt_logprobs")
        plan = self.renderer.plan(req)
        constraint = constraint_of(req)
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"`{constraint[1]}` cannot be combined with tool_choice {plan.mode} "
                                    "(which constrains the output to tool calls)", param=constraint[1])
            constraint = (plan.constraint, "tools")
        if constraint is not None:
            await check_compiles(self.core, *constraint)
        ids = self.truncate(req, await run_in_threadpool(self.renderer.render, req.messages, req,
                                                         req.add_special_tokens, plan.tools))  # off the event loop
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.max_completion_tokens or req.max_tokens, len(ids), logprobs=logprobs,
                                      prompt_logprobs=req.prompt_logprobs,
                                      structured_outputs=constraint[0] if constraint else None)
        thinks = self.core.reasoning_parser
        if thinks is not None:  # the template may have closed the reasoning already (thinking turned off)
            params.reasoning_ended = await run_in_threadpool(self.reasoning_closed, req.messages, req, plan.tools)
            thinks = None if params.reasoning_ended else thinks
        request_id = response_id(raw, "chatcmpl")
        if not req.stream:
            (out,) = await self.generate_final(raw, [ids], [params], request_id, req.cache_salt, req.priority,
                                               req.timeline)
            echo = self.echoed(req)

            def choice(c) -> ChatChoice:
                text = echo + c.text  # the echoed text is split and parsed with the output
                reasoning, answer = thinks.split(text) if thinks is not None else (None, text)
                content, calls = parse_output(plan, answer) if answer is not None else (None, [])
                return ChatChoice(index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls,
                                                                             reasoning_content=reasoning),
                                  logprobs=self._logprobs(c.logprobs, req) if req.logprobs else None,
                                  finish_reason=finish_reason(c.finish_reason, calls), stop_reason=c.stop_reason)

            def response() -> ChatCompletionResponse:
                prompt_lps = None
                if req.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs(out.prompt_logprobs or [], req.prompt_logprobs,
                                                 self.token_text_of(req))
                return ChatCompletionResponse(id=request_id, model=self.model_name, usage=self.usage(out, thinks),
                                              choices=[choice(c) for c in out.outputs], prompt_logprobs=prompt_lps,
                                              timeline=[out.timeline] if req.timeline else None)

            slow = req.logprobs or req.prompt_logprobs is not None
            return await run_in_threadpool(response) if slow else response()
        firsts, outputs = await self.generate_stream(raw, [ids], [params], request_id, req.cache_salt, req.priority,
                                                     req.timeline)
        return self._stream(req, plan, thinks, request_id, firsts[0], outputs)

    @staticmethod
    def echoed(req: ChatCompletionRequest) -> str:
        """With vLLM's `echo`: the text the answer starts with, the final
        message's when it is the assistant's (continue_final_message), else ""."""
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    def usage(self, out: RequestOutput, thinks: ReasoningParser | None):
        """usage_of(out), with completion_tokens_details.reasoning_tokens under a
        reasoning parser (0 where the prompt turned thinking off)."""
        if self.core.reasoning_parser is None:
            return usage_of([out])
        return usage_of([out], 0 if thinks is None else sum(
            reasoning_token_count(thinks, c.token_ids, self.token_bytes) for c in out.outputs))

    async def _stream(self, req: ChatCompletionRequest, plan: ToolPlan, thinks: ReasoningParser | None,
                      request_id: str, first: RequestOutput,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[ChatCompletionChunk]:
        last = first  # the latest output: what continuous usage counts

        def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None,
                  stop_reason=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                stop_reason=stop_reason)],
                usage=self.usage(last, thinks) if req.continuous_usage else None)

        streamers = [ToolCallStreamer(plan) for _ in range(req.n)]
        reasoners = [ReasoningStreamer(thinks) for _ in range(req.n)] if thinks is not None else None

        def pieces(index: int, text: str, finished: bool) -> list[dict]:
            """The deltas of new text: the thinking first, the tool-call streamer sees only the answer."""
            deltas = []
            if reasoners is not None:
                thought, text = reasoners[index].feed(text)
                if finished:  # what was held back while it could still become a tag
                    more, rest = reasoners[index].finish()
                    thought, text = thought + more, text + rest
                deltas = [{"reasoning_content": thought}] if thought else []
            return deltas + streamers[index].feed(text)

        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
                for delta in pieces(i, self.echoed(req), False):  # vLLM's echo, split as the output is
                    yield chunk(i, delta)
            done: set[int] = set()
            async for _, out in outputs:
                last = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    lp = self._logprobs(c.delta_logprobs, req) if req.logprobs and c.delta_token_ids else None
                    deltas = pieces(c.index, c.delta_text, bool(c.finish_reason))
                    if lp and not deltas:  # the logprobs of tokens whose text is held back
                        deltas = [{"content": ""}] if plan.mode == "none" else [{}]
                    for k, delta in enumerate(deltas):
                        yield chunk(c.index, delta, logprobs=lp if k == 0 else None)
                    if c.finish_reason:
                        done.add(c.index)
                        deltas, reason = streamers[c.index].finish(c.finish_reason)
                        for delta in deltas:
                            yield chunk(c.index, delta)
                        yield chunk(c.index, {}, reason, stop_reason=c.stop_reason)
            if req.include_usage:
                yield ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                          usage=self.usage(last, thinks))
            if req.timeline:  # the final output carries it
                yield ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], timeline=[last.timeline])
        finally:
            await outputs.aclose()
