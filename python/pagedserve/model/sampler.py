"""Sampler: next token per sampling sequence from its logits row, with vLLM's
penalties, min-p / top-k / top-p, and raw logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..structured_output import GrammarState

TopLogprobs = list[tuple[int, float]]


@dataclass
class SamplingRow:
    """One logits row to sample from.

    Attributes:
        params: the request's SamplingParams.
        generators: one per token to draw from this row (several when a request
            forks into n choices); None draws from torch's global generator.
        prompt_token_ids: the request's prompt (repetition penalty only).
        output_token_ids: per draw, that choice's output tokens so far (same
            length as generators; read only when params.has_penalties or
            params.has_token_filters, and may be empty otherwise).
        grammars: per draw, that choice's GrammarState (structured outputs:
            tokens its grammar cannot take next are masked before penalties
            and sampling), or None for an unconstrained row.
    """

    params: SamplingParams
    generators: list[torch.Generator | None]
    prompt_token_ids: Sequence[int]
    output_token_ids: list[Sequence[int]]
    grammars: list[GrammarState] | None = None


@dataclass
class SamplerOutput:
    """The sampled tokens, flat: row after row, draw after draw.

    Attributes:
        token_ids: the sampled token ids.
        logprobs: per sampled token its natural-log probability under the raw
            model logits; None where params.logprobs is None.
        top_logprobs: per sampled token the params.logprobs most likely
            (token_id, logprob), descending; None where params.logprobs is None,
            [] where it is 0.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor | None,
                    output_token_ids: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (vLLM's order).

    logits: [V] raw model logits; prompt_mask: [V] bool, True at the prompt's
    tokens (needed when repetition_penalty != 1, else may be None);
    output_token_ids: this choice's output so far, ids < V. Returns a new [V]
    float32 tensor:
      repetition (CTRL, Keskar et al. 2019, as HF / vLLM): for each token in the
        prompt or the output, logit / p if logit > 0 else logit * p;
      frequency / presence (OpenAI): logit -= frequency_penalty * count
        + presence_penalty * (count > 0), count over the OUTPUT only.
    Token ids >= V make torch raise (IndexError or RuntimeError).
    """
    x = logits.to(torch.float32, copy=True)
    out = torch.as_tensor(output_token_ids, dtype=torch.long, device=x.device)
    if params.repetition_penalty != 1.0:
        seen = prompt_mask.clone()
        seen[out] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        counts = torch.bincount(out, minlength=x.numel()).to(x.dtype)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)
    return x


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Masks (to -inf) tokens whose probability is below min_p times the top
    token's (min-p sampling, Nguyen et al. 2024, as vLLM).

    logits: [V] float32, already divided by the temperature. Returns a new tensor.
    """
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


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


def sampling_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: x [V] logits
    (penalised if need be) -> [V] float32 probabilities after temperature,
    min-p, top-k and top-p (not finite where the tempered logits overflow)."""
    x = x / params.temperature
    if params.min_p > 0:
        x = apply_min_p(x, params.min_p)
    return torch.softmax(apply_top_k_top_p(x, params.top_k, params.top_p), dim=-1)


def draw(x: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None],
         argmax: int) -> list[int]:
    """One token per generator from x ([V] logits, penalised or masked by a
    grammar if need be): sampling_probs, then multinomial. argmax: x's argmax,
    the limit when the tempered logits overflow."""
    probs = sampling_probs(x, params)
    if not torch.isfinite(probs).all():  # overflowing logits: the argmax is the limit
        return [argmax] * len(generators)
    return [int(torch.multinomial(probs, 1, generator=g)) for g in generators]


def apply_token_filters(logits: torch.Tensor, params: SamplingParams, output_token_ids: Sequence[int],
                        eos_token_ids: Sequence[int]) -> torch.Tensor:
    """logits [V] float32 with the request's token filters, a new tensor, in
    vLLM's order: allowed_token_ids (every other token -inf), logit_bias
    (added), while fewer than min_tokens output tokens exist its stop tokens
    (stop_token_ids, and EOS unless ignore_eos) -inf, then bad words: the last
    token of each params.bad_words_token_ids sequence -inf where the output so
    far ends with the sequence's other tokens (a one-token word always)."""
    x = logits.clone()
    if params.allowed_token_ids is not None:
        keep = torch.as_tensor(params.allowed_token_ids, dtype=torch.long)
        x = torch.full_like(x, float("-inf")).index_copy_(0, keep, x[keep])
    if params.logit_bias is not None:
        ids = torch.as_tensor(list(params.logit_bias), dtype=torch.long)
        x.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=x.dtype))
    if len(output_token_ids) < params.min_tokens:
        stops = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        stops = [t for t in stops if t < x.shape[0]]
        if stops:
            x[torch.as_tensor(stops, dtype=torch.long)] = float("-inf")
    for word in params.bad_words_token_ids or ():
        head = word[:-1]
        if len(output_token_ids) >= len(head) and list(output_token_ids[len(output_token_ids) - len(head):]) == head:
            x[word[-1]] = float("-inf")
    return x


class Sampler:
    """Rows without penalties or grammar: greedy ones by one batched argmax, the
    others by temperature, min-p, top-k, top-p, then a multinomial draw from
    each choice's own torch.Generator (so a seeded request samples the same
    tokens whatever else is in the batch). Rows with penalties, token filters or
    a grammar: the same per draw, on that choice's logits masked by its grammar,
    filtered (apply_token_filters), then penalised with its own output (vLLM's
    order); where the filters leave no token at all the draw is the first EOS
    id, which ends the choice ("stop"). Unconstrained rows never wait for a
    grammar."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        """eos_token_ids: the model's end-of-sequence ids (min_tokens masks them)."""
        self.eos_token_ids = list(eos_token_ids)

    @staticmethod
    def takes_only_argmax(rows: list[SamplingRow]) -> bool:
        """Whether __call__ reads nothing of these rows' logits but each row's
        first maximum: every row greedy, without penalties, token filters, a
        grammar or logprobs. Then logits that hold -inf wherever a value could
        not be its row's maximum sample the same tokens (the runner's pruned
        output layer: GGUFFloatLinear.greedy_logits)."""
        return all(r.params.greedy and r.params.logprobs is None and Sampler._unfiltered(r) for r in rows)

    @staticmethod
    def _unfiltered(row: SamplingRow) -> bool:
        """Whether the row draws from its raw logits: no penalties, token filters or grammar."""
        return not row.params.has_penalties and not row.params.has_token_filters and row.grammars is None

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [S, V] float32 raw model logits, row i for rows[i].

        Returns one token per generator, flat (row after row, draw after draw),
        with raw logprobs (log_softmax of these logits, before penalties and
        temperature: vLLM V1's default) for rows whose params.logprobs is set.
        Raises ValueError if len(rows) != S or a row's generators and
        output_token_ids differ in length.
        """
        if len(rows) != logits.shape[0]:
            raise ValueError(f"rows must match the logits rows: {len(rows)} rows, logits {tuple(logits.shape)}")
        # the first maximum's index per row, NaN counting as the maximum: torch.argmax's result, computed by
        # numpy on this thread (faster than torch.argmax's parallel one at a step's size: docs/benchmarks.md, "Behind the code"); it also
        # keeps torch's OpenMP threads asleep, where their spinning after a parallel op would take a core
        # from the next step's kernels
        argmax = logits.float().numpy().argmax(axis=1).tolist()
        tokens: list[int] = []
        row_tokens: list[list[int]] = []
        for i, row in enumerate(rows):
            p, gens = row.params, row.generators
            if len(row.output_token_ids) != len(gens):
                raise ValueError(f"row {i}: {len(gens)} generators but {len(row.output_token_ids)} output_token_ids")
            if self._unfiltered(row):
                drawn = [argmax[i]] * len(gens) if p.greedy else draw(logits[i], p, gens, argmax[i])
            else:
                prompt_mask = None
                if p.repetition_penalty != 1.0:
                    prompt_mask = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                    prompt_mask[torch.as_tensor(row.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
                drawn = []
                grammars = row.grammars or [None] * len(gens)
                for g, out, grammar in zip(gens, row.output_token_ids, grammars):
                    x = grammar.mask_logits(logits[i]) if grammar is not None else logits[i]
                    if p.has_token_filters:
                        x = apply_token_filters(x, p, out, self.eos_token_ids)
                    if p.has_penalties:
                        x = apply_penalties(x, prompt_mask, out, p)
                    if p.has_token_filters and self.eos_token_ids and bool(torch.isneginf(x).all()):
                        # the filters leave no token (e.g. allowed_token_ids all bad words): the choice ends
                        # as at EOS rather than on a token the filters forbid
                        drawn.append(self.eos_token_ids[0])
                        continue
                    best = int(torch.argmax(x))
                    drawn += [best] if p.greedy else draw(x, p, [g], best)
            tokens += drawn
            row_tokens.append(drawn)
        logprobs, top = raw_logprobs(logits, row_tokens, [r.params.logprobs for r in rows])
        return SamplerOutput(tokens, logprobs, top)


def raw_logprobs(logits: torch.Tensor, row_tokens: list[list[int]], num_top: list[int | None]
                 ) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """Raw logprobs (log_softmax of logits [R, V] float32, before penalties and
    temperature: vLLM V1's default) of the tokens row_tokens[i] at row i, and the
    num_top[i] most likely (token_id, logprob) alternatives there, descending;
    flat like the tokens. Rows whose num_top is None get None (log_softmax runs
    over the rows that ask only). A row's values depend on that row alone."""
    asked = [i for i, n in enumerate(num_top) if n is not None]
    if not asked:
        n = sum(len(toks) for toks in row_tokens)
        return [None] * n, [None] * n
    logprobs: list[float | None] = []
    top: list[TopLogprobs | None] = []
    lp = torch.log_softmax(logits[asked].float(), dim=-1)
    k = min(max(num_top[i] for i in asked), lp.shape[1])
    top_vals, top_ids = (t.tolist() for t in torch.topk(lp, k, dim=-1)) if k else ([], [])
    where = {i: j for j, i in enumerate(asked)}
    for i, (n, toks) in enumerate(zip(num_top, row_tokens)):
        if i not in where:
            logprobs += [None] * len(toks)
            top += [None] * len(toks)
            continue
        j = where[i]
        logprobs += lp[j, toks].tolist()
        alternatives = list(zip(top_ids[j][:n], top_vals[j][:n])) if n else []
        top += [list(alternatives) for _ in toks]
    return logprobs, top


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            num_top: int) -> tuple[list[float], list[TopLogprobs], list[int]]:
    """Logprobs of the prompt's tokens (for echo + logprobs; vLLM's
    prompt_logprobs, raw: no penalties, no temperature).

    logits: [T, V] (float32, or cast to it), row t the model's prediction for
    target_ids[t]; target_ids: [T] int64 token ids < V; num_top >= 0.
    Returns (per row the target's natural-log probability, per row the num_top
    most likely (token_id, logprob), descending ([] when num_top is 0), per row
    the target's 1-based rank: 1 + the number of tokens strictly more likely).
    Raises ValueError on mismatched shapes or a negative num_top.
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [T, V] and target_ids [T], got {tuple(logits.shape)} "
                         f"and {tuple(target_ids.shape)}")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = lp.gather(1, target_ids.to(device=lp.device, dtype=torch.long).unsqueeze(1))
    ranks = ((lp > target).sum(dim=1) + 1).tolist()
    target = target.squeeze(1).tolist()
    k = min(num_top, lp.shape[1])
    if k == 0:
        return target, [[] for _ in target], ranks
    vals, ids = (t.tolist() for t in torch.topk(lp, k, dim=-1))
    return target, [list(zip(i, v)) for i, v in zip(ids, vals)], ranks
