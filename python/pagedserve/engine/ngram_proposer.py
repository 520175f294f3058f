"""Prompt-lookup (n-gram) proposals for speculative decoding
(``--speculative ngram``): the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, for the largest n in
[prompt_lookup_min, prompt_lookup_max] that occurs (Saxena, "Prompt Lookup
Decoding", 2023; vLLM's ``ngram`` method and llama.cpp's lookup decoding use
the same rule). It needs no second model and pays off where the output
repeats its context: editing, summarising, code, chat that quotes its input.

The engine verifies the proposals in the next step's forward pass
(LLMEngine: greedy acceptance), so a proposal can only cost time, never
change a token."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens for a sequence.

    Args:
        num_speculative_tokens: k, drafts per proposal (>= 1).
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest
            first (1 <= min <= max).
    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, "
                             f"{prompt_lookup_max}")
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        """token_ids: the sequence so far (prompt then output tokens). Returns
        the k (or fewer, at the sequence's end) tokens that followed the most
        recent earlier occurrence of its last n tokens, n from max down to
        min; [] when none occurs. O(len(token_ids) * n) per call."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = tokens.shape[0]
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # windows starting at 0 .. size - n - 1: every earlier n-gram (not the suffix itself)
            windows = sliding_window_view(tokens[:size - 1], n)
            hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the tokens after the most recent occurrence
                return tokens[start:start + self.k].tolist()
        return []
