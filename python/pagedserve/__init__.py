"""PagedServe: an LLM inference runtime with a paged KV cache, continuous
batching and an OpenAI-compatible server."""

from ._core import BlockPool, KVCacheManager, Scheduler, SchedulerConfig  # noqa: F401
from .errors import PagedServeError, RequestRejectedError  # noqa: F401
from .sampling_params import SamplingParams  # noqa: F401


def __getattr__(name):  # LLM pulls in torch + transformers: load it on first use
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "PagedServeError", "RequestRejectedError"]
