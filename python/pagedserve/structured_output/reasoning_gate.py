"""ReasoningGate: with a reasoning parser, a structured-output constraint
applies to the answer, not the thinking (as vLLM's structured outputs with
`--reasoning-parser`): tokens are free until the output's reasoning has ended,
then the grammar starts, at its beginning.

The gate watches the output's bytes (TokenBytes) for the parser's end tag; a
token that completes the tag is the last free one (text after the tag inside
that same token is not checked). A prompt whose last tag closes the reasoning
(a template that turned thinking off) starts the grammar at once. With the
qwen3 parser an output that does not open with `<think>` is all answer: the
tokens it took before that was certain (at most the tag's length in
characters, usually one token) are then fed to the grammar, and a grammar
that refuses them ends the choice (logged by the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..reasoning import ReasoningParser

if TYPE_CHECKING:
    from .manager import GrammarState


class ReasoningGate:
    """The GrammarState interface (mask_logits, accept, admits_any,
    terminated) over one choice's grammar, shut until the reasoning ends."""

    def __init__(self, grammar: GrammarState, parser: ReasoningParser, token_bytes: Callable[[int], bytes],
                 ended: bool = False) -> None:
        """grammar: the choice's constraint; token_bytes: token id -> its raw
        bytes; ended: the prompt already closed the reasoning."""
        self.grammar, self.parser, self.token_bytes = grammar, parser, token_bytes
        self.ended = ended
        self._text = b""
        self._tokens: list[int] = []

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] float32 -> a copy, masked by the grammar once the reasoning has ended."""
        return self.grammar.mask_logits(logits) if self.ended else logits.clone()

    def admits_any(self) -> bool:
        return self.grammar.admits_any() if self.ended else True

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False if the grammar refuses it."""
        if self.ended:
            return self.grammar.accept(token_id)
        self._text += self.token_bytes(token_id)
        self._tokens.append(token_id)
        end = self.parser.reasoning_end(self._text.decode("utf-8", errors="replace"))
        if end is None:
            return True
        self.ended = True
        if end == 0:  # not reasoning after all: the answer began with these tokens
            return all(self.grammar.accept(t) for t in self._tokens)
        return True

    @property
    def terminated(self) -> bool:
        return self.ended and self.grammar.terminated
