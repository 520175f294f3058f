"""Request: the Python side of one request (text, detokenizer, stop strings,
sampling generator, timings). Token bookkeeping lives in the C++ scheduler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .stop import StopStringMatcher


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    stop: StopStringMatcher = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    released: int = 0  # characters of stop.text already handed out
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.stop = StopStringMatcher(self.params.stop)

    def append_token(self, token_id: int) -> bool:
        """Adds a sampled token and its text; returns True if a stop string ended the output."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if self.detokenizer is None:
            return False
        return self.stop.append(self.detokenizer.step(token_id))

    def finish(self, reason: str, stop_string: bool = False) -> None:
        """Marks the request finished ("stop", "length" or "abort"). Unless a stop
        string ended it, the detokenizer's held-back text is flushed first; if that
        text completes a stop string, the text is cut there and the reason is "stop"."""
        if self.finish_reason is not None:
            return
        if self.detokenizer is not None and not stop_string:
            if self.stop.append(self.detokenizer.flush()) and reason == "length":
                reason = "stop"
        self.finish_reason = reason
        self.finished_time = time.monotonic()

    def make_output(self, num_new_tokens: int) -> RequestOutput:
        """Builds the RequestOutput for this step, releasing the text that can no
        longer turn into a stop string (all of it once finished)."""
        finished = self.finish_reason is not None
        end = len(self.stop.text) if finished else self.stop.releasable()
        end = max(end, self.released)
        delta = self.stop.text[self.released:end]
        self.released = end
        new_ids = self.output_token_ids[len(self.output_token_ids) - num_new_tokens:] if num_new_tokens else []
        choice = CompletionOutput(index=0, text=self.stop.text[:end], token_ids=list(self.output_token_ids),
                                  delta_text=delta, delta_token_ids=new_ids,
                                  finish_reason=self.finish_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [choice], finished,
                             self.num_cached_tokens, self.arrival_time, self.first_token_time,
                             self.finished_time)
