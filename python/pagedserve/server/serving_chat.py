"""POST /v1/chat/completions (vLLM's serving_chat.py): the model's chat template
(through transformers) renders the messages (and the tools); n choices,
logprobs, structured outputs, tool calls, streaming."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator

import jinja2
import jinja2.meta
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import RequestOutput
from ..reasoning import ReasoningParser, ReasoningStreamer, reasoning_token_count
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
from .template_guard import check_request_template, render_bounded
from .tool_calls import TEMPLATE_HINT, ToolCallStreamer, ToolPlan, finish_reason, parse_output, plan_tools
from .tool_parsers import choose_tool_parser


logger = logging.getLogger(__name__)

# apply_chat_template's own arguments and what the server passes itself
RESERVED_TEMPLATE_ARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens", "reasoning_effort"})


@functools.lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """Names a Jinja chat template reads from its context (jinja2.meta)."""
    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source)))


def template_source(tok) -> str:
    """The tokenizer's chat template text (of named templates, the default one)."""
    source = tok.chat_template or ""
    return source.get("default", "") if isinstance(source, dict) else source


def template_reads_tools(tok, source: str | None = None) -> bool:
    """Whether the chat template (source, else the tokenizer's) renders `tools`
    (a named "tool_use" template counts)."""
    if source is None and isinstance(tok.chat_template, dict) and "tool_use" in tok.chat_template:
        return True
    try:
        return "tools" in template_variables(source if source is not None else template_source(tok))
    except jinja2.TemplateError:
        return False


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
        tok = self.core.tokenizer
        template = template_source(tok) if tok is not None and getattr(tok, "chat_template", None) else ""
        self.tool_parser, why = choose_tool_parser(self.core.args.tool_call_parser, template)
        logger.info("tool calls: %s format (%s)", self.tool_parser.name, why)

    def render(self, messages: list[ChatMessage], template: ChatTemplateFields,
               add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Messages -> prompt token ids through the tokenizer's chat template
        (transformers' apply_chat_template), with the request's template fields
        and the tools to show the model (None: none).

        Raises:
            APIError 400: empty messages, no chat template, tool calls or tool
                results the template cannot render, continue_final_message with
                add_generation_prompt or without a final assistant message, a
                template variable the model's template does not read (named).
        """
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        tok = self.core.tokenizer
        source = self.template_of(template)
        if not source:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        for i, m in enumerate(messages):
            if m.content is None and m.role != "assistant":
                raise APIError(400, "only assistant messages may have no content", param=f"messages.{i}.content")
            if m.tool_calls and "tool_calls" not in source:
                raise APIError(400, f"this model's chat template cannot render an assistant's tool calls; "
                                    f"{TEMPLATE_HINT}", param=f"messages.{i}.tool_calls", code="unsupported_parameter")
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, "only assistant messages have tool calls", param=f"messages.{i}.tool_calls")
        if template.continue_final_message:
            if template.add_generation_prompt:
                raise APIError(400, "`continue_final_message` cannot be combined with `add_generation_prompt: true` "
                                    "(one continues the final message, the other opens a new turn)",
                               param="continue_final_message")
            if messages[-1].role != "assistant" or not messages[-1].text():
                raise APIError(400, "`continue_final_message` needs a final assistant message with text to continue",
                               param="continue_final_message")
        text = self.render_text(messages, template, tools)
        try:
            return tok(text, add_special_tokens=add_special_tokens).input_ids
        except (ValueError, TypeError) as e:  # e.g. text that is not valid Unicode (a lone surrogate)
            raise APIError(400, f"cannot render the messages: {e}", param="messages") from e

    def render_text(self, messages: list[ChatMessage], template: ChatTemplateFields, tools: list[dict] | None,
                    add_generation_prompt: bool | None = None) -> str:
        """The chat template's text for the messages (render's, before
        tokenizing; add_generation_prompt None: the request's). A request's own
        template is rendered within template_guard's bounds. Raises APIError
        400 for anything the template raises."""
        tok, source = self.core.tokenizer, self.template_of(template)
        extra = self._template_extras(source, template)
        dicts = [m.template_dict() for m in messages]

        def draw() -> str:
            return tok.apply_chat_template(
                dicts, tools=tools, documents=template.documents or None, tokenize=False,
                chat_template=template.chat_template or None,
                add_generation_prompt=(template.add_generation_prompt if add_generation_prompt is None
                                       else add_generation_prompt),
                continue_final_message=template.continue_final_message, **extra)

        try:
            if not template.chat_template:
                return draw()
            check_request_template(template.chat_template)
            return render_bounded(draw, len(json.dumps(dicts, default=str)) + len(json.dumps(tools or [])))
        except APIError:
            raise
        except (ValueError, TypeError) as e:  # e.g. text that is not valid Unicode (a lone surrogate)
            raise APIError(400, f"cannot render the messages: {e}", param="messages") from e
        except jinja2.TemplateError as e:  # the template's own raise_exception (e.g. roles it refuses)
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from e
        except Exception as e:  # what a template's own code raises (1/0, runaway recursion, a range too big)
            raise APIError(400, f"the chat template failed: {type(e).__name__}: {e}",
                           param="chat_template" if template.chat_template else "messages") from e

    def reasoning_closed(self, messages: list[ChatMessage], template: ChatTemplateFields,
                         tools: list[dict] | None) -> bool:
        """With a reasoning parser: whether the prompt itself closed the
        reasoning, so the output is all answer. Only what the template adds
        after the messages counts (the generation prompt, e.g. an empty
        <think></think> when thinking is off), or, continuing a final assistant
        message, that message's own text; a tag in a user's text does not."""
        parser = self.core.reasoning_parser
        if parser is None:
            return False
        if template.continue_final_message:
            return parser.ended_in_prompt(messages[-1].text())
        if not template.add_generation_prompt:
            return False
        whole, head = (self.render_text(messages, template, tools, flag) for flag in (True, False))
        return whole.startswith(head) and parser.ended_in_prompt(whole[len(head):])

    def _logprobs(self, entries, req: ChatCompletionRequest) -> ChatLogprobs:
        return chat_logprobs(entries, self.token_text_of(req), self.token_bytes)

    def template_of(self, template: ChatTemplateFields) -> str:
        """The chat template text a request renders with: its own chat_template
        (vLLM's; only under --trust-request-chat-template, else APIError 400),
        or the model's ("" when it has none)."""
        if template.chat_template:
            if not self.core.args.trust_request_chat_template:
                raise APIError(400, "`chat_template` in a request is honoured only when the server runs with "
                                    "--trust-request-chat-template", param="chat_template",
                               code="unsupported_parameter")
            return template.chat_template
        tok = self.core.tokenizer
        return template_source(tok) if tok is not None and getattr(tok, "chat_template", None) else ""

    @staticmethod
    def _template_extras(source: str, template: ChatTemplateFields) -> dict:
        """The extra variables for apply_chat_template: chat_template_kwargs and
        reasoning_effort. Raises APIError 400 naming a kwarg that is
        apply_chat_template's own argument, or a variable (documents included)
        the model's template does not read."""
        extra = dict(template.chat_template_kwargs or {})
        asked = {f"chat_template_kwargs.{name}": name for name in extra}  # param -> template variable
        if template.reasoning_effort is not None:
            extra["reasoning_effort"] = template.reasoning_effort
            asked["reasoning_effort"] = "reasoning_effort"
        if template.documents:
            asked["documents"] = "documents"
        if not asked:
            return extra
        try:
            variables = template_variables(source)
        except jinja2.TemplateError as e:
            raise APIError(400, f"this model's chat template cannot be parsed: {e}", param="messages") from e
        for param, name in asked.items():
            if param.startswith("chat_template_kwargs.") and name in RESERVED_TEMPLATE_ARGS:
                raise APIError(400, f"`{param}` is set by the server; use the request field", param=param)
            if name not in variables:
                raise APIError(400, f"this model's chat template does not use `{name}`", param=param,
                               code="unsupported_parameter")
        return extra

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
        tok = self.core.tokenizer
        source = self.template_of(req) if req.chat_template else None
        plan = plan_tools(req, tok is not None and template_reads_tools(tok, source), self.tool_parser)
        constraint = constraint_of(req)
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"`{constraint[1]}` cannot be combined with tool_choice {plan.mode} "
                                    "(which constrains the output to tool calls)", param=constraint[1])
            constraint = (plan.constraint, "tools")
        if constraint is not None:
            await check_compiles(self.core, *constraint)
        ids = self.truncate(req, await run_in_threadpool(self.render, req.messages, req, req.add_special_tokens,
                                                         plan.tools))  # off the event loop
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
        firsts, outputs = await self.generate_stream(raw, [ids], [params], request_id, req.cache_salt, req.priority)
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
        finally:
            await outputs.aclose()
