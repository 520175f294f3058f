"""``pagedserve chat``: a multi-turn chat in the terminal, each answer printed as
it is generated.

With --url it talks to a running OpenAI-compatible server (streamed over
Server-Sent Events); without it, it loads the model in this process with the
server's engine flags (--model, --dtype, ...). Type a message and Enter.
/reset clears the history (the --system prompt stays), /exit or Ctrl-D quits;
Ctrl-C during an answer stops it (a server aborts the request) and keeps what
was shown in the history, Ctrl-C at the prompt drops the line typed so far.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Protocol, TextIO

from ..config import EngineArgs

PROMPT = "> "


class ChatError(Exception):
    """A turn that failed, with the reason to show; the chat goes on without that turn."""


class ChatBackend(Protocol):
    """Where the answers come from (ServerChat, EngineChat)."""

    def describe(self) -> str:
        """The model and where it runs, for the greeting."""

    def stream(self, messages: list[dict]) -> Iterator[str]:
        """The answer to the OpenAI-style messages, in text pieces as they are generated;
        closing the iterator early stops the generation."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; each flag with its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser(prog: str = "pagedserve chat") -> argparse.ArgumentParser:
    """The chat's flags, then the engine flags (used without --url)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000 (without it: the model "
                                 "is loaded in this process with the engine flags; with it, --model is only the "
                                 "requests' model name and the other engine flags are unused)")
    p.add_argument("--api-key", help="with --url: sent as 'Authorization: Bearer <key>'; "
                                     "unset: env PAGEDSERVE_API_KEY")
    p.add_argument("--system", help="system prompt, the first message of every conversation")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, 0 = greedy")
    p.add_argument("--max-tokens", type=int, help="output tokens per answer at most; unset: what the context leaves")
    return EngineArgs.add_cli_args(p)


def open_backend(args: argparse.Namespace) -> ChatBackend:
    """ServerChat for --url, else EngineChat (loads the model: seconds to a minute)."""
    if args.url:
        from .chat_server import ServerChat

        return ServerChat(args.url, args.api_key or os.environ.get("PAGEDSERVE_API_KEY"), args.model,
                          args.temperature, args.max_tokens)
    from .chat_engine import EngineChat

    print("loading the model ...", file=sys.stderr, flush=True)
    return EngineChat(EngineArgs.from_cli_args(args), args.temperature, args.max_tokens)


def stream_answer(backend: ChatBackend, messages: list[dict], out: TextIO) -> str | None:
    """Writes one answer to out as it arrives. Returns its text (only what was
    shown when Ctrl-C stopped it), or None when the turn failed (the reason goes
    to stderr) or was stopped before any text."""
    parts: list[str] = []
    stream = backend.stream(messages)
    try:
        for piece in stream:
            out.write(piece)
            out.flush()
            parts.append(piece)
        out.write("\n")
    except KeyboardInterrupt:
        out.write(" [stopped]\n")
    except ChatError as e:
        out.write("\n" if parts else "")
        print(f"error: {e}", file=sys.stderr)
        return None
    finally:
        stream.close()  # a stopped answer: the request is aborted
    return "".join(parts) or None


def chat_loop(backend: ChatBackend, system: str | None, read: Callable[[str], str] = input,
              out: TextIO = sys.stdout) -> None:
    """Reads user lines with read(PROMPT) until /exit or EOF and streams each
    answer to out; the whole conversation so far is sent with every turn."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        try:
            line = read(PROMPT).strip()
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if line == "/exit":
            return
        if line == "/reset":
            history = list(start)
            out.write("(history cleared)\n")
            continue
        if not line:
            continue
        answer = stream_answer(backend, [*history, {"role": "user", "content": line}], out)
        if answer is not None:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]


def main(argv: list[str] | None = None, prog: str = "pagedserve chat") -> None:
    """Parses argv (default sys.argv[1:]), connects or loads the model, and chats
    on stdin/stdout. Exits with a one-line reason when that cannot start."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    from ..errors import PagedServeError

    try:
        backend = open_backend(args)
        where = backend.describe()
    except (ChatError, PagedServeError, ValueError, TypeError, OSError) as e:
        raise SystemExit(f"{prog}: cannot start: {e}") from e
    print(f"chatting with {where}; /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer",
          file=sys.stderr)
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    chat_loop(backend, args.system)
