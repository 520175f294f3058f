"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model writes
`<think>…</think>` before its answer (DeepSeek-R1, Qwen3, SmolLM3 templates);
the text between the tags belongs in `message.reasoning_content` /
`delta.reasoning_content`, the rest in `content`.

- `deepseek_r1`: the template may already have opened `<think>` in the prompt,
  so the output is reasoning until `</think>` (a leading `<think>` is dropped);
  an output that never closes it is all reasoning.
- `qwen3`: reasoning only when the output opens with `<think>`; an output that
  does not (thinking turned off: the template wrote an empty `<think></think>`
  into the prompt) is all content; one that opens and never closes it is all
  reasoning.

The split of a streamed output equals the split of the whole text, whatever
the token boundaries: text that could still become a tag is held back until it
cannot (ReasoningStreamer). Structured outputs constrain only the answer
(structured_output.ReasoningGate).
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine.stop import held_back


@dataclass(frozen=True)
class ReasoningParser:
    """How one model family marks its thinking.

    Attributes:
        name: the --reasoning-parser value.
        start, end: the tags around the reasoning.
        starts_in_prompt: True when an output without `start` is still
            reasoning until `end` (the template opened the tag: deepseek_r1).
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_in_prompt: bool = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where a part is absent
        (vLLM's shape: content None when the output is all reasoning)."""
        body = text
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not self.starts_in_prompt:
            return None, text or None
        head, found, tail = body.partition(self.end)
        if not found:
            return head, None
        return head, tail or None

    def ended_in_prompt(self, prompt: str) -> bool:
        """True when the prompt's last tag closes the reasoning (the template
        wrote `<think></think>` for a turn without thinking): the output is all
        answer."""
        end = prompt.rfind(self.end)
        return end >= 0 and end > prompt.rfind(self.start)

    def reasoning_end(self, text: str) -> int | None:
        """Length of the prefix of `text` that is reasoning (tags included),
        None while it is still open (all of it so far is reasoning), 0 when the
        output is not reasoning at all (qwen3 without a leading tag)."""
        if not self.starts_in_prompt and not self.start.startswith(text[:len(self.start)]):
            return 0
        end = text.find(self.end)
        return None if end < 0 else end + len(self.end)


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", starts_in_prompt=True), ReasoningParser("qwen3"))}


def get_parser(name: str | None) -> ReasoningParser | None:
    """The parser named `name` (None: none). Raises ValueError for an unknown name."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def reasoning_token_count(parser: ReasoningParser, token_ids: list[int], token_bytes) -> int:
    """How many of an output's tokens are reasoning (the one that completes the
    end tag included; all of them while it is open): what usage reports as
    completion_tokens_details.reasoning_tokens. token_bytes: id -> raw bytes."""
    pieces = [token_bytes(t) for t in token_ids]
    text = b"".join(pieces).decode("utf-8", errors="replace")
    end = parser.reasoning_end(text)
    if end is None:
        return len(token_ids)
    need, seen = len(text[:end].encode("utf-8")), 0
    for i, piece in enumerate(pieces):
        if seen >= need:
            return i
        seen += len(piece)
    return len(token_ids)


class ReasoningStreamer:
    """Splits a streamed output into reasoning and content deltas so that the
    joined deltas equal ReasoningParser.split of the whole text.

    feed(delta) -> (reasoning delta, content delta) of the text now certain;
    finish() -> the same for what was held back, once the output has ended."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = ("", "")

    def _emit(self, reasoning: str, content: str) -> tuple[str, str]:
        r0, c0 = self._sent
        self._sent = (reasoning, content)
        return reasoning[len(r0):], content[len(c0):]

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        p, text = self.parser, self.text
        if len(text) < len(p.start) and p.start.startswith(text):
            return "", ""  # may still become the opening tag
        reasoning, content = p.split(text)
        if content is None and reasoning is not None:  # still open: hold a possible start of the end tag
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, (p.end,))]
        return self._emit(reasoning or "", content or "")

    def finish(self) -> tuple[str, str]:
        reasoning, content = self.parser.split(self.text)
        return self._emit(reasoning or "", content or "")
