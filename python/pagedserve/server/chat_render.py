"""ChatRenderer: a chat request's messages (and the tools it shows the model)
rendered into prompt token ids through the model's chat template
(transformers' apply_chat_template), with the request's template fields.
The server's chat routes and the scale-out ingress (which hashes the prompt
the replica will see, scaleout/ray_app.py) render with this one class."""

from __future__ import annotations

import functools
import json

import jinja2
import jinja2.meta

from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, ChatTemplateFields
from .template_guard import check_request_template, render_bounded
from .tool_calls import TEMPLATE_HINT, ToolPlan, plan_tools
from .tool_parsers import ToolParser, choose_tool_parser


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


class ChatRenderer:
    """Renders chat requests for one tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer (its chat_template is the
            model's template); None for a server without one.
        tool_parser: the server's tool-call format (what tool_choice "auto" expects).
        trust_request_chat_template: honour a request's own `chat_template`
            (--trust-request-chat-template).
    """

    def __init__(self, tokenizer, tool_parser: ToolParser, trust_request_chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.trust_request_chat_template = trust_request_chat_template

    @classmethod
    def for_server(cls, tokenizer, args) -> tuple[ChatRenderer, str]:
        """The renderer of a server started with ``args`` (its
        --tool-call-parser and --trust-request-chat-template): the tool-call
        format chosen for the model's template (tool_parsers.choose_tool_parser),
        and why that one."""
        has_template = tokenizer is not None and getattr(tokenizer, "chat_template", None)
        parser, why = choose_tool_parser(args.tool_call_parser, template_source(tokenizer) if has_template else "")
        return cls(tokenizer, parser, args.trust_request_chat_template), why

    def plan(self, req: ChatCompletionRequest) -> ToolPlan:
        """The request's ToolPlan (tool_calls.plan_tools): which tools the
        template shows and how the output is read. Raises APIError 400 as
        plan_tools does, or for a request template it may not use."""
        source = self.template_of(req) if req.chat_template else None
        tok = self.tokenizer
        return plan_tools(req, tok is not None and template_reads_tools(tok, source), self.tool_parser)

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
        tok = self.tokenizer
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
        tok, source = self.tokenizer, self.template_of(template)
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

    def template_of(self, template: ChatTemplateFields) -> str:
        """The chat template text a request renders with: its own chat_template
        (vLLM's; only under --trust-request-chat-template, else APIError 400),
        or the model's ("" when it has none)."""
        if template.chat_template:
            if not self.trust_request_chat_template:
                raise APIError(400, "`chat_template` in a request is honoured only when the server runs with "
                                    "--trust-request-chat-template", param="chat_template",
                               code="unsupported_parameter")
            return template.chat_template
        tok = self.tokenizer
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
