"""Bounds on a chat template that arrives in a request (vLLM's request
`chat_template`, honoured only under --trust-request-chat-template).
transformers renders it in Jinja's sandbox, which stops code from escaping
but not from running long or growing huge; these bounds keep one request from
taking a core or the memory:

- the `*` and `**` operators are refused (a string times a large number is
  allocated in one step, before any time check; chat templates do not need
  them);
- rendering stops after REQUEST_TEMPLATE_SECONDS (a trace function on the
  rendering thread checks the clock on every line the compiled template runs);
- the rendered text may be at most REQUEST_TEMPLATE_EXTRA_CHARS longer than
  the messages and tools it was given.

Each failure is an APIError 400 naming `chat_template`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jinja2
import jinja2.nodes

from .errors import APIError

REQUEST_TEMPLATE_SECONDS = 2.0
REQUEST_TEMPLATE_EXTRA_CHARS = 64 * 1024


def _refuse(why: str) -> APIError:
    return APIError(400, f"`chat_template`: {why}", param="chat_template")


def check_request_template(source: str) -> None:
    """Raises APIError 400 when the template does not parse or uses `*` / `**`."""
    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateError as e:
        raise _refuse(f"cannot be parsed: {e}") from e
    for node in tree.find_all((jinja2.nodes.Mul, jinja2.nodes.Pow)):
        raise _refuse(f"the `{'*' if isinstance(node, jinja2.nodes.Mul) else '**'}` operator is not allowed in a "
                      "request's template")


class _Deadline(Exception):
    pass


def render_bounded(render: Callable[[], str], input_chars: int) -> str:
    """render() on this thread, stopped after REQUEST_TEMPLATE_SECONDS; the
    text, refused when longer than input_chars + REQUEST_TEMPLATE_EXTRA_CHARS.
    Raises APIError 400."""
    deadline = time.monotonic() + REQUEST_TEMPLATE_SECONDS

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Deadline
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        text = render()
    except _Deadline as e:
        raise _refuse(f"rendering took longer than {REQUEST_TEMPLATE_SECONDS:g} s") from e
    finally:
        sys.settrace(previous)
    if len(text) > input_chars + REQUEST_TEMPLATE_EXTRA_CHARS:
        raise _refuse(f"the rendered prompt is {len(text)} characters, {len(text) - input_chars} more than the "
                      f"messages (at most {REQUEST_TEMPLATE_EXTRA_CHARS})")
    return text
