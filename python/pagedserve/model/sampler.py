"""Sampler: next token per sampling sequence from its logits row."""

from __future__ import annotations

import torch

from ..sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) tokens outside the top-k and outside the smallest set whose
    probability mass reaches top_p (nucleus sampling, Holtzman et al. 2019).

    logits: [V] float32, already divided by the temperature. Returns a new tensor.
    """
    logits = logits.clone()
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top one always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    """Greedy rows by one batched argmax; other rows by temperature, top-k,
    top-p, then a multinomial draw from the request's own torch.Generator (so a
    seeded request samples the same tokens whatever else is in the batch)."""

    def __call__(self, logits: torch.Tensor,
                 rows: list[tuple[SamplingParams, list[torch.Generator | None]]]) -> list[int]:
        """logits: [S, V] float32; rows: per logits row its SamplingParams and one
        generator per token to draw from it (several when a request forks into n
        choices). Returns the tokens, row after row, flat."""
        argmax = torch.argmax(logits, dim=-1).tolist()
        tokens = []
        for i, (p, gens) in enumerate(rows):
            if p.greedy:
                tokens += [argmax[i]] * len(gens)
                continue
            probs = torch.softmax(apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p), dim=-1)
            if not torch.isfinite(probs).all():  # overflowing logits: the argmax is the limit
                tokens += [argmax[i]] * len(gens)
                continue
            tokens += [int(torch.multinomial(probs, 1, generator=g)) for g in gens]
        return tokens
