"""Seeded synthetic workloads for the scheduling simulator: Poisson arrivals,
prompt and output lengths from the fragmentation experiment's distributions
(uniform, bimodal, heavy-tailed), optional priority classes and shared prompt
prefixes (a system prompt many requests start with)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .fragmentation import WORKLOADS, sample_lengths

EOS_TOKEN_ID = 2  # the synthetic model's end-of-sequence token; prompts never contain it
_FIRST_TOKEN_ID = 3


@dataclass(frozen=True)
class SimRequest:
    """One synthetic request.

    arrival_s: arrival time (seconds from the start); prompt_token_ids: the
    prompt (int token ids, never EOS); output_len: tokens the synthetic model
    produces, the last of them EOS (>= 1); max_tokens: the client's cap (>=
    output_len), what the scheduler knows; priority: lower is served first
    (only sent to a priority-policy scheduler)."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int
    max_tokens: int
    priority: int = 0


def generate(num_requests: int, rate: float, *, lengths: str = "bimodal", max_model_len: int = 2048,
             max_tokens: int | None = None, priority_classes: list[int] | None = None,
             shared_prefix_len: int = 0, num_prefixes: int = 1, vocab_size: int = 32000,
             seed: int = 0) -> list[SimRequest]:
    """num_requests requests in arrival order.

    rate: mean arrivals per second (Poisson: exponential gaps); float('inf')
    puts every arrival at 0. lengths: one of WORKLOADS. max_tokens: the cap
    each request sends; None = what the context leaves after its prompt (the
    chat endpoint's default). priority_classes: each request draws one value
    uniformly, from a generator of its own (the same seed gives the same
    lengths and arrivals with or without classes). shared_prefix_len > 0: every prompt starts with one of
    num_prefixes fixed prefixes of that many tokens (prompt lengths grow by it,
    within max_model_len).

    Raises ValueError on an unknown lengths name, a rate below 1e-9/s or NaN, a
    count below 1, a negative prefix length, max_tokens < 1, or a context too
    short for the lengths (64 tokens; bimodal's long mode needs 1280).
    """
    if num_requests < 1 or not rate >= 1e-9:  # not rate: NaN too; tinier rates overflow the clock
        raise ValueError(f"need num_requests >= 1 and a rate >= 1e-9 requests/s, got {num_requests}, {rate}")
    if shared_prefix_len < 0 or num_prefixes < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"need shared_prefix_len >= 0, num_prefixes >= 1 and max_tokens >= 1, got "
                         f"{shared_prefix_len}, {num_prefixes}, {max_tokens}")
    if max_model_len - shared_prefix_len < 64:
        raise ValueError(f"max_model_len - shared_prefix_len must leave at least 64 tokens for the lengths, "
                         f"got {max_model_len - shared_prefix_len}")
    if lengths not in WORKLOADS:
        raise ValueError(f"unknown lengths '{lengths}', choose from {WORKLOADS}")
    if lengths == "bimodal" and max_model_len - shared_prefix_len < 1280:  # its long mode is 1024..len-256
        raise ValueError("bimodal lengths need max_model_len - shared_prefix_len >= 1280, got "
                         f"{max_model_len - shared_prefix_len}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(shared_prefix_len)]
                for _ in range(max(1, num_prefixes))] if shared_prefix_len > 0 else [[]]
    classes_rng = random.Random(f"priority-{seed}")  # apart: classes do not change lengths or arrivals
    out, t = [], 0.0
    for i, (p, o) in enumerate(sample_lengths(lengths, num_requests, max_model_len - shared_prefix_len, seed)):
        if rate != float("inf"):
            t += rng.expovariate(rate)
        prompt = rng.choice(prefixes) + [rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(p)]
        room = max_model_len - len(prompt)
        cap = room if max_tokens is None else max(1, min(max_tokens, room))
        prio = classes_rng.choice(priority_classes) if priority_classes else 0
        out.append(SimRequest(f"sim-{i}", t, prompt, max(1, min(o, cap)), cap, prio))
    return out
