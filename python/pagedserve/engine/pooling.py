"""Pooling: an embedding request's final hidden states -> one vector, gathered
chunk by chunk while its prompt is prefilled (chunked prefill and preemption
included). The engine asks for the rows (pooling_rows), the runner returns
their hidden states with the step's other extra rows, and Pooler.add takes
them; Pooler.result gives the vector once the prompt is done."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..pooling_params import PoolingParams


class Pooler:
    """The pooled state of one request.

    Args:
        params: PoolingParams (pooling_type "last" or "mean", normalize).
        num_prompt_tokens: the prompt's length in tokens.
    """

    def __init__(self, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.num_pooled = 0  # prompt positions already in the state (mean: summed; last: 0 or all)
        self._state: torch.Tensor | None = None  # float64 sum (mean) or the last row (last), [hidden]

    def rows_to_pool(self, num_computed_tokens: int, num_scheduled_tokens: int) -> range:
        """The prompt positions of this step's chunk [computed, computed +
        scheduled) whose hidden states the pooling needs and has not taken yet
        (a preempted request recomputes positions it already pooled: they are
        skipped)."""
        end = min(num_computed_tokens + num_scheduled_tokens, self.num_prompt_tokens)
        if self.params.pooling_type == "last":
            last = self.num_prompt_tokens - 1
            return range(last, last + 1) if self.num_pooled == 0 and num_computed_tokens <= last < end else range(0)
        return range(max(num_computed_tokens, self.num_pooled), end)

    def add(self, hidden: torch.Tensor, positions: range) -> None:
        """Takes the hidden states [len(positions), hidden_size] (model dtype) of
        the positions rows_to_pool returned, in order."""
        if self.params.pooling_type == "last":
            self._state = hidden[-1].to(torch.float64)
            self.num_pooled = self.num_prompt_tokens
            return
        rows = hidden.to(torch.float64).sum(0)
        self._state = rows if self._state is None else self._state + rows
        self.num_pooled = positions.stop

    @property
    def done(self) -> bool:
        return self.num_pooled == self.num_prompt_tokens

    def result(self) -> torch.Tensor:
        """The embedding [hidden_size] float32. Raises RuntimeError before every
        position was pooled."""
        if not self.done or self._state is None:
            raise RuntimeError(f"pooled {self.num_pooled} of {self.num_prompt_tokens} prompt positions")
        vec = self._state / self.num_prompt_tokens if self.params.pooling_type == "mean" else self._state
        if self.params.normalize:
            vec = F.normalize(vec, dim=-1)
        return vec.to(torch.float32)
