"""Speculative decoding in the engine step (``--speculative ngram``): draft
tokens proposed before schedule(), verified on the same forward pass as the
rest of the step, the verified prefix kept.

A sequence with k drafts is scheduled as k + 1 query tokens (its last token,
then the drafts: Scheduler.add_draft_tokens). The forward pass gives logits at
each of them: the row of the last token predicts draft 1, the row of draft i
predicts draft i + 1, and the last row (the step's ordinary sampling row)
predicts the token after them all.

At temperature 0, greedy acceptance keeps the longest prefix of drafts equal
to the model's argmax at their positions, then takes the model's own token
after that prefix: the tokens are exactly those of one forward pass per
token, provided a row's logits do not depend on how many rows share its step
(batch invariance, the default on the cpu backend). At temperature > 0,
speculative sampling (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", 2023; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling", 2023) with a deterministic proposal
(q = a point mass on the draft d): d is kept with probability p(d), p the
request's sampling distribution at that position (temperature, min-p,
top-k, top-p); on rejection the token is drawn from p without d,
renormalised; after every draft is kept, the step's own draw from the last
row follows. Each emitted token is then distributed as p exactly
(p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x)); the draws
come from the choice's own generator (seeded requests stay reproducible,
though not draw-for-draw equal to decoding without speculation). The rejected
drafts' slots and blocks are given back and never reach the prefix cache
(Scheduler.accept_draft_tokens).

A constrained choice (structured outputs) judges each draft on its logits
masked by its grammar in the state after the drafts before it (a draft the
grammar forbids has probability 0 and is rejected), advances the grammar by
each kept draft, and draws the token after them all from the last row masked
in that state, not from the step's ordinary draw (made before the drafts were
known). Logprobs of the kept drafts and of the token after them come from the
rows that decided them: the same bits as without speculation where the
kernels are batch invariant. Each of n > 1 choices is a sequence of its own
after its first token and takes its own drafts. Requests with penalties
(which depend on every earlier output token) or token filters (min_tokens,
logit_bias, allowed_token_ids, bad words) are not proposed for; they decode one token per
step in the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..model.sampler import draw, sampling_probs
from ..sampling_params import SamplingParams
from .ngram_proposer import NgramProposer


@dataclass
class DraftRows:
    """One sequence's drafts in a step.

    Attributes:
        request_id, index: the sequence (request, choice index).
        drafts: the draft token ids the step computes (after any the scheduler dropped).
        rows: [len(drafts)] flat-batch indices of the rows predicting each draft
            (the sequence's last verified token, then every draft but the last).
    """

    request_id: str
    index: int
    drafts: list[int]
    rows: list[int]


@dataclass
class Verified:
    """A sequence's verification.

    Attributes:
        accepted: the drafts kept, in order (they are output tokens now).
        token_id: the token the step samples after them (the model's argmax
            there, or the stop token that ended the kept drafts).
        rows: [len(accepted)] the rows (of verify's logits) that decided each kept draft.
        token_row: the row of verify's logits that decided token_id (a
            rejected or stopping draft's position), or None for the step's
            sampling row (token_id then differs from that row's ordinary draw
            only for a constrained choice, redrawn in its advanced grammar state).
        ended_text: token_id is a kept draft whose text completed a stop string
            (verify's add_text said so; its text is the choice's already).
    """

    accepted: list[int]
    token_id: int
    rows: list[int]
    token_row: int | None = None
    ended_text: bool = False


def eligible(params: SamplingParams) -> bool:
    """Whether a request's tokens may be proposed for: no penalties and no
    token filters (min_tokens, logit_bias, allowed_token_ids, bad words; see the module
    docstring)."""
    return not params.has_penalties and not params.has_token_filters


class SpeculativeDecoder:
    """The engine's speculative-decoding step parts (see the module docstring).

    Args:
        scheduler: the engine's _core.Scheduler.
        proposer: where drafts come from (NgramProposer).
        eos_token_ids: the model's end-of-sequence ids (a kept draft ends the
            sequence there unless the request ignores EOS).
    """

    def __init__(self, scheduler, proposer: NgramProposer, eos_token_ids: list[int]) -> None:
        self.scheduler, self.proposer, self.eos_token_ids = scheduler, proposer, set(eos_token_ids)

    def propose(self, requests) -> None:
        """Before schedule(): adds drafts to every eligible choice that has
        output (requests: the engine's Request objects). The scheduler takes
        them only for a running decode and caps them by max_tokens and
        max_model_len."""
        for req in requests:
            if not eligible(req.params) or req.finished:
                continue
            for choice in req.choices:
                if choice.finish_reason is not None or not choice.num_output_tokens:
                    continue
                draft = self.proposer.propose(req.prompt_token_ids + choice.output_token_ids)
                if draft:
                    self.scheduler.add_draft_tokens(req.request_id, choice.index, draft)

    @staticmethod
    def rows(out, inp) -> list[DraftRows]:
        """The step's sequences with drafts (out: SchedulerOutput, inp: its
        ModelInput), each with the flat rows whose logits verify them."""
        counts = out.num_draft_tokens
        if not counts.any():
            return []
        qsl, tokens = inp.query_start_loc, out.token_ids
        request_ids, seq_indices = out.request_ids, out.seq_indices
        found = []
        for b in np.flatnonzero(counts).tolist():
            k, end = int(counts[b]), int(qsl[b + 1])
            found.append(DraftRows(request_ids[b], int(seq_indices[b]), tokens[end - k:end].tolist(),
                                   list(range(end - k - 1, end - 1))))
        return found

    def verify(self, drafts: list[DraftRows], logits: torch.Tensor, last_tokens: list[int],
               params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
               grammars: list | None = None, last_logits: list[torch.Tensor] | None = None,
               add_text: list[Callable[[int], bool]] | None = None) -> list[Verified]:
        """For each sequence (logits [sum of len(rows), V] float32, row after
        row; last_tokens[i]: the step's sampled token after all of sequence
        i's drafts; generators[i]: its choice's generator, None for torch's
        default; grammars[i]: its choice's GrammarState or None; last_logits[i]:
        [V] its sampling row's logits, read only for a constrained choice;
        add_text[i]: gives a kept draft's text to sequence i's choice and says
        whether a stop string ended there, None: no text):
        the drafts kept (greedy: the leading ones equal to their rows' argmax,
        masked by the grammar if any; temperature > 0: speculative sampling,
        see the module docstring), cut at a stop token or at a draft whose text
        ends in a stop string, which then becomes the sampled token
        (Verified.ended_text for the latter); else the token after them.
        Advances each grammar by the kept drafts. Tells the scheduler how many
        it keeps (accept_draft_tokens), so the output committed to its
        record ends where the text does."""
        argmax = logits.numpy().argmax(axis=1).tolist() if logits.shape[0] else []
        generators = generators or [None] * len(drafts)
        grammars = grammars or [None] * len(drafts)
        add_text = add_text or [None] * len(drafts)
        results, at = [], 0
        for i, (d, last, p, g, grammar, text) in enumerate(zip(drafts, last_tokens, params, generators, grammars,
                                                                add_text)):
            rows = range(at, at + len(d.drafts))
            at += len(d.drafts)
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if grammar is not None:  # the grammar ends at EOS even where the request ignores it
                stops |= self.eos_token_ids
            v = Verified([], last, [])
            for draft, row in zip(d.drafts, rows):
                x, best = logits[row], argmax[row]
                if grammar is not None:
                    x = grammar.mask_logits(x)
                    best = int(torch.argmax(x))
                keep, other = self._judge(draft, x, best, p, g)
                if not keep or draft in stops:  # a stop token ends the sequence: it becomes the sampled one
                    v.token_id, v.token_row = (draft if keep else other), row
                    break
                if text is not None and text(draft):  # so does a draft that completes a stop string
                    v.token_id, v.token_row, v.ended_text = draft, row, True
                    break
                v.accepted.append(draft)
                v.rows.append(row)
                if grammar is not None:
                    grammar.accept(draft)
            else:
                if grammar is not None:  # the step's draw used the state before the drafts: draw again
                    x = grammar.mask_logits(last_logits[i])
                    best = int(torch.argmax(x))
                    v.token_id = best if p.greedy else draw(x, p, [g], best)[0]
            self.scheduler.accept_draft_tokens(d.request_id, d.index, len(v.accepted))
            results.append(v)
        return results

    @staticmethod
    def _judge(draft: int, row: torch.Tensor, argmax: int, p: SamplingParams,
               g: torch.Generator | None) -> tuple[bool, int]:
        """(keep the draft, else the token drawn in its place) at one position:
        row [V] the logits there, argmax its argmax."""
        if p.greedy:
            return draft == argmax, argmax
        probs = sampling_probs(row, p)
        if not torch.isfinite(probs).all():  # overflowing logits: the argmax is the limit, as the sampler does
            return draft == argmax, argmax
        if float(torch.rand((), generator=g)) < float(probs[draft]):
            return True, draft
        residual = probs.clone()
        residual[draft] = 0.0
        if not float(residual.sum()) > 0.0:  # p was a point mass on the draft, so it is kept above; rounding
            return True, draft
        return False, int(torch.multinomial(residual, 1, generator=g))


def make_speculative_decoder(args, scheduler, eos_token_ids: list[int]) -> SpeculativeDecoder | None:
    """The engine's SpeculativeDecoder for EngineArgs ``args`` (None when
    args.speculative is "off")."""
    if args.speculative == "off":
        return None
    proposer = NgramProposer(args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max)
    return SpeculativeDecoder(scheduler, proposer, eos_token_ids)


__all__ = ["DraftRows", "SpeculativeDecoder", "Verified", "eligible", "make_speculative_decoder"]
