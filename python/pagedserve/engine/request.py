"""Request: the Python side of one request (text, detokenizer, stop strings,
sampling generators, timings), one Choice per sampled sequence (n). The
token ids live in one record, the C++ scheduler's Sequence: a Choice reads
its output tokens from it and keeps no copy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from .stop import StopStringMatcher

if TYPE_CHECKING:
    from .. import _core
    from ..structured_output import GrammarState
    from .pooling import Pooler
    from .timeline import RequestTimeline


@dataclass
class Choice:
    """One sampled sequence of a request (choice `index` of n): its text,
    stop strings, generator, grammar and logprobs. Its token ids are the C++
    scheduler's Sequence (`sequence`, the record Scheduler.update hands back
    with the choice's first token); it keeps no copy of its own: output_token_ids
    reads them from the record."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    stop: StopStringMatcher
    sequence: _core.Sequence | None = None  # the choice's token record, from its first Scheduler.update on
    num_text_tokens: int = 0  # tokens given to append_token (its text)
    released: int = 0  # characters of stop.text already handed out
    emitted_tokens: int = 0  # output tokens already handed out
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None  # one per output token when requested
    grammar: GrammarState | None = None  # where the output stands in its constraint (structured outputs)
    stop_token_ids: frozenset[int] = frozenset()  # the request's stop_token_ids (stop_reason)
    min_tokens: int = 0  # stop strings end the output only once it has this many tokens (vLLM's)

    @property
    def output_token_ids(self) -> list[int]:
        """The output token ids committed so far (Scheduler.update), read from
        the C++ record; [] before the first."""
        return self.sequence.output_token_ids if self.sequence is not None else []

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids), without copying them (Sequence.num_output_tokens:
        unverified drafts count only while the scheduler runs the sequence,
        between add_draft_tokens and update; a finished record has none)."""
        return self.sequence.num_output_tokens if self.sequence is not None else 0

    def append_token(self, token_id: int, logprob: Logprob | None = None) -> bool:
        """Adds a sampled token's Logprob (add_logprob) and text (add_text),
        before Scheduler.update commits the token to the record; returns True
        if a stop string ended the output."""
        self.add_logprob(logprob)
        return self.add_text(token_id)

    def add_logprob(self, logprob: Logprob | None) -> None:
        """Keeps the next output token's Logprob if the request wants logprobs."""
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)

    def add_text(self, token_id: int) -> bool:
        """Adds the next output token's text; True if a stop string ended the
        output there (checked once the output has min_tokens tokens)."""
        self.num_text_tokens += 1
        if self.detokenizer is None:
            return False
        return self.stop.append(self.detokenizer.step(token_id), check=self.num_text_tokens >= self.min_tokens)

    def stop_if_finished(self) -> bool:
        """Whether a stop string completes in the text the detokenizer still
        holds back (flushed only when the choice ends): the scheduler's update()
        then ends the choice with "stop", not "length", if it ends at this token
        (CallerFinish.STOP_IF_FINISHED)."""
        d = self.detokenizer
        return d is not None and bool(self.stop.stop) and d.holds_text() and self.stop.would_stop(d.pending())

    def finish(self, reason: str) -> None:
        """Marks the choice finished with the reason the scheduler's update()
        decided ("stop" or "length"), or "abort". Unless a stop string already
        cut the text, the detokenizer's held-back text is flushed first (and cut
        at a stop string it completes: stop_if_finished)."""
        if self.finish_reason is not None:
            return
        if self.detokenizer is not None and self.stop.matched is None:
            self.stop.append(self.detokenizer.flush())
        self.finish_reason = reason

    @property
    def stop_reason(self) -> int | str | None:
        """What ended a "stop" choice, as vLLM reports it: the stop string, or
        the stop_token_ids entry it sampled last; None for EOS, a grammar's end,
        another finish reason or a running choice."""
        if self.finish_reason != "stop":
            return None
        if self.stop.matched is not None:
            return self.stop.matched
        ids = self.output_token_ids
        if ids and ids[-1] in self.stop_token_ids:
            return ids[-1]
        return None

    def make_output(self) -> CompletionOutput:
        """The choice so far, with what is new since the last call: the text that can
        no longer turn into a stop string (all of it once finished) and new tokens."""
        end = len(self.stop.text) if self.finish_reason is not None else self.stop.releasable()
        end = max(end, self.released)
        delta = self.stop.text[self.released:end]
        self.released = end
        ids = self.output_token_ids
        new_ids = ids[self.emitted_tokens:]
        new_logprobs = self.logprobs[self.emitted_tokens:] if self.logprobs is not None else None
        self.emitted_tokens = len(ids)
        return CompletionOutput(index=self.index, text=self.stop.text[:end], token_ids=ids,
                                delta_text=delta, delta_token_ids=new_ids, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None,
                                delta_logprobs=new_logprobs)


@dataclass
class Request:
    """One request's Python-side state; times are time.monotonic() seconds.

    prompt_logprobs: [None] + one Logprob per prompt token after the first,
    filled chunk by chunk while the prompt is prefilled (None when not asked).
    num_draft_tokens, num_accepted_tokens: speculative decoding's draft tokens
    verified for the request's choices and how many of them were kept.
    pooler: an embedding request's pooled state (its one choice's sampled
    token is dropped); None for a generation request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[Choice]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    priority: int = 0  # lower is served first (--scheduling-policy priority)
    prompt_logprobs: list[Logprob | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for its choices
    num_accepted_tokens: int = 0  # of them, the ones kept
    pooler: Pooler | None = None
    timeline: RequestTimeline | None = None  # recorded when asked (engine/timeline.py)

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               tokenizer, grammars: list[GrammarState] | None = None) -> Request:
        """Builds the request and its n choices (detokenizers, stop matchers,
        generators; grammars: one GrammarState per choice for a constrained
        request, else None)."""
        choices = []
        for i in range(params.n):
            detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                     if tokenizer is not None else None)
            seed = params.choice_seed(i)
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            choices.append(Choice(i, detok, gen, StopStringMatcher(params.stop, params.include_stop_str_in_output),
                                  logprobs=[] if params.logprobs is not None else None,
                                  grammar=grammars[i] if grammars else None,
                                  stop_token_ids=frozenset(params.stop_token_ids), min_tokens=params.min_tokens))
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        return cls(request_id, prompt, prompt_token_ids, params, choices, prompt_logprobs=prompt_logprobs)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def on_tokens(self, now: float) -> float | None:
        """Notes that this request got tokens in the step that ended at `now`;
        returns the time since its previous tokens (inter-token latency, seconds),
        None for its first token."""
        previous, self.last_token_time = self.last_token_time, now
        if self.first_token_time is None:
            self.first_token_time = now
            return None
        return now - previous

    def make_output(self) -> RequestOutput | PoolingRequestOutput:
        """This step's RequestOutput: every choice, with its deltas (an
        embedding request's PoolingRequestOutput once it finished)."""
        finished = self.finished
        if finished and self.finished_time is None:
            self.finished_time = time.monotonic()
        if self.pooler is not None:
            reason = self.choices[0].finish_reason
            return PoolingRequestOutput(self.request_id, self.prompt_token_ids,
                                        self.pooler.result() if reason == "stop" else None, finished,
                                        reason or "abort", self.num_cached_tokens, self.arrival_time,
                                        self.finished_time)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.make_output() for c in self.choices], finished, self.num_cached_tokens,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             self.arrival_time, self.first_token_time, self.finished_time,
                             self.timeline.to_dict() if finished and self.timeline is not None else None)
