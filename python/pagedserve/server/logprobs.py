"""Engine Logprobs -> the two OpenAI response shapes: the legacy completions
object (parallel lists tokens / token_logprobs / top_logprobs / text_offset)
and chat's list of {token, logprob, bytes, top_logprobs}; and vLLM's
prompt_logprobs (per prompt token {token id: {logprob, rank, decoded_token}}).

Token strings are each token decoded on its own (a byte-level BPE piece that
is part of a multi-byte character decodes to U+FFFD). `bytes` holds the raw
bytes the token stands for (engine.token_bytes), so joining them gives the
UTF-8 of the text: in chat per entry (OpenAI's field), in completions as a list
parallel to `tokens` (an extension; OpenAI's legacy object has none)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from ..engine.outputs import Logprob
from .protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


class TextOffsets:
    """Where each token starts in a choice's text, in characters: the tokens'
    raw bytes go through an incremental UTF-8 decoder, so a token that ends
    inside a character moves the offset only once the character is complete
    (its own string is U+FFFD, and with return_tokens_as_token_ids not text at
    all, so its length cannot be the step)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def advance(self, piece: bytes) -> int:
        """The offset where this token starts; then moves past its bytes."""
        start = self.chars
        self.chars += len(self._decoder.decode(piece))
        return start


def completion_logprobs(entries: Sequence[Logprob | None], token_ids: Sequence[int], token_text: TokenText,
                        token_bytes: TokenBytes, offsets: TextOffsets | None = None) -> CompletionLogprobs:
    """Completions `logprobs` for tokens token_ids; entries[i] is token i's
    Logprob, None where nothing predicts it (the first prompt token with echo).

    offsets: the choice's TextOffsets so far (a stream passes the same one on;
    None: these tokens start the text). top_logprobs holds the top
    alternatives plus the token itself (so up to logprobs + 1 entries, as
    OpenAI and vLLM)."""
    out = CompletionLogprobs()
    offsets = offsets if offsets is not None else TextOffsets()
    for tok, entry in zip(token_ids, entries):
        text = token_text(tok)
        piece = token_bytes(tok)
        out.tokens.append(text)
        out.bytes.append(list(piece))
        out.text_offset.append(offsets.advance(piece))
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(entries: Sequence[Logprob], token_text: TokenText, token_bytes: TokenBytes) -> ChatLogprobs:
    """Chat `logprobs` ({"content": [...]}) of the output tokens in `entries`."""
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=token_text(token_id), logprob=logprob, bytes=list(token_bytes(token_id)))

    content = []
    for e in entries:
        head = top(e.token_id, e.logprob)
        content.append(ChatTokenLogprob(token=head.token, logprob=head.logprob, bytes=head.bytes,
                                        top_logprobs=[top(t, lp) for t, lp in e.top]))
    return ChatLogprobs(content=content)


def with_top(entries: Sequence[Logprob | None], num_top: int) -> list[Logprob | None]:
    """entries with at most num_top alternatives each (the engine computed one
    count for everything a request asked: echo's logprobs and prompt_logprobs)."""
    return [e if e is None or len(e.top) <= num_top else Logprob(e.token_id, e.logprob, e.top[:num_top], e.rank)
            for e in entries]


def prompt_logprobs(entries: Sequence[Logprob | None], num_top: int, token_text: TokenText) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing predicts
    it) or {token id: PromptLogprob} holding the prompt's token (with its rank)
    and the num_top most likely tokens at that position (ranks 1..num_top)."""
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {t: PromptLogprob(logprob=lp, rank=r, decoded_token=token_text(t))
             for r, (t, lp) in enumerate(e.top[:num_top], start=1)}
        d[e.token_id] = PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=token_text(e.token_id))
        out.append(d)
    return out
