"""Engine configuration: model, KV cache and scheduler settings, validated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    """Which model to serve and how.

    Attributes:
        model: hub id, local folder, .gguf file, or None for the default model.
        dtype: "float32" or "bfloat16" (weights, activations and KV cache).
        max_model_len: prompt + output tokens per request; None = the model's
            max_position_embeddings.
        served_model_name: name clients send in "model"; None = the model's name.
        skip_tokenizer_init: load no tokenizer (token-id prompts, no text).
        onednn_linear: run the linear layers through oneDNN on CPU (see
            pagedserve.model.runner.use_onednn_linear).
    """

    model: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = None
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    onednn_linear: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got '{self.dtype}'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class CacheConfig:
    """Paged KV cache size.

    Attributes:
        block_size: tokens per KV block (16 or 32).
        num_kv_blocks: explicit number of blocks; overrides kv_cache_memory.
        kv_cache_memory: bytes for the KV store when num_kv_blocks is None.
        enable_prefix_caching: reuse the K/V of full blocks whose token prefix
            was computed before (chained SHA-256 block hashes, LRU eviction).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (16, 32):
            raise ValueError(f"block_size must be 16 or 32, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass
class SchedulerConfig:
    """Continuous-batching limits (mirrors the C++ SchedulerConfig).

    Attributes:
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: tokens per engine step; prompts longer than
            this are prefilled in chunks (chunked prefill).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class EngineConfig:
    """Everything an LLMEngine needs. attention_backend: see pagedserve.kernels."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str | None = None
