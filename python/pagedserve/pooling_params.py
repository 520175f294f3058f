"""PoolingParams: how an embedding request turns the model's final hidden
states into one vector (vLLM's PoolingParams and pooler config)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's pooling.

    The engine runs the prompt as a prefill-only request: the final hidden
    states (after the model's last norm, [prompt tokens, hidden_size] in the
    model's dtype) are pooled into one float32 vector [hidden_size], the token
    the step samples after the prompt is dropped, and the request ends with
    that step, its KV blocks freed (full blocks stay in the prefix cache).

    Attributes:
        pooling_type: "last" = the hidden state of the prompt's last token
            (decoder-only embedding models such as E5-Mistral and Qwen3-Embedding
            train for it; a prefix-cache hit skips every other token's compute);
            "mean" = the mean over every prompt token (needs all of them
            computed, so the request reads no prefix-cache blocks, as prompt
            logprobs do; it accumulates in float64).
        normalize: divide the pooled vector by its L2 norm (OpenAI's
            embeddings are unit vectors; cosine similarity is then a dot product).
    Raises:
        ValueError from __post_init__ for a pooling_type not in POOLING_TYPES.
    """

    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
