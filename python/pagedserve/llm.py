"""LLM: offline batch generation (vLLM's ``LLM`` entry point)."""

from __future__ import annotations

from tqdm import tqdm

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .engine.llm_engine import LLMEngine
from .engine.outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Generates completions for many prompts at once through the paged engine.

    Args:
        model: hub id, local folder, .gguf file, or None for the default
            SmolLM2-135M-Instruct.
        dtype: "float32" or "bfloat16".
        block_size, num_kv_blocks, kv_cache_memory, enable_prefix_caching: see CacheConfig.
        max_num_seqs, max_num_batched_tokens: see SchedulerConfig.
        max_model_len, skip_tokenizer_init, onednn_linear: see ModelConfig.
        attention_backend: see pagedserve.kernels.get_backend.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "float32", block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int = 1 << 30,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, skip_tokenizer_init: bool = False,
                 attention_backend: str | None = None, onednn_linear: bool = True,
                 enable_prefix_caching: bool = True) -> None:
        self.engine = LLMEngine(EngineConfig(
            model=ModelConfig(model, dtype, max_model_len, None, skip_tokenizer_init, onednn_linear),
            cache=CacheConfig(block_size, num_kv_blocks, kv_cache_memory, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            attention_backend=attention_backend))

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; returns the final outputs in prompt order.

        Args:
            prompts: a string, a list of strings, or a list of token-id lists.
            sampling_params: one for all prompts, or one per prompt.
        Raises:
            ValueError if a prompt can never be served (nothing is queued then).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            bar.update()
        except BaseException:  # an error or Ctrl-C: leave nothing behind for the next call
            self.engine.abort_all()
            raise
        return [final[rid] for rid in ids]
