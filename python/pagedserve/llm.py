"""LLM: offline batch generation (vLLM's ``LLM`` entry point)."""

from __future__ import annotations

from tqdm import tqdm

from .config import EngineArgs
from .engine.llm_engine import LLMEngine
from .engine.outputs import PoolingRequestOutput, RequestOutput
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams


class LLM:
    """Generates completions for many prompts at once through the paged engine.

    Takes keyword arguments only, the fields of pagedserve.config.EngineArgs
    (model, dtype, device, block_size, num_kv_blocks, kv_cache_memory,
    enable_prefix_caching, max_num_seqs, max_num_batched_tokens, max_model_len,
    attention_backend, linear_impl (``quantization="q4"`` is vLLM's spelling of linear_impl="q4"), model_impl, skip_tokenizer_init, served_model_name,
    chat_template),
    with the same defaults as the server's flags. ``LLM()`` serves the default
    SmolLM2-135M-Instruct.

    Raises:
        TypeError for an unknown or positional argument; whatever LLMEngine raises.
    """

    def __init__(self, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(**kwargs))

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; returns the final outputs in prompt order.

        Args:
            prompts: a string, a list of strings, or a list of token-id lists.
            sampling_params: one for all prompts, or one per prompt.
            priority: one for all prompts or one per prompt (lower first; needs
                scheduling_policy="priority" unless every value is 0), as vLLM's
                LLM.generate(priority=...).
        Raises:
            ValueError if a prompt can never be served (nothing is queued then);
            TypeError / ValueError for a priority that is not an int32.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [
            0 if priority is None else priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        return self._run(prompts, params, priorities, "generating", use_tqdm)

    def embed(self, prompts: str | list[str] | list[list[int]], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Embeds every prompt (vLLM's LLM.embed): each runs as a prefill-only
        request through the same scheduler as generation, and its final hidden
        states are pooled into one float32 vector [hidden_size]
        (PoolingRequestOutput.embedding; engine/pooling.py).

        Args:
            prompts: a string, a list of strings, or a list of token-id lists.
            pooling_params: pooling_type and normalize; None = the engine's
                embedding_pooling, normalized.
        Raises:
            ValueError if a prompt can never be served (empty, or not leaving one
            token of max_model_len free); nothing is queued then.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams(self.engine.args.embedding_pooling)
        return self._run(prompts, [params] * len(prompts), [0] * len(prompts), "embedding", use_tqdm)

    def _run(self, prompts, params, priorities, desc: str, use_tqdm: bool) -> list:
        """Queues every prompt (all or none), steps the engine until each has
        finished; returns the final outputs in prompt order."""
        ids = []
        try:
            for p, sp, prio in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(p, sp, priority=prio))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final = {}
        try:
            with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            bar.update()
        except BaseException:  # an error or Ctrl-C: leave nothing behind for the next call
            self.engine.abort_all()
            raise
        return [final[rid] for rid in ids]
