"""OpenAIServing: what the completions and chat endpoints share (vLLM's
serving_engine.py): model check, SamplingParams from a request, refusing
parameters we do not implement, and running one or several prompts through the
AsyncLLMEngine with client-disconnect handling.

A client that goes away (streaming or not) has every one of its requests
aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from ..engine.async_engine import AsyncLLMEngine
from ..engine.outputs import RequestOutput
from ..errors import UnenforceableConstraintError
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .errors import APIError, ClientDisconnected
from .protocol import CompletionTokensDetails, PromptTokensDetails, UsageInfo, _Request

_DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks its client is still there


def sse(obj, exclude: set[str] | None = None) -> str:
    """One server-sent event: `data: <json>\\n\\n`."""
    return f"data: {obj.model_dump_json(exclude=exclude)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_of(outputs: list[RequestOutput], reasoning_tokens: int | None = None) -> UsageInfo:
    """Token counts summed over the prompts of one API request;
    reasoning_tokens: of those output tokens, the thinking (None: no reasoning
    parser, no completion_tokens_details)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several output streams as their items arrive: yields
    (stream index, item). Closing it cancels the pending reads (which aborts
    the unfinished requests)."""
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)



def response_id(raw: Request, prefix: str) -> str:
    """A completion response's id: prefix-<the request's X-Request-Id> (the
    client's, or the one RequestIdMiddleware generated), or prefix-<uuid4 hex>
    where the app runs without that middleware."""
    return f"{prefix}-{getattr(raw.state, 'request_id', None) or uuid.uuid4().hex}"


def _engine_id(raw: Request, request_id: str) -> str:
    """The engine's id for a response id: unique even when two clients send
    the same X-Request-Id (a suffix then), else the response id itself."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}" if getattr(raw.state, "request_id_given", False) else request_id

class OpenAIServing:
    """Shared plumbing of the OpenAI endpoints.

    Args:
        engine: the AsyncLLMEngine (engine.engine gives the model name,
            tokenizer and limits).
    """

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.core = engine.engine
        self.model_name = self.core.model_name
        tok = self.core.tokenizer
        self.token_bytes = self.core.token_bytes or (lambda token_id: str(token_id).encode())
        if tok is not None:
            _ = self.core.structured_output  # build the grammar compiler now (~0.2 s), not in the first request

    # ---- request checks ---------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """Raises APIError 404 unless `name` is None or the served model."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "not_found_error", "model", "model_not_found")

    def reject_unsupported(self, req: _Request) -> None:
        """Raises APIError 400 naming a parameter that would change the result but
        is not implemented (silently ignoring it would give a wrong answer), or a
        priority other than 0 when the engine does not schedule by priority."""
        def refuse(param: str, why: str = "is not supported by this server"):
            raise APIError(400, f"`{param}` {why}", param=param, code="unsupported_parameter")

        if "tools" in req.UNIMPLEMENTED and req.tool_choice not in (None, "none", "auto"):
            refuse("tool_choice", "needs tools, which only /v1/chat/completions takes")
        if req.function_call not in (None, "none", "auto"):
            refuse("function_call", "is not supported by this server (use tools and tool_choice)")
        name = req.unimplemented_in_use()
        if name is not None:
            refuse(name)
        if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
            refuse("guided_decoding_backend", f"{req.guided_decoding_backend!r} is not available: this server's "
                                              "structured outputs run on xgrammar (auto or xgrammar)")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "`stream_options` needs `stream: true`", param="stream_options")
        if req.n > self.core.args.max_num_seqs:
            raise APIError(400, f"`n` = {req.n} exceeds this server's --max-num-seqs "
                                f"({self.core.args.max_num_seqs}): its choices could never run at once", param="n")
        self.check_priority(req.priority)

    def check_priority(self, priority: int) -> None:
        """Raises APIError 400 for a priority other than 0 when the engine does
        not schedule by priority (vLLM answers the same)."""
        policy = self.core.args.scheduling_policy
        if priority != 0 and policy != "priority":
            raise APIError(400, f"`priority` is only honoured with --scheduling-policy priority (this server runs "
                                f"{policy})", param="priority", code="unsupported_parameter")

    def sampling_params(self, req: _Request, max_tokens: int | None, prompt_len: int, *,
                        logprobs: int | None = None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams of one prompt; max_tokens None = what the context leaves
        (as OpenAI/vLLM); structured_outputs: the output constraint, if any.
        Raises APIError 400 on a value SamplingParams refuses."""
        if max_tokens is None:  # as many as the context leaves (OpenAI/vLLM)
            if prompt_len >= self.core.max_model_len:
                raise APIError(400, f"this model's maximum context length is {self.core.max_model_len} tokens, "
                                    f"but the prompt has {prompt_len} tokens, leaving no room for output",
                               param="prompt")
            max_tokens = self.core.max_model_len - prompt_len
        try:
            return SamplingParams(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, seed=req.seed, max_tokens=max_tokens,
                stop=req.stop or [], stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output, min_tokens=req.min_tokens,
                logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or [],
                skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs)
        except UnenforceableConstraintError as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from e
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def truncate(self, req: _Request, ids: list[int], keep_free: int = 0) -> list[int]:
        """The prompt's last req.truncate_prompt_tokens token ids (vLLM's
        truncate_prompt_tokens: -1 keeps the last max_model_len - keep_free,
        the most the request can take; None keeps all).
        Raises APIError 400 for 0, a value below -1 or above max_model_len."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        limit = self.core.max_model_len
        if k == -1:
            k = limit - keep_free
        if not 1 <= k <= limit:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, {limit}] (max_model_len), got "
                                f"{req.truncate_prompt_tokens}", param="truncate_prompt_tokens")
        return ids[-k:]

    def tokenize(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Prompt text or token ids -> token ids. Raises APIError 400 when empty or
        invalid (the tokenizer raises TypeError on text that is not valid Unicode,
        e.g. a lone surrogate)."""
        if not prompt:  # "" or []
            raise APIError(400, "the prompt is empty", param=param)
        try:
            return self.core.tokenize(prompt, add_special_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"cannot tokenize the prompt: {e}", param=param) from e

    def prompts(self, prompt, add_special_tokens: bool = True, param: str = "prompt") -> list[list[int]]:
        """A request's prompts (a string, a list of strings, a list of token ids
        or a list of token-id lists) as token-id lists. Raises APIError 400
        (param: the field, "prompt[i]" for one of a list) on an empty or invalid one."""
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [self.tokenize(prompt, param, add_special_tokens)]
        return [self.tokenize(p, f"{param}[{i}]", add_special_tokens) for i, p in enumerate(prompt)]

    def token_text_of(self, req: _Request):
        """How the request's logprobs show a token: its text, or with vLLM's
        return_tokens_as_token_ids "token_id:<id>" (a token that is part of a
        character decodes to U+FFFD on its own; its id never does)."""
        if req.return_tokens_as_token_ids:
            return lambda token_id: f"token_id:{token_id}"
        return self.token_text

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI shows it (leading space kept)."""
        return self.core.tokenizer.decode([token_id]) if self.core.tokenizer is not None else str(token_id)

    # ---- running requests -------------------------------------------------
    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], request_id: str,
                cache_salt: str | None, priority: int, timeline: bool = False
                ) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        return ids, [self.engine.generate(p, sp, rid, cache_salt, priority, timeline)
                     for p, sp, rid in zip(prompts, params, ids)]

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort(rid)  # no-op once finished

    async def _until_disconnect(self, raw: Request, coro, ids: list[str]):
        """Awaits coro; if the client goes away first, cancels it, aborts the
        requests and raises ClientDisconnected."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    raise ClientDisconnected(ids[0])
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self._abort(ids)

    @staticmethod
    async def _first_outputs(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """Each stream's first output; a rejected request becomes APIError 400
        (503 when the engine failed or stopped). On any failure the other reads
        are cancelled and awaited first, so the generators can be closed."""
        tasks = [asyncio.ensure_future(anext(g)) for g in gens]
        try:
            return list(await asyncio.gather(*tasks))
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except RuntimeError as e:
            raise APIError(503, str(e), "service_unavailable") from e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def generate_final(self, raw: Request, prompts: list[list[int]], params: list[SamplingParams],
                             request_id: str, cache_salt: str | None, priority: int = 0,
                             timeline: bool = False) -> list[RequestOutput]:
        """Runs every prompt to its end; returns the final outputs in prompt order.
        cache_salt, priority, timeline: as LLMEngine.add_request.

        Raises:
            APIError (400 rejected, 503 engine failure), ClientDisconnected.
        """
        ids, gens = self._submit(prompts, params, _engine_id(raw, request_id), cache_salt, priority, timeline)

        async def consume() -> list[RequestOutput]:
            final = await self._first_outputs(gens)
            async for i, out in merge(gens):
                final[i] = out
            return final

        try:
            return await self._until_disconnect(raw, consume(), ids)
        finally:
            self._abort(ids)
            for g in gens:
                await g.aclose()

    async def generate_stream(self, raw: Request, prompts: list[list[int]], params: list[SamplingParams],
                              request_id: str, cache_salt: str | None, priority: int = 0, timeline: bool = False
                              ) -> tuple[list[RequestOutput], AsyncIterator[tuple[int, RequestOutput]]]:
        """Starts every prompt and waits for their first outputs (so a rejected
        request is still a plain 400, not a broken stream). Returns those and an
        iterator over (prompt index, output) that yields them again, in prompt
        order, then the rest as they come; closing it (a client that went away)
        aborts every request. timeline: record each prompt's timeline (its
        final output carries it; GET /v1/requests/{id}/timeline shows it live).

        Raises:
            APIError (400 rejected, 503 engine failure), ClientDisconnected.
        """
        ids, gens = self._submit(prompts, params, _engine_id(raw, request_id), cache_salt, priority, timeline)
        try:
            firsts = await self._until_disconnect(raw, self._first_outputs(gens), ids)
        except BaseException:
            self._abort(ids)
            for g in gens:
                await g.aclose()
            raise

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            try:
                for i, out in enumerate(firsts):
                    yield i, out
                live = [g for g, o in zip(gens, firsts) if not o.finished]
                index = [i for i, o in enumerate(firsts) if not o.finished]
                async for j, out in merge(live):
                    yield index[j], out
            finally:
                self._abort(ids)
                for g in gens:
                    await g.aclose()

        return firsts, outputs()
