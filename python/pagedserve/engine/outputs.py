"""Outputs the engine hands to callers (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence so far.

    Attributes:
        index: choice index (0 while n == 1).
        text: all text released so far (stop strings excluded).
        token_ids: all output token ids so far.
        delta_text: text released by this step.
        delta_token_ids: token ids added by this step.
        finish_reason: None while running, else "stop", "length" or "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """A request's state after an engine step.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text (None for token-id prompts).
        prompt_token_ids: the prompt as token ids.
        outputs: one CompletionOutput per choice.
        finished: True on the last output of the request.
        num_cached_tokens: prompt tokens served from the prefix cache (not computed).
        arrival_time, first_token_time, finished_time: time.monotonic() seconds.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
