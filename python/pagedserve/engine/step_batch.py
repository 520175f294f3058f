"""StepBatch: one scheduler decision turned into what the runner needs (its
StepInput: the ModelInput and every row it must compute) and the map back
from the runner's results to the requests and choices they belong to."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _core
from ..model.runner import PromptLogprobRows, StepInput
from ..model.sampler import SamplingRow
from .request import Request


@dataclass
class StepBatch:
    """One step's rows.

    Attributes:
        runner_input: the runner's StepInput.
        slots: (request id, choice index) of each sampled token, in the order
            of the runner's sampled tokens (and of Scheduler.update's list).
        slot_rows: per slot, its row of the sampling logits.
        prompt_requests: per PromptLogprobRows of runner_input, its request.
        pooled_requests: per pooled entry of runner_input, (its request, the prompt positions pooled).
        drafts: the speculative decoder's DraftRows of this step ([] without one).
    """

    runner_input: StepInput
    slots: list[tuple[str, int]]
    slot_rows: list[int]
    prompt_requests: list[Request]
    pooled_requests: list[tuple[Request, list[int]]]
    drafts: list


def build_step_batch(out, requests: dict[str, Request], spec_decoder=None) -> StepBatch:
    """Lays out the SchedulerOutput ``out`` (``_core.ModelInput``) and collects
    its rows: one SamplingRow per sampling sequence (its choices' generators,
    output tokens where penalties or token filters read them, and grammars), the prompt positions to score for requests
    that want prompt logprobs and prefill this step, the positions embedding
    requests pool (positions already scored or pooled before a preemption are
    skipped), and the draft rows. requests: the engine's live requests by id."""
    inp = _core.ModelInput(out)
    # read each array once: request_ids is converted to a Python list per access
    request_ids, seq_indices = out.request_ids, out.seq_indices.tolist()
    rows, slots, slot_rows = [], [], []
    for b, k in zip(out.sampling_seq_indices.tolist(), out.num_samples.tolist()):
        req, first = requests[request_ids[b]], seq_indices[b]
        choices = [req.choices[first + j] for j in range(k)]
        grammars = [c.grammar for c in choices] if req.params.structured_outputs is not None else None
        p = req.params  # the sampler reads output tokens only for these: copy them out of the records only then
        outputs = ([c.output_token_ids for c in choices] if p.has_penalties or p.has_token_filters
                   else [()] * k)
        rows.append(SamplingRow(p, [c.generator for c in choices], req.prompt_token_ids, outputs, grammars))
        slots += [(req.request_id, first + j) for j in range(k)]
        slot_rows += [len(rows) - 1] * k
    scored, prompt_requests, pooled, pooled_requests = [], [], [], []
    qsl = None
    for b, rid in enumerate(request_ids):
        req = requests[rid]
        if req.prompt_logprobs is None and req.pooler is None:
            continue
        if qsl is None:
            qsl, computed = inp.query_start_loc.tolist(), out.num_computed_tokens.tolist()
            scheduled = out.num_scheduled_tokens.tolist()
        if req.pooler is not None:
            positions = req.pooler.rows_to_pool(computed[b], scheduled[b])
            if positions:
                pooled.append([qsl[b] + p - computed[b] for p in positions])
                pooled_requests.append((req, positions))
            continue
        n_prompt = len(req.prompt_token_ids)
        # position p predicts prompt token p + 1; prompt_logprobs holds 1 + scored positions
        lo = max(computed[b], len(req.prompt_logprobs) - 1)
        hi = min(computed[b] + scheduled[b], n_prompt - 1)
        if hi > lo:
            scored.append(PromptLogprobRows([qsl[b] + p - computed[b] for p in range(lo, hi)],
                                            req.prompt_token_ids[lo + 1:hi + 1], req.params.prompt_logprobs))
            prompt_requests.append(req)
    drafts = spec_decoder.rows(out, inp) if spec_decoder is not None else []
    return StepBatch(StepInput(inp, rows, [i for d in drafts for i in d.rows], scored, pooled),
                     slots, slot_rows, prompt_requests, pooled_requests, drafts)
