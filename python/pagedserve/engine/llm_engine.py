"""LLMEngine: the synchronous step loop (nano-vllm's LLMEngine, vLLM's EngineCore).

One step, three calls: C++ Scheduler.schedule() (the decision; laid out by
step_batch.py with the rows the runner must compute) -> ModelRunner.execute()
(one forward pass over every scheduled token, then everything that touches
logits: sampling, grammar masks, prompt logprobs, pooled rows) -> C++
Scheduler.update() (commits the tokens and decides which sequences end and
why, from the stop criteria and what this side found per token: detokenized
text, stop strings, grammars) -> RequestOutputs. Construction is
engine/startup.py's.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import threading
import time

import torch

from .. import _core
from ..config import EngineArgs
from ..errors import RequestRejectedError
from ..metrics import EngineMetrics
from ..model.runner import StepOutput
from ..model.sampler import raw_logprobs
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .outputs import Logprob, PoolingRequestOutput, RequestOutput
from .pooling import Pooler
from .request import Request
from .startup import build_engine
from .step_batch import StepBatch, build_step_batch
from .timeline import Timelines
from .token_bytes import TokenBytes

logger = logging.getLogger(__name__)

# a prompt closes the reasoning when its last tag in this many final tokens is the end tag (a template that
# turned thinking off writes an empty <think></think> at the very end); earlier turns' tags do not count
_PROMPT_TAIL_TOKENS = 16


class LLMEngine:
    """Owns the model, the KV store, the C++ scheduler and the requests.

    Not thread-safe: one thread calls add_request / abort_request / step
    (AsyncLLMEngine serialises the server's calls onto its engine thread).

    Start-up decides, logs and keeps: the dtype (``self.dtype``, "auto"
    resolved from the CPU), the attention backend class and its kernel variant,
    the linear-layer path (engine/startup.py); then the start-up check
    (model/startup_check.py) runs a short prompt through the engine and compares it with the Hugging
    Face forward, so anything that cannot run on this machine fails here, not at
    the first request, and a model the engine would compute wrongly is refused.

    Args:
        args: EngineArgs (defaults when None).
    Raises:
        TypeError / ValueError on a bad argument (EngineArgs); ValueError when
        the KV store cannot be allocated or the chat template cannot be read; pagedserve.errors.ModelLoadError for a
        checkpoint that does not match its model or a model-level feature the
        runner lacks (final logit soft-capping);
        pagedserve.errors.BackendUnavailableError when no backend (or not the
        one named) can serve this device, dtype or the model's attention
        (sliding window, soft-capping, ALiBi, sinks), with the reason;
        pagedserve.errors.InvalidArgumentError when PAGEDSERVE_CPU_ISA names a
        kernel variant that cannot run here; OSError from transformers if the
        model cannot be found; RuntimeError when the start-up check step fails;
        ModelLoadError when its result shows the engine would compute the model
        wrongly (or the model's RoPE depends on the batch: longrope, dynamic).
        All are ValueErrors, except OSError and the start-up RuntimeError.
    """

    def __init__(self, args: EngineArgs | None = None) -> None:
        self.args = args = args or EngineArgs()
        p = build_engine(args)  # engine/startup.py
        self.device, self.dtype, self.max_model_len = p.device, p.dtype, p.max_model_len
        self.model, self.tokenizer, self.model_path, self.model_name = p.model, p.tokenizer, p.model_path, p.model_name
        self.linear_impl, self.linear_path, self.linear_layers = p.linear_impl, p.linear_path, p.linear_layers
        self.model_impl, self.weight_bytes, self.batch_invariance = p.model_impl, p.weight_bytes, p.batch_invariance
        self.backend, self.kv_cache, self.scheduler, self.runner = p.backend, p.kv_cache, p.scheduler, p.runner
        self.eos_token_ids, self.spec_decoder, self.reasoning_parser = p.eos_token_ids, p.spec_decoder, \
            p.reasoning_parser
        self.kv_events = p.kv_events  # KVEventPublisher (--kv-events-endpoint) or None
        self.requests: dict[str, Request] = {}
        self.timelines = Timelines(args.request_timelines)
        self.num_steps = 0  # engine steps that ran (the timelines' step numbers)
        self._structured_output = None  # StructuredOutputManager, built on the first constrained request
        self._start_tokens = None  # StartTagTokens, built on the first constrained request with a reasoning parser
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        self._ids = itertools.count()
        self.last_step_shape = (0, 0)  # (tokens computed, sum of seq_lens) of the last step that ran
        # Held by every change of the engine's state except the forward pass of step(), so that
        # abort_unscheduled can end a request from another thread while a (long) forward runs.
        self.lock = threading.RLock()
        self._in_flight: frozenset[str] = frozenset()  # request ids the forward pass now running computes
        self.metrics = EngineMetrics(self.model_name, self.max_model_len,
                                     per_priority=args.scheduling_policy == "priority",
                                     speculative=args.speculative != "off")

    # ---- requests -------------------------------------------------------
    @property
    def structured_output(self):
        """The StructuredOutputManager of this model's tokenizer (built on first
        use: ~0.2 s). Raises ValueError when the engine has no tokenizer."""
        if self._structured_output is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this engine has none")
            from ..structured_output import StructuredOutputManager

            self._structured_output = StructuredOutputManager(self.tokenizer, self.model.config.vocab_size,
                                                              self.eos_token_ids)
        return self._structured_output

    @property
    def reasoning_start_tokens(self):
        """With a reasoning parser: the StartTagTokens of its start tag for this
        tokenizer (built on first use), which every ReasoningGate shares."""
        if self._start_tokens is None:
            from ..structured_output.reasoning_gate import StartTagTokens

            self._start_tokens = StartTagTokens(self.reasoning_parser.start, self.token_bytes,
                                                self.model.config.vocab_size, len(self.tokenizer))
        return self._start_tokens

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Prompt text -> token ids (token-id prompts pass through unchanged).
        add_special_tokens: let the tokenizer add its BOS etc. around text.
        Raises ValueError for text without a tokenizer or ids outside the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompts as token ids")
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise ValueError("token-id prompts must hold integers (no floats or bools)")
        ids = [int(t) for t in prompt]
        self._check_token_ids(ids)
        return ids

    def _check_token_ids(self, ids, what: str = "") -> None:
        """Raises ValueError naming the first of `ids` outside [0, vocab_size) (what: where they came from)."""
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]}{what} is outside the vocabulary [0, {vocab})")

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, priority: int = 0,
                    timeline: bool = False) -> str:
        """Queues a request; returns its id. cache_salt: requests with different
        salts never share prefix-cache blocks. priority: lower is served first
        (--scheduling-policy priority; any other policy refuses a value other than 0).
        timeline: record the request's RequestTimeline (engine/timeline.py;
        every request records one under --request-timelines N); its final
        RequestOutput carries it.
        PoolingParams make it an embedding request (vLLM's pooling requests): a
        prefill-only request through the same scheduler, whose one output is a
        PoolingRequestOutput (engine/pooling.py); it runs with max_tokens 1
        (the token sampled after the prompt is dropped), so the prompt must
        leave one token of max_model_len free.

        Raises:
            ValueError (including pagedserve.errors.RequestRejectedError) if it can
            never be served: empty prompt, longer than max_model_len with
            max_tokens, more KV blocks than the pool, bad token ids, n above
            max_num_seqs, a priority the scheduling policy does not honour or
            outside int32; pagedserve.errors.InvalidStructuredOutputError (a
            ValueError) for a structured-output constraint that does not
            compile; TypeError for a priority that is not an int.
        """
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            params = SamplingParams(max_tokens=1, temperature=0.0)
        params = params or SamplingParams()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
        if not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be in [-2**31, 2**31 - 1], got {priority}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        ids = self.tokenize(prompt)
        if pooling is not None and len(ids) >= self.max_model_len:
            raise RequestRejectedError(f"embedding a prompt of {len(ids)} tokens needs one token of max_model_len "
                                       f"({self.max_model_len}) free: the prefill samples one token and drops it")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        self._check_token_ids([*(params.logit_bias or ()), *(params.allowed_token_ids or ()),
                               *(t for word in params.bad_words_token_ids or () for t in word)],
                              " (logit_bias / allowed_token_ids / bad_words)")
        # Everything that can fail is built before the scheduler holds the request.
        grammars = None
        if params.structured_outputs is not None:
            compiled = self.structured_output.compile(params.structured_outputs)
            grammars = self.structured_output.new_states(compiled, params.n)
            if self.reasoning_parser is not None:  # the constraint applies to the answer, after the thinking
                from ..structured_output.reasoning_gate import ReasoningGate

                ended = params.reasoning_ended
                if ended is None:
                    ended = self.reasoning_ended_in_prompt(ids)
                grammars = [ReasoningGate(g, self.reasoning_parser, self.token_bytes, self.eos_token_ids,
                                          self.reasoning_start_tokens, ended) for g in grammars]
        req = Request.create(request_id, prompt if isinstance(prompt, str) else None, ids, params, self.tokenizer,
                             grammars)
        req.priority = priority
        if pooling is not None:
            req.pooler = Pooler(pooling, len(ids))
        stop = _core.StopCriteria(params.max_tokens, params.ignore_eos, self.eos_token_ids,
                                  params.stop_token_ids)
        # prompt logprobs and mean pooling need every prompt position computed: no prefix-cache reads
        self.scheduler.add_request(request_id, ids, stop, cache_salt or "", params.n,
                                   params.prompt_logprobs is not None or (
                                       pooling is not None and pooling.pooling_type == "mean"), priority)
        if self.timelines.wants(timeline):  # after the scheduler took it: a refused request records nothing
            req.timeline = self.timelines.start(request_id, len(ids), req.arrival_time)
        self.requests[request_id] = req
        return request_id

    def abort_all(self) -> list[RequestOutput]:
        """Aborts every request (after a failed step); returns their final outputs."""
        return [out for rid in list(self.requests) if (out := self.abort_request(rid)) is not None]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request in any state and frees its KV blocks at once. Returns its
        final output (finish_reason "abort"), or None if it is unknown."""
        self.scheduler.abort(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for choice in req.choices:
            choice.finish("abort")
        self.timelines.finish(req, self.num_steps)
        out = req.make_output()
        self._observe_finished(req)
        self.observe_scheduler()
        return out

    def abort_unscheduled(self, request_id: str) -> bool:
        """Aborts a request at once, from any thread, unless the forward pass
        now running computes it: a waiting (queued or preempted) request, or a
        running one this step did not schedule, ends and gives back its blocks
        without waiting for the step in flight, however long that step takes.
        Returns True if it ended the request here; False if it is in the step
        in flight (abort it after the step: abort_request) or unknown."""
        with self.lock:
            if request_id in self._in_flight or request_id not in self.requests:
                return False
            self.abort_request(request_id)
            return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns an output for each request that sampled.
        Holds self.lock throughout but for the forward pass (abort_unscheduled)."""
        with self.lock:
            if self.spec_decoder is not None:
                self.spec_decoder.propose(self.requests.values())
            out = self.scheduler.schedule()  # 1. the decision
            if out.empty:
                return []
            batch = self._begin_step(out)
            self._in_flight = frozenset(out.request_ids)
            self.observe_scheduler()  # the gauges say running for what this step computes, while it does
        try:
            result = self.runner.execute(batch.runner_input)  # 2. forward and sampling
        finally:
            with self.lock:
                self._in_flight = frozenset()
        with self.lock:
            logprob_of, kept, ended_text = self._take_results(batch, result)
            # 3. this side's findings per token (text, stop strings, grammars), then the commit: update() is the
            # one place that decides which sequences end and why
            finished_by_caller = [self._apply_sample(slot, token, kept.get(slot, ()), logprob_of.get(slot),
                                                     slot in ended_text)
                                  for slot, token in zip(batch.slots, result.sampled.token_ids)]
            updates = self.scheduler.update(result.sampled.token_ids, finished_by_caller)
            return self._end_step(updates, sum(map(len, kept.values())))

    def _begin_step(self, out) -> StepBatch:
        """Counts the step, records it in the timelines and the requests' first
        scheduled times, and lays out its StepBatch."""
        self.num_steps += 1
        now = time.monotonic()
        self.timelines.record_step(self.num_steps, now, out)
        for rid in dict.fromkeys(out.request_ids):
            req = self.requests[rid]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        batch = build_step_batch(out, self.requests, self.spec_decoder)
        inp = batch.runner_input.model_input
        # the step's shape, for step-cost models (pagedserve.experiments.step_cost)
        self.last_step_shape = (inp.num_tokens, int(inp.seq_lens.sum()))
        return batch

    def _take_results(self, batch: StepBatch, result: StepOutput
                      ) -> tuple[dict, dict[tuple[str, int], list[tuple[int, Logprob | None]]], set]:
        """Hands the requests their prompt logprobs and pooled rows, verifies the
        drafts; returns each sampled token's Logprob by slot (where asked), and
        the kept drafts by slot and the slots whose text a kept draft ended
        (_verify_drafts)."""
        for req, rows, (lps, tops, ranks) in zip(batch.prompt_requests, batch.runner_input.prompt_logprobs,
                                                 result.prompt_logprobs):
            req.prompt_logprobs += [Logprob(t, lp, top, rank)
                                    for t, lp, top, rank in zip(rows.target_ids, lps, tops, ranks)]
        for (req, positions), hidden in zip(batch.pooled_requests, result.pooled):
            req.pooler.add(hidden, positions)
        sampled = result.sampled
        logprob_of = {}
        for slot, tok, lp, top in zip(batch.slots, sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
            if lp is not None:
                logprob_of[slot] = Logprob(tok, lp, top or [])
        kept, ended_text = self._verify_drafts(batch.drafts, result.draft_logits, batch.slots, sampled.token_ids,
                                               result.logits, batch.slot_rows, logprob_of)
        self.timelines.drafts_kept(kept)
        return logprob_of, kept, ended_text

    def _end_step(self, updates, num_kept_drafts: int) -> list[RequestOutput | PoolingRequestOutput]:
        """Applies Scheduler.update's results (each choice's token record, cached
        tokens, the finish reasons it decided) and makes the step's outputs."""
        touched: dict[str, Request] = {}
        num_generated = num_kept_drafts
        for upd in updates:
            req = self.requests[upd.request_id]
            req.num_cached_tokens = upd.num_cached_tokens
            choice = req.choices[upd.index]
            if choice.sequence is None:  # its first token: from now on the choice reads its tokens there
                choice.sequence = upd.sequence
            if upd.finished:
                choice.finish(upd.finish_reason_str)
            num_generated += req.pooler is None  # an embedding request's token ends its prefill: not output
            touched[req.request_id] = req
        if self.kv_events is not None:  # what this step's schedule() evicted and update() cached
            self.kv_events.publish(self.scheduler.take_kv_events())
        return self._make_outputs(touched.values(), num_generated)

    def _apply_sample(self, slot: tuple[str, int], token_id: int, kept_drafts, logprob: Logprob | None,
                      ended_text: bool = False) -> _core.CallerFinish:
        """Gives choice `slot` (request id, index) its sampled token (grammar,
        text, stop strings) and the Logprobs of it and its kept drafts (whose
        text verification gave it already) and returns what this side found for
        Scheduler.update: STOP for a stop string (ended_text: a kept draft's
        text ended in one, and that draft is token_id), a grammar's end (e.g.
        with ignore_eos: it allows nothing after) or an embedding request (its
        prompt is pooled, the token dropped); STOP_IF_FINISHED when a stop
        string completes in held-back text; else NONE."""
        req = self.requests[slot[0]]
        if req.pooler is not None:
            return _core.CallerFinish.STOP
        choice = req.choices[slot[1]]
        for _, lp in kept_drafts:
            choice.add_logprob(lp)
        if ended_text:
            choice.add_logprob(logprob)
            return _core.CallerFinish.STOP
        grammar_ended = choice.grammar is not None and self._advance_grammar(choice, token_id)
        if choice.append_token(token_id, logprob):
            return _core.CallerFinish.STOP
        if grammar_ended:
            return _core.CallerFinish.STOP
        return _core.CallerFinish.STOP_IF_FINISHED if choice.stop_if_finished() else _core.CallerFinish.NONE

    def _verify_drafts(self, drafts, logits: torch.Tensor, slots: list[tuple[str, int]], sampled_tokens: list[int],
                       sampling_logits: torch.Tensor, slot_rows: list[int], logprob_of: dict
                       ) -> tuple[dict[tuple[str, int], list[tuple[int, Logprob | None]]], set[tuple[str, int]]]:
        """Verifies the step's drafts (SpeculativeDecoder.verify, which gives
        each kept draft's text to its choice and cuts at a stop string) from
        their rows' logits [D, vocab] float32 and puts each sequence's token
        after its kept drafts in its place in sampled_tokens (the list update()
        takes) and, where the request asked for logprobs, that token's Logprob in
        logprob_of (by slot). sampling_logits [S, vocab]: the step's sampling
        rows; slot_rows[i]: the row slot i was sampled from. Returns the kept drafts per (request_id, choice index),
        each with its Logprob (None where the request asked for none), and the
        slots whose token is a kept draft that ended the text (Verified.ended_text)."""
        if not drafts:
            return {}, set()
        where = {slot: i for i, slot in enumerate(slots)}
        live = [i for i, d in enumerate(drafts) if d.request_id in self.requests]
        if len(live) < len(drafts):  # a request ended between schedule() and here: its rows are skipped
            starts = [0, *itertools.accumulate(len(d.rows) for d in drafts)]
            logits = torch.cat([logits[starts[i]:starts[i + 1]] for i in live]) if live else logits[:0]
            drafts = [drafts[i] for i in live]
            if not drafts:
                return {}, set()
        pos = [where[(d.request_id, d.index)] for d in drafts]
        reqs = [self.requests[d.request_id] for d in drafts]
        choices = [r.choices[d.index] for r, d in zip(reqs, drafts)]
        slot_logits = {i: sampling_logits[slot_rows[i]] for i in pos}
        verified = self.spec_decoder.verify(drafts, logits, [sampled_tokens[i] for i in pos], [r.params for r in reqs],
                                            [c.generator for c in choices], [c.grammar for c in choices],
                                            [slot_logits[i] for i in pos], [c.add_text for c in choices])
        kept, ended_text = {}, set()
        for d, v, i, r in zip(drafts, verified, pos, reqs):
            slot = (d.request_id, d.index)
            n_top = r.params.logprobs
            if n_top is None:
                kept[slot] = [(t, None) for t in v.accepted]
            else:  # each token's Logprob from the row that decided it
                source = logits[v.rows + [v.token_row]] if v.token_row is not None else torch.cat(
                    [logits[v.rows], slot_logits[i][None]])
                lps, tops = raw_logprobs(source, [[t] for t in (*v.accepted, v.token_id)], [n_top] * len(source))
                entries = [Logprob(t, lp, top) for t, lp, top in zip((*v.accepted, v.token_id), lps, tops)]
                kept[slot] = list(zip(v.accepted, entries))
                if v.token_row is not None or v.token_id != sampled_tokens[i]:
                    logprob_of[slot] = entries[-1]
            sampled_tokens[i] = v.token_id
            if v.ended_text:
                ended_text.add(slot)
            r.num_draft_tokens += len(d.drafts)
            r.num_accepted_tokens += len(v.accepted)
        self.metrics.observe_spec_decode(len(drafts), sum(len(d.drafts) for d in drafts),
                                         sum(len(v.accepted) for v in verified))
        return kept, ended_text

    @staticmethod
    def _advance_grammar(choice, token_id: int) -> bool:
        """Feeds a sampled token to the choice's grammar; True when the grammar
        has ended (accepted its stop token). A token the grammar refuses cannot
        be sampled through the mask; should one arrive, it is logged and the
        choice ends."""
        if not choice.grammar.accept(token_id):
            logger.error("token %d refused by the grammar of a constrained choice; ending it", token_id)
            return True
        return choice.grammar.terminated

    def _make_outputs(self, reqs, num_generated: int) -> list[RequestOutput | PoolingRequestOutput]:
        """RequestOutputs of the requests that got tokens this step (an
        embedding request's PoolingRequestOutput); timings and metrics (an
        embedding request has no first token: no TTFT)."""
        now = time.monotonic()
        outputs, prompt_tokens, itls = [], 0, []
        for req in reqs:
            itl = req.on_tokens(now)
            if itl is None:  # first token: the prefill is done
                prompt_tokens += len(req.prompt_token_ids)
                if req.pooler is None:
                    self.metrics.observe_first_token(now - req.arrival_time,
                                                     req.first_scheduled_time - req.arrival_time, req.priority)
            else:
                itls.append(itl)
            if req.finished:
                self.timelines.finish(req, self.num_steps)
            outputs.append(req.make_output())
            if req.finished:
                del self.requests[req.request_id]
                self._observe_finished(req)
        self.metrics.observe_tokens(prompt_tokens, num_generated)
        self.metrics.observe_inter_token(itls)
        self.observe_scheduler()
        return outputs

    def reasoning_ended_in_prompt(self, prompt_token_ids: list[int]) -> bool:
        """With a reasoning parser: whether the prompt's last _PROMPT_TAIL_TOKENS
        tokens close the reasoning (a template that turned thinking off), so the
        whole output is answer. False without a parser."""
        if self.reasoning_parser is None:
            return False
        return self.reasoning_parser.ended_in_prompt(self.tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]))

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as written (leading spaces dropped) and
        with one leading space (how a word usually follows another), without
        special tokens; duplicates once. Raises ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (this engine has none); give bad_words_token_ids")
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer(text, add_special_tokens=False).input_ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _observe_finished(self, req: Request) -> None:
        """Per choice, as vLLM counts the n child requests of a parallel-sampling
        request: its finish reason, the prompt and its output length, the latency;
        with speculative decoding, a log line of the request's acceptance."""
        e2e = (req.finished_time or time.monotonic()) - req.arrival_time
        # an embedding request's one token ends its prefill: it has no output
        lengths = [0 if req.pooler is not None else c.num_output_tokens for c in req.choices]
        for c, n in zip(req.choices, lengths):
            self.metrics.observe_finished(c.finish_reason, len(req.prompt_token_ids), n, e2e)
        if self.spec_decoder is not None:  # in the words of the start-up line "speculative decoding: ..."
            outputs = sum(lengths)
            logger.info("request %s: speculative decoding: %d of %d draft tokens accepted (%s), %d output tokens",
                        req.request_id, req.num_accepted_tokens, req.num_draft_tokens,
                        f"{100 * req.num_accepted_tokens / req.num_draft_tokens:.0f}%" if req.num_draft_tokens
                        else "no drafts", outputs)

    def observe_scheduler(self) -> None:
        """Publishes the scheduler's gauges and counters to self.metrics."""
        stats = self.scheduler.prefix_cache_stats
        self.metrics.observe_scheduler(self.scheduler.num_running, self.scheduler.num_waiting,
                                       self.scheduler.kv_cache_manager.usage, stats.queries, stats.hits,
                                       self.scheduler.num_preemptions)

    # ---- introspection ---------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def replica_report(self):
        """This engine as a replica reports itself to a router
        (pagedserve.scaleout.router.ReplicaReport): running and waiting
        requests, free KV blocks, and the hashes of every block its prefix
        cache holds (in use or evictable; docs/scale-out.md)."""
        from ..scaleout.router import ReplicaReport

        kv = self.scheduler.kv_cache_manager
        return ReplicaReport(self.scheduler.num_running, self.scheduler.num_waiting, kv.num_free_blocks,
                             frozenset(kv.cached_block_hashes()))

    @property
    def prefix_cache_stats(self):
        """pagedserve._core.PrefixCacheStats: queries and hits (tokens), evictions (blocks)."""
        return self.scheduler.prefix_cache_stats
