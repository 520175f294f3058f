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

from collections.abc import Callable, Sequence

from ..engine.outputs import Logprob
from .protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def completion_logprobs(entries: Sequence[Logprob | None], token_ids: Sequence[int], token_text: TokenText,
                        token_bytes: TokenBytes, text_offset: int = 0) -> CompletionLogprobs:
    """Completions `logprobs` for tokens token_ids; entries[i] is token i's
    Logprob, None where nothing predicts it (the first prompt token with echo).

    text_offset: character offset of the first token in the choice's text.
    top_logprobs holds the top alternatives plus the token itself (so up to
    logprobs + 1 entries, as OpenAI and vLLM)."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries):
        text = token_text(tok)
        out.tokens.append(text)
        out.bytes.append(list(token_bytes(tok)))
        out.text_offset.append(text_offset)
        text_offset += len(text)
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
