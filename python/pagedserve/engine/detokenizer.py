"""Incremental detokenization that never splits a multi-byte UTF-8 character
and keeps the leading spaces tokens carry (the prefix/read offset method of
Hugging Face TGI and vLLM).

Each step decodes a short window of ids twice: the ids already emitted
(prefix_offset:read_offset) and the same window plus the new ones. The text
between the two is the delta; if it ends in U+FFFD (an incomplete byte
sequence) nothing is emitted until later tokens complete it.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: the prompt, whose last few ids give the first output
            token its context (so " Paris" keeps its space).
        skip_special_tokens: drop special tokens (EOS, chat markers) from text.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Adds one token; returns the new text it completes ('' if none yet)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # only the window from prefix_offset is decoded again: the ids before it are dropped (the output's
            # token ids are the scheduler's record, not this window's)
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
            return text[len(prefix):]
        return ""

    def holds_text(self) -> bool:
        """Whether tokens whose text is not handed out yet are held back."""
        return self.read_offset < len(self.ids)

    def pending(self) -> str:
        """The text flush() would return now, without consuming it."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        return text[len(prefix):] if text.startswith(prefix) else ""

    def flush(self) -> str:
        """At the end of the output: whatever text is still held back (may hold U+FFFD)."""
        text = self.pending()
        self.prefix_offset = self.read_offset = len(self.ids)
        return text
