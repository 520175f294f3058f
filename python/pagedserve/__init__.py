"""PagedServe: an LLM inference runtime with a paged KV cache, continuous
batching and an OpenAI-compatible server."""

from importlib.metadata import PackageNotFoundError, version

from ._core import BlockPool, KVCacheManager, Scheduler, SchedulerConfig  # noqa: F401  (the C++ core's own)
from .config import EngineArgs  # noqa: F401
from .errors import PagedServeError, RequestRejectedError  # noqa: F401
from .sampling_params import SamplingParams  # noqa: F401
from .pooling_params import PoolingParams  # noqa: F401

try:
    __version__ = version("pagedserve")
except PackageNotFoundError:  # run from a source tree without an install
    __version__ = "0.0.0+unknown"


def __getattr__(name):  # LLM pulls in torch + transformers: load it on first use
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "EngineArgs", "SamplingParams", "PoolingParams", "PagedServeError", "RequestRejectedError"]
