"""ReasoningGate: with a reasoning parser, a structured-output constraint
applies to the answer, not the thinking (as vLLM's structured outputs with
`--reasoning-parser`), and it is never skipped: every token of the answer
is drawn through the grammar's mask.

A choice's output is in one of three states:
- undecided (parsers whose output may or may not open with the start tag:
  qwen3): the text so far is a proper prefix of `<think>` (at first: empty).
  The next token is drawn from the union of the tokens that keep the text on
  the way to `<think>` (StartTagTokens) and those the grammar takes after the
  undecided tokens; a token of the first kind keeps it undecided (or opens
  the reasoning), any other begins the answer, and the undecided tokens and
  it are fed to the grammar, which took them by construction. So a model
  that does not think (SmolLM2) answers under the constraint from its first
  token, and one that does still may open `<think>`.
- reasoning (the output opened `<think>`, or the template did: deepseek_r1):
  tokens are free until the end tag, except the end-of-sequence tokens: a
  model cannot end its output inside the reasoning, where the constraint
  never applied. Only max_tokens (finish_reason "length": the answer is cut,
  and says so) or the request's own stop strings/ids end it there.
- answer: the grammar's mask, from its beginning. A token that completes the
  end tag is the last free one (text after the tag inside that same token is
  not checked). A prompt whose last tag closes the reasoning (a template that
  turned thinking off) starts here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..reasoning import ReasoningParser

if TYPE_CHECKING:
    from .manager import GrammarState


class StartTagTokens:
    """Which tokens keep an undecided output on the way to the parser's start
    tag: for a text t that is a proper prefix of the tag, the tokens b with
    t + b a prefix of the tag or starting with it. One per engine (the masks
    are cached per prefix: a scan of the vocabulary each, on first use).

    Args:
        start: the start tag's text (`<think>`).
        token_bytes: token id -> its raw bytes (engine.TokenBytes).
        vocab_size: the width of the model's logits (ids at or above the
            tokenizer's vocabulary are never allowed here).
        num_tokens: the tokenizer's vocabulary size (ids scanned).
    """

    def __init__(self, start: str, token_bytes: Callable[[int], bytes], vocab_size: int, num_tokens: int) -> None:
        self.start = start.encode("utf-8")
        self.token_bytes, self.vocab_size, self.num_tokens = token_bytes, vocab_size, min(num_tokens, vocab_size)
        self._masks: dict[bytes, torch.Tensor] = {}

    def allowed(self, text: bytes) -> torch.Tensor:
        """[vocab_size] bool for `text`, a proper prefix of the start tag."""
        mask = self._masks.get(text)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            for token_id in range(self.num_tokens):
                piece = self.token_bytes(token_id)
                if piece and opens_or_leads(text + piece, self.start):
                    mask[token_id] = True
            self._masks[text] = mask
        return mask


def opens_or_leads(text: bytes, start: bytes) -> bool:
    """True when `text` is on the way to `start` (a prefix of it) or opens with it."""
    return start.startswith(text) or text.startswith(start)


class ReasoningGate:
    """The GrammarState interface (mask_logits, accept, admits_any,
    terminated) over one choice's grammar, the reasoning left free.

    Args:
        grammar: the choice's constraint.
        parser: the server's reasoning parser.
        token_bytes: token id -> its raw bytes.
        eos_token_ids: the model's end-of-sequence tokens (masked inside the reasoning).
        start_tokens: the engine's StartTagTokens for parser.start.
        ended: the prompt already closed the reasoning (the output is all answer).
    """

    def __init__(self, grammar: GrammarState, parser: ReasoningParser, token_bytes: Callable[[int], bytes],
                 eos_token_ids, start_tokens: StartTagTokens, ended: bool = False) -> None:
        self.grammar, self.parser, self.token_bytes = grammar, parser, token_bytes
        self.eos_token_ids = sorted(eos_token_ids)
        self.start_tokens = start_tokens
        self.ended = ended
        self.reasoning = not ended and parser.starts_in_prompt  # inside the reasoning (else undecided)
        self._text = b""  # the output's bytes while undecided or reasoning
        self._tokens: list[int] = []  # the undecided tokens, fed to the grammar when the answer begins

    @property
    def undecided(self) -> bool:
        return not self.ended and not self.reasoning

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] float32 -> a masked copy: the grammar's mask in the answer, no
        end-of-sequence token in the reasoning, the union of the start tag's
        way and the grammar's mask while undecided."""
        if self.ended:
            return self.grammar.mask_logits(logits)
        out = logits.clone()
        if self.reasoning:
            out[[t for t in self.eos_token_ids if t < out.shape[0]]] = float("-inf")
            return out
        allowed = self.start_tokens.allowed(self._text).clone()
        probe = self.grammar.fork()
        if all(probe.accept(t) for t in self._tokens):
            allowed |= probe.allowed()
        out[~allowed[:out.shape[0]]] = float("-inf")
        return out

    def admits_any(self) -> bool:
        return self.grammar.admits_any() if self.ended else True

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False if the grammar refuses it."""
        if self.ended:
            return self.grammar.accept(token_id)
        self._text += self.token_bytes(token_id)
        if self.undecided:
            self._tokens.append(token_id)
            start = self.parser.start.encode("utf-8")
            if self._text.startswith(start):
                self.reasoning = True  # it opened the reasoning
            elif not start.startswith(self._text):  # the answer began with the undecided tokens
                self.ended = True
                return all(self.grammar.accept(t) for t in self._tokens)
            else:
                return True
        if self.parser.end.encode("utf-8") in self._text:
            self.ended = True
        return True

    @property
    def terminated(self) -> bool:
        return self.ended and self.grammar.terminated
