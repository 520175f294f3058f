"""Outputs the engine hands to callers (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """The log-probability of one token at one position (natural log, float32
    precision), from the model's raw distribution (log_softmax of the logits
    before penalties and temperature: vLLM V1's default "raw" logprobs).

    Attributes:
        token_id: the token at this position (sampled, or the prompt's).
        logprob: its log-probability (<= 0).
        top: the most likely (token_id, logprob) pairs at this position,
            descending; as many as the request asked for (may be empty).
        rank: the token's 1-based rank in the distribution (1 = most likely;
            ties share the better rank); set for prompt logprobs, else None.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


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
        stop_reason: what ended a "stop" choice: the stop string or the
            stop_token_ids entry; None for EOS and otherwise (vLLM's).
        logprobs: one Logprob per output token so far (None unless
            SamplingParams.logprobs is set).
        delta_logprobs: the Logprobs of delta_token_ids (None likewise).
    """

    index: int
    text: str
    token_ids: list[int]
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    delta_logprobs: list[Logprob] | None = None
    stop_reason: int | str | None = None


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
        prompt_logprobs: per prompt token its Logprob given the tokens before it,
            None for the first token (nothing predicts it); None unless
            SamplingParams.prompt_logprobs is set. Complete from the first output on.
        arrival_time, first_token_time, finished_time: time.monotonic() seconds.
        timeline: on the finished output of a request that recorded one, its
            RequestTimeline.to_dict() (engine/timeline.py), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    timeline: dict | None = None


@dataclass
class PoolingRequestOutput:
    """An embedding request's result (vLLM's PoolingRequestOutput): the engine
    hands one, when the prompt's prefill is done, or when it is aborted.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt as token ids.
        embedding: the pooled vector [hidden_size] float32 (unit length when
            PoolingParams.normalize), None when aborted.
        finished: always True (a pooling request has one output).
        finish_reason: "stop" when pooled, "abort" when aborted.
        num_cached_tokens: prompt tokens served from the prefix cache (not computed).
        arrival_time, finished_time: time.monotonic() seconds.
    """

    request_id: str
    prompt_token_ids: list[int]
    embedding: torch.Tensor | None
    finished: bool = True
    finish_reason: str = "stop"
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    finished_time: float | None = None
