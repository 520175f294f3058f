"""LLMEngine: the synchronous step loop (nano-vllm's LLMEngine, vLLM's EngineCore).

One step = C++ Scheduler.schedule() (the decision) -> _core.ModelInput (its
layout for the model) -> ModelRunner.execute() (one forward pass
over every scheduled token) -> Sampler -> C++ Scheduler.update() -> detokenize,
stop strings, RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import sys
import time

import torch

from .. import _core
from ..config import EngineArgs
from ..errors import ModelLoadError, RequestRejectedError
from ..hardware import cpu_capabilities, release_free_memory, resolve_dtype
from ..kernels import resolve_backend
from ..kernels.backend import AttentionSpec
from ..metrics import EngineMetrics
from ..model.attention import register as register_attention
from ..model.features import attention_features, dynamic_rope_limit
from ..model.kv_cache import KVCache
from ..model.loader import gguf_source, load_config, load_model
from ..model.prepare import describe_batch_invariance, prepare_model
from ..model.runner import ModelRunner, check_prompt, hf_reference_logits
from ..model.sampler import Sampler, SamplingRow, compute_prompt_logprobs, raw_logprobs
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from ..templates import load_chat_template
from ..reasoning import get_parser
from .outputs import Logprob, PoolingRequestOutput, RequestOutput
from .pooling import Pooler
from .request import Request
from .spec_decode import make_speculative_decoder
from .timeline import Timelines
from .token_bytes import TokenBytes

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_SLICE = 128  # prompt positions scored per lm_head call (memory bound)
# a prompt closes the reasoning when its last tag in this many final tokens is the end tag (a template that
# turned thinking off writes an empty <think></think> at the very end); earlier turns' tags do not count
_PROMPT_TAIL_TOKENS = 16


class LLMEngine:
    """Owns the model, the KV store, the C++ scheduler and the requests.

    Not thread-safe: one thread calls add_request / abort_request / step
    (AsyncLLMEngine serialises the server's calls onto its engine thread).

    Start-up decides, logs and keeps: the dtype (``self.dtype``, "auto"
    resolved from the CPU), the attention backend class and its kernel variant,
    the linear-layer path; then the start-up check (ModelRunner.startup_check)
    runs a short prompt through the engine and compares it with the Hugging
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
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        if self.device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError("device 'mps' asked for, but torch sees no MPS device")
        self.dtype, why_dtype = resolve_dtype(args.dtype, args.device)
        path, name, hf_config = load_config(args.model)
        hf = hf_config.get_text_config()
        max_model_len = args.max_model_len or getattr(hf, "max_position_embeddings", None)
        features = attention_features(hf_config, max_model_len or sys.maxsize)
        backend_cls = resolve_backend(args.attention_backend, self.device, self.dtype, features)
        if max_model_len is None:
            raise ValueError(f"{name}'s config sets no max_position_embeddings: give max_model_len")
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds {name}'s max_position_embeddings ({limit})")
        self.max_model_len = int(max_model_len)
        rope = dynamic_rope_limit(hf_config)
        if rope is not None and self.max_model_len > rope[1]:
            raise ModelLoadError(
                f"{name} uses {rope[0]} RoPE scaling, whose frequencies follow the longest position in each "
                f"forward pass; in a packed batch that is another sequence's, so it is served exactly only with "
                f"max_model_len <= {rope[1]} (asked: {self.max_model_len})")
        variant = backend_cls.active_variant()  # raises for a kernel variant this CPU cannot run
        loaded = load_model(path, name, hf_config, dtype=self.dtype, device=self.device,
                            attn_implementation=register_attention(), skip_tokenizer_init=args.skip_tokenizer_init)
        self.model, self.tokenizer, self.model_path = loaded.model, loaded.tokenizer, loaded.path
        if args.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template needs the model's tokenizer (do not skip_tokenizer_init)")
            self.tokenizer.chat_template = load_chat_template(args.chat_template)
        late = backend_cls.unsupported_features(attention_features(hf_config, self.max_model_len, self.model))
        if late:  # parameters the config did not announce (attention sinks)
            raise ModelLoadError(f"{name} needs {', '.join(late)}, which the {backend_cls.name} backend does "
                                 "not implement")
        # the start-up check's reference: the model exactly as loaded, before the engine changes anything
        check_ids = check_prompt(hf.vocab_size, args.block_size, self.max_model_len)
        try:
            reference, noise = hf_reference_logits(self.model, check_ids)
        except Exception as e:
            raise ModelLoadError(f"{name}: the Hugging Face forward itself failed on the start-up check prompt "
                                 f"({type(e).__name__}: {e})") from e
        prepared = prepare_model(self.model, self.dtype, self.device, self.max_model_len,
                                 linear_impl=args.linear_impl, quantization=args.quantization,
                                 model_impl=args.model_impl, gguf_path=gguf_source(args.model),
                                 native_step=args.native_step, batch_invariant=args.batch_invariant)
        self.linear_impl, self.linear_path = prepared.linear_impl, prepared.linear_path
        self.model_impl, self.weight_bytes = prepared.model_impl, prepared.weight_bytes
        self.linear_layers = prepared.linear_layers
        self.batch_invariance = describe_batch_invariance(args.batch_invariant, backend_cls.name,
                                                          prepared.dense_gemm_layers)
        self.model_name = args.served_model_name or loaded.name
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads  # GPT-2: MHA
        block_size = args.block_size
        block_bytes = KVCache.bytes_per_block(hf.num_hidden_layers, block_size, num_kv_heads, head_dim, self.dtype)
        num_blocks = args.num_kv_blocks or max(1, min(args.kv_cache_memory // block_bytes, 2**31 - 1))
        self.backend = backend_cls(AttentionSpec(hf.num_attention_heads, num_kv_heads, head_dim,
                                                 block_size, num_blocks, self.dtype, self.device,
                                                 batch_invariant=args.batch_invariant))
        try:
            self.kv_cache = KVCache(hf.num_hidden_layers, self.backend)
        except (RuntimeError, MemoryError) as e:  # the allocator refused
            raise ValueError(f"cannot allocate a KV store of {num_blocks} blocks "
                             f"({num_blocks * block_bytes / 2**30:.1f} GiB): {e}") from e
        self.scheduler = _core.Scheduler(
            _core.SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len,
                                  args.enable_prefix_caching, args.scheduling_policy, args.watermark,
                                  args.high_watermark),
            num_blocks, block_size)
        if args.trace_steps is not None:  # every call into the scheduler, for `pagedserve replay`
            from .step_trace import TracingScheduler

            self.scheduler = TracingScheduler(self.scheduler, args.trace_steps)
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, self.max_model_len, prepared.lean)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids)
        self.spec_decoder = make_speculative_decoder(args, self.scheduler, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.timelines = Timelines(args.request_timelines)
        self.num_steps = 0  # engine steps that ran (the timelines' step numbers)
        self._structured_output = None  # StructuredOutputManager, built on the first constrained request
        self.reasoning_parser = get_parser(args.reasoning_parser)
        if self.reasoning_parser is not None and self.tokenizer is None:
            raise ValueError("--reasoning-parser needs the model's tokenizer")
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        self._ids = itertools.count()
        self.last_step_shape = (0, 0)  # (tokens computed, sum of seq_lens) of the last step that ran
        self.metrics = EngineMetrics(self.model_name, self.max_model_len,
                                     per_priority=args.scheduling_policy == "priority",
                                     speculative=args.speculative != "off")
        why_backend = ("auto: the highest-priority backend available here" if args.attention_backend in (None, "auto")
                       else "asked for")
        if variant:
            forced = os.environ.get("PAGEDSERVE_CPU_ISA")
            why_backend += f"; kernel variant {variant}, " + (
                "forced by PAGEDSERVE_CPU_ISA" if forced else "the best this CPU runs")
        caps = cpu_capabilities() if self.device.type == "cpu" else None
        logger.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), why_dtype)
        logger.info("attention backend %s on %s (%s)%s", backend_cls.name, self.device, why_backend,
                    f"; CPU {caps.arch}: {' '.join(caps.features) or 'baseline ISA only'}" if caps else "")
        logger.info("decoder forward: %s", self.model_impl)
        logger.info("linear layers: %s", self.linear_path)
        logger.info("linear layers by type:\n  %s", self.linear_layers.replace("\n", "\n  "))
        logger.info("batch invariance: %s", self.batch_invariance)
        if self.spec_decoder is not None:
            logger.info("speculative decoding: %s, %d draft tokens, n-grams of %d..%d tokens", args.speculative,
                        args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max)
            if self.batch_invariance != "on":
                logger.warning("speculative decoding without full batch invariance (%s): a verified token can "
                               "differ from decoding without speculation where a row's logits depend on the rows "
                               "beside it", self.batch_invariance)
        logger.info("memory: weights %.1f MiB, KV cache %d blocks x %d tokens (%.1f MiB), max_model_len %d",
                    self.weight_bytes / 2**20, num_blocks, block_size, self.kv_cache.nbytes / 2**20,
                    self.max_model_len)
        logger.info("scheduler: %s policy%s, max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s",
                    args.scheduling_policy,
                    f" (watermark {args.watermark:g}, high watermark {args.high_watermark:g})"
                    if args.scheduling_policy == "memory-aware" else "",
                    args.max_num_seqs, args.max_num_batched_tokens, "on" if args.enable_prefix_caching else "off")
        try:
            check = self.runner.startup_check(check_ids, reference, noise, quantized=args.quantization != "none")
        except Exception as e:
            raise RuntimeError(f"start-up check step failed with dtype {self.dtype}, attention backend "
                               f"{backend_cls.name}, linear layers {self.linear_path} ({type(e).__name__}: {e}); "
                               f"if the model's decoder is not a transformers decoder model, PagedServe cannot "
                               f"serve it") from e
        self._refuse_what_the_check_saw(name, check, features, hf.num_hidden_layers)
        release_free_memory()  # what loading and preparing the model freed goes back to the OS

    @staticmethod
    def _refuse_what_the_check_saw(name: str, check, features, num_layers: int) -> None:
        """Raises ModelLoadError when the start-up check shows the engine would
        not compute what the model computes: a layer whose attention bypassed
        our paged store, a configured sliding window no layer passed on, or
        logits that differ from the Hugging Face forward's."""
        if check.attention_calls != num_layers:
            raise ModelLoadError(
                f"{name}: one forward pass made {check.attention_calls} calls to the attention function for "
                f"{num_layers} layers (PagedServe needs exactly one per layer): layers that bypass it (recurrent or "
                "custom) or call it more than once would not keep their state in the paged KV cache")
        if features.sliding_window is not None and check.windows == {None}:
            raise ModelLoadError(f"{name}'s config sets a sliding window of {features.sliding_window}, but no "
                                 "layer passed it to the attention function: it cannot be applied exactly")
        if not check.max_abs_diff <= check.tolerance:
            raise ModelLoadError(
                f"{name}: the engine's logits differ from the Hugging Face forward's by {check.max_abs_diff:.3g} "
                f"(allowed {check.tolerance:.3g}) on the start-up check prompt: the architecture does something "
                "the engine does not replicate")
        logger.info("start-up check: %d attention layers through the paged store, logits within %.2g of "
                    "Hugging Face's (allowed %.2g)", check.attention_calls, check.max_abs_diff, check.tolerance)

    def _eos_token_ids(self) -> list[int]:
        ids = set()
        for src in (self.model.generation_config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        return sorted(ids)

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
                grammars = [ReasoningGate(g, self.reasoning_parser, self.token_bytes, ended) for g in grammars]
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns an output for each request that sampled."""
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.requests.values())
        out = self.scheduler.schedule()
        if out.empty:
            return []
        self.num_steps += 1
        now = time.monotonic()
        self.timelines.record_step(self.num_steps, now, out)
        # read each array once: request_ids is converted to a Python list per access
        request_ids, seq_indices = out.request_ids, out.seq_indices.tolist()
        for rid in dict.fromkeys(request_ids):
            req = self.requests[rid]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        inp = _core.ModelInput(out)  # the decision laid out for the forward pass
        # the step's shape, for step-cost models (pagedserve.experiments.step_cost)
        self.last_step_shape = (inp.num_tokens, int(inp.seq_lens.sum()))
        prompt_rows, pool_rows = self._extra_rows(out, inp, request_ids)
        drafts = self.spec_decoder.rows(out, inp) if self.spec_decoder is not None else []
        extra_idx = [i for rows in (prompt_rows, pool_rows) for _, idx, _ in rows for i in idx]
        extra = torch.tensor(extra_idx, dtype=torch.long) if extra_idx else None
        draft_rows = torch.tensor([i for d in drafts for i in d.rows], dtype=torch.long) if drafts else None
        logits, extra_hidden = self.runner.execute(inp, extra, draft_rows)
        self._record_prompt_logprobs(prompt_rows, extra_hidden)
        self._record_pooling(pool_rows, extra_hidden, sum(len(idx) for _, idx, _ in prompt_rows))
        num_sampling = len(inp.logits_indices)
        logits, draft_logits = logits[:num_sampling], logits[num_sampling:]

        rows, slots = [], []  # slots: (request, choice index) of each sampled token, in order
        slot_rows = []  # each slot's row of logits
        for b, k in zip(out.sampling_seq_indices.tolist(), out.num_samples.tolist()):
            req, first = self.requests[request_ids[b]], seq_indices[b]
            choices = [req.choices[first + j] for j in range(k)]
            grammars = [c.grammar for c in choices] if req.params.structured_outputs is not None else None
            rows.append(SamplingRow(req.params, [c.generator for c in choices], req.prompt_token_ids,
                                    [c.output_token_ids for c in choices], grammars))
            slots += [(req.request_id, first + j) for j in range(k)]
            slot_rows += [len(rows) - 1] * k
        sampled = self.sampler(logits, rows)
        logprob_of = {}
        for slot, tok, lp, top in zip(slots, sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
            if lp is not None:
                logprob_of[slot] = Logprob(tok, lp, top or [])
        kept = self._verify_drafts(drafts, draft_logits, slots, sampled.token_ids, logits, slot_rows, logprob_of)
        self.timelines.drafts_kept(kept)

        touched: dict[str, Request] = {}
        num_dropped = 0  # embedding requests' tokens: sampled to end the prefill, not output
        for upd in self.scheduler.update(sampled.token_ids):
            req = self.requests[upd.request_id]
            choice = req.choices[upd.index]
            req.num_cached_tokens = upd.num_cached_tokens
            if req.pooler is not None:  # the prompt is pooled: the request ends here, its token dropped
                if not upd.finished:
                    self.scheduler.finish_sequence(req.request_id, upd.index, _core.FinishReason.STOP)
                choice.finish("stop")
                num_dropped += 1
                touched[req.request_id] = req
                continue
            grammar_ended = choice.grammar is not None and self._advance_grammar(choice, upd.token_id)
            if any(choice.append_token(t, lp) for t, lp in kept.get((req.request_id, upd.index), ())):
                # a stop string ended the output inside the kept drafts: the tokens after it are not output
                self.scheduler.finish_sequence(req.request_id, upd.index, _core.FinishReason.STOP)
                choice.finish("stop", stop_string=True)
            elif choice.append_token(upd.token_id, logprob_of.get((req.request_id, upd.index))):
                self.scheduler.finish_sequence(req.request_id, upd.index, _core.FinishReason.STOP)
                choice.finish("stop", stop_string=True)
            elif upd.finished:
                choice.finish(upd.finish_reason_str)
            elif grammar_ended:  # e.g. ignore_eos: the grammar allows nothing after its end
                self.scheduler.finish_sequence(req.request_id, upd.index, _core.FinishReason.STOP)
                choice.finish("stop")
            touched[req.request_id] = req
        return self._make_outputs(touched.values(),
                                  len(sampled.token_ids) - num_dropped + sum(map(len, kept.values())))

    def _verify_drafts(self, drafts, logits: torch.Tensor, slots: list[tuple[str, int]], sampled_tokens: list[int],
                       sampling_logits: torch.Tensor, slot_rows: list[int], logprob_of: dict
                       ) -> dict[tuple[str, int], list[tuple[int, Logprob | None]]]:
        """Verifies the step's drafts (SpeculativeDecoder.verify) from their
        rows' logits [D, vocab] float32 and puts each sequence's token
        after its kept drafts in its place in sampled_tokens (the list update()
        takes) and, where the request asked for logprobs, that token's Logprob in
        logprob_of (by slot). sampling_logits [S, vocab]: the step's sampling
        rows; slot_rows[i]: the row slot i was sampled from. Returns the kept drafts per (request_id, choice index),
        each with its Logprob (None where the request asked for none)."""
        if not drafts:
            return {}
        where = {slot: i for i, slot in enumerate(slots)}
        live = [i for i, d in enumerate(drafts) if d.request_id in self.requests]
        if len(live) < len(drafts):  # a request ended between schedule() and here: its rows are skipped
            starts = [0, *itertools.accumulate(len(d.rows) for d in drafts)]
            logits = torch.cat([logits[starts[i]:starts[i + 1]] for i in live]) if live else logits[:0]
            drafts = [drafts[i] for i in live]
            if not drafts:
                return {}
        pos = [where[(d.request_id, d.index)] for d in drafts]
        reqs = [self.requests[d.request_id] for d in drafts]
        choices = [r.choices[d.index] for r, d in zip(reqs, drafts)]
        slot_logits = {i: sampling_logits[slot_rows[i]] for i in pos}
        verified = self.spec_decoder.verify(drafts, logits, [sampled_tokens[i] for i in pos], [r.params for r in reqs],
                                            [c.generator for c in choices], [c.grammar for c in choices],
                                            [slot_logits[i] for i in pos])
        kept = {}
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
            r.num_draft_tokens += len(d.drafts)
            r.num_accepted_tokens += len(v.accepted)
        self.metrics.observe_spec_decode(len(drafts), sum(len(d.drafts) for d in drafts),
                                         sum(len(v.accepted) for v in verified))
        return kept

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

    def _extra_rows(self, out, inp, request_ids) -> tuple[list[tuple[Request, list[int], list[int]]],
                                                          list[tuple[Request, list[int], range]]]:
        """The rows whose final hidden states the step needs besides the
        sampling rows: for requests that want prompt logprobs and prefill this
        step, (request, flat-batch indices of the positions to score, the
        prompt tokens they predict); for embedding requests that prefill this
        step, (request, flat-batch indices, the prompt positions they hold).
        Positions already scored or pooled (before a preemption) are skipped."""
        rows, pool = [], []
        qsl = None
        for b, rid in enumerate(request_ids):
            req = self.requests[rid]
            if req.prompt_logprobs is None and req.pooler is None:
                continue
            if qsl is None:
                qsl, computed = inp.query_start_loc.tolist(), out.num_computed_tokens.tolist()
                scheduled = out.num_scheduled_tokens.tolist()
            if req.pooler is not None:
                positions = req.pooler.rows_to_pool(computed[b], scheduled[b])
                if positions:
                    pool.append((req, [qsl[b] + p - computed[b] for p in positions], positions))
                continue
            n_prompt = len(req.prompt_token_ids)
            # position p predicts prompt token p + 1; prompt_logprobs holds 1 + scored positions
            lo = max(computed[b], len(req.prompt_logprobs) - 1)
            hi = min(computed[b] + scheduled[b], n_prompt - 1)
            if hi > lo:
                rows.append((req, [qsl[b] + p - computed[b] for p in range(lo, hi)],
                             req.prompt_token_ids[lo + 1:hi + 1]))
        return rows, pool

    @staticmethod
    def _record_pooling(rows, extra_hidden: torch.Tensor | None, start: int) -> None:
        """Hands each embedding request its rows' hidden states (from extra_hidden
        [E, hidden], after the `start` rows of prompt logprobs)."""
        for req, idx, positions in rows:
            req.pooler.add(extra_hidden[start:start + len(idx)], positions)
            start += len(idx)

    def _record_prompt_logprobs(self, rows, extra_hidden: torch.Tensor | None) -> None:
        """Scores the rows' prompt positions from their hidden states [E, hidden],
        _PROMPT_LOGPROBS_SLICE positions at a time (bounded memory: a 2048-token
        chunk's full logits would be 2048 x vocab floats, 400 MB for SmolLM2)."""
        start = 0
        for req, idx, targets in rows:
            for lo in range(0, len(idx), _PROMPT_LOGPROBS_SLICE):
                hi = min(lo + _PROMPT_LOGPROBS_SLICE, len(idx))
                logits = self.runner.compute_logits(extra_hidden[start + lo:start + hi])
                lps, tops, ranks = compute_prompt_logprobs(logits, torch.tensor(targets[lo:hi], dtype=torch.long),
                                                           req.params.prompt_logprobs)
                req.prompt_logprobs += [Logprob(t, lp, top, rank)
                                        for t, lp, top, rank in zip(targets[lo:hi], lps, tops, ranks)]
            start += len(idx)

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
        for c in req.choices:
            self.metrics.observe_finished(c.finish_reason, len(req.prompt_token_ids), len(c.output_token_ids), e2e)
        if self.spec_decoder is not None:  # in the words of the start-up line "speculative decoding: ..."
            outputs = sum(len(c.output_token_ids) for c in req.choices)
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

    @property
    def prefix_cache_stats(self):
        """pagedserve._core.PrefixCacheStats: queries and hits (tokens), evictions (blocks)."""
        return self.scheduler.prefix_cache_stats
