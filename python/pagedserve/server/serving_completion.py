"""POST /v1/completions (vLLM's serving_completion.py): one or several prompts,
n choices each, echo, logprobs (with echo, the prompt's too), vLLM's
prompt_logprobs, scoring with max_tokens 0 (scoring.py), streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import CompletionOutput, RequestOutput
from .errors import APIError
from .logprobs import TextOffsets, completion_logprobs, prompt_logprobs, with_top
from .protocol import CompletionChoice, CompletionRequest, CompletionResponse
from .serving import SSE_DONE, OpenAIServing, response_id, sse, usage_of
from .scoring import engine_max_tokens, without_output
from .structured_outputs import check_compiles, constraint_of


class OpenAIServingCompletion(OpenAIServing):
    """Answers CompletionRequests. Choice index = prompt index * n + choice
    index within that prompt, as OpenAI numbers them."""

    async def create(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        self.reject_unsupported(req)
        if req.best_of is not None and req.best_of > req.n:
            raise APIError(400, f"`best_of` ({req.best_of}) above n ({req.n}) is not supported by this server",
                           param="best_of", code="unsupported_parameter")
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(400, "`prompt_logprobs` is not available with `stream: true` (as vLLM)",
                           param="prompt_logprobs")
        max_tokens = engine_max_tokens(req.max_tokens, req.echo, req.prompt_logprobs)
        # tokenizing (and below, building a large logprobs response) runs on a worker
        # thread: the event loop keeps streaming other requests and noticing disconnects
        prompts = await run_in_threadpool(self.prompts, req.prompt, req.add_special_tokens)
        prompts = [self.truncate(req, p) for p in prompts]
        if req.max_tokens == 0:
            for i, p in enumerate(prompts):
                if len(p) >= self.core.max_model_len:
                    raise APIError(400, f"scoring a prompt of {len(p)} tokens needs one token of the context free "
                                        f"(max_model_len {self.core.max_model_len}): the engine samples a token "
                                        "after the prompt and drops it; use truncate_prompt_tokens "
                                        f"{self.core.max_model_len - 1} or a shorter prompt",
                                   param="prompt" if len(prompts) == 1 else f"prompt[{i}]")
        constraint = constraint_of(req)
        if constraint is not None:
            await check_compiles(self.core, *constraint)
        # one count of alternatives for both uses of the prompt's logprobs (each is cut to its own below)
        asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        params = [self.sampling_params(req, max_tokens, len(p), logprobs=req.logprobs,
                                       prompt_logprobs=max(asked) if asked else None,
                                       structured_outputs=constraint[0] if constraint else None) for p in prompts]
        request_id = response_id(raw, "cmpl")
        if not req.stream:
            outs = await self.generate_final(raw, prompts, params, request_id, req.cache_salt, req.priority,
                                             req.timeline)
            if req.max_tokens == 0:
                outs = [without_output(o) for o in outs]

            def response() -> CompletionResponse:
                choices = [self._choice(i * req.n + c.index, out, c, req) for i, out in enumerate(outs)
                           for c in out.outputs]
                return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                          usage=usage_of(outs),
                                          timeline=[o.timeline for o in outs] if req.timeline else None)

            slow = req.logprobs is not None or req.prompt_logprobs is not None
            return await run_in_threadpool(response) if slow else response()
        firsts, outputs = await self.generate_stream(raw, prompts, params, request_id, req.cache_salt, req.priority,
                                                     req.timeline)
        return StreamingResponse(self._stream(req, request_id, firsts, outputs), media_type="text/event-stream")

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.core.tokenizer.decode(out.prompt_token_ids) if self.core.tokenizer is not None else ""

    def _choice(self, index: int, out: RequestOutput, c: CompletionOutput, req: CompletionRequest) -> CompletionChoice:
        prefix = self._prompt_text(out) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            entries, ids = list(c.logprobs or []), list(c.token_ids)
            if req.echo:
                entries = with_top(out.prompt_logprobs or [], req.logprobs) + entries
                ids = list(out.prompt_token_ids) + ids
            logprobs = completion_logprobs(entries, ids, self.token_text_of(req), self.token_bytes)
        prompt_lps = None
        if req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs(out.prompt_logprobs or [], req.prompt_logprobs, self.token_text_of(req))
        return CompletionChoice(index=index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, prompt_logprobs=prompt_lps)

    async def _stream(self, req: CompletionRequest, request_id: str, firsts: list[RequestOutput],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        exclude = None if req.include_usage else {"usage"}
        offsets: dict[int, TextOffsets] = {}  # choice index -> where its next token starts
        done: set[int] = set()
        last = [without_output(o) for o in firsts] if req.max_tokens == 0 else list(firsts)

        def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            return sse(CompletionResponse(id=request_id, model=self.model_name, choices=[CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)],
                usage=usage_of(last) if req.continuous_usage else None), exclude)

        try:
            if req.echo:
                for i, out in enumerate(firsts):
                    for c in out.outputs:
                        index = i * req.n + c.index
                        lp = None
                        if req.logprobs is not None:
                            offsets[index] = TextOffsets()
                            lp = completion_logprobs(with_top(out.prompt_logprobs or [], req.logprobs),
                                                     out.prompt_token_ids, self.token_text_of(req), self.token_bytes,
                                                     offsets[index])
                        yield chunk(index, self._prompt_text(out), lp)
            async for i, out in outputs:
                if req.max_tokens == 0:
                    out = without_output(out)
                last[i] = out
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in done:
                        continue
                    lp = None
                    if req.logprobs is not None and c.delta_token_ids:
                        lp = completion_logprobs(c.delta_logprobs or [], c.delta_token_ids, self.token_text_of(req),
                                                 self.token_bytes, offsets.setdefault(index, TextOffsets()))
                    if not (c.delta_text or c.finish_reason or lp):
                        continue
                    if c.finish_reason:
                        done.add(index)
                    yield chunk(index, c.delta_text, lp, c.finish_reason, c.stop_reason)
            if req.include_usage:
                yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage_of(last)))
            if req.timeline:  # each prompt's final output carries its own
                yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                             timeline=[o.timeline for o in last]), {"usage"})
            yield SSE_DONE
        finally:
            await outputs.aclose()
