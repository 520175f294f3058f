"""Scoring requests: `max_tokens: 0` on /v1/completions, with `echo` (the
prompt and, with `logprobs`, its logprobs: what lm-evaluation-harness sends for
loglikelihood tasks) or `prompt_logprobs` (vLLM's). Nothing is generated.

The engine always samples a token once a prompt is computed (its last row's
logits come out of the same forward as the prompt's), so a scoring request runs
with max_tokens 1 and the answer drops that token: its text, ids, logprobs and
its count in `usage`. The cost over pure scoring is one sampled row. Prompt
logprobs turn off prefix-cache reads for the request (every position's logits
are computed: see LLMEngine.add_request); its blocks are still cached for
others.
"""

from __future__ import annotations

from dataclasses import replace

from ..engine.outputs import CompletionOutput, RequestOutput
from .errors import APIError


def engine_max_tokens(max_tokens: int, echo: bool, prompt_logprobs: int | None) -> int:
    """The max_tokens to run a completions request with. Raises APIError 400
    when max_tokens is 0 and nothing would be returned (no echo, no
    prompt_logprobs)."""
    if max_tokens != 0:
        return max_tokens
    if not echo and prompt_logprobs is None:
        raise APIError(400, "`max_tokens: 0` generates nothing: use it with `echo: true` or `prompt_logprobs` "
                            "to score the prompt", param="max_tokens")
    return 1


def _no_output(c: CompletionOutput) -> CompletionOutput:
    return replace(c, text="", token_ids=[], delta_text="", delta_token_ids=[],
                   finish_reason="length" if c.finish_reason else None,
                   logprobs=[] if c.logprobs is not None else None,
                   delta_logprobs=[] if c.delta_logprobs is not None else None, stop_reason=None)


def without_output(out: RequestOutput) -> RequestOutput:
    """out as a `max_tokens: 0` request sees it: every choice with no text, no
    tokens and no logprobs, finished "length" once the request finished."""
    return replace(out, outputs=[_no_output(c) for c in out.outputs])
