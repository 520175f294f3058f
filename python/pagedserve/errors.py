"""Errors PagedServe raises. Every one is a ``PagedServeError`` and, where a
builtin fits, also that builtin (``except ValueError`` keeps working).

The C++ core's typed exceptions arrive as the classes re-exported here (same
names on both sides, created in csrc/bindings.cc); the Python-side ones are
defined below.
"""

from ._core import (  # noqa: F401
    BlockPoolError,  # PagedServeError: a block id out of range, freed twice, used after free
    InvalidArgumentError,  # PagedServeError, ValueError: a broken precondition
    KernelArgumentError,  # PagedServeError, ValueError: a kernel argument's shape, dtype, layout or index
    OutOfBlocksError,  # PagedServeError: no free KV block left
    PagedServeError,  # Exception: the base of all
    RequestRejectedError,  # PagedServeError, ValueError: a request that can never be served
    UnknownRequestError,  # PagedServeError, KeyError: an id the core does not hold
)


class ModelLoadError(PagedServeError, ValueError):
    """A checkpoint that does not match its model (missing, unexpected or
    mis-shaped tensors), or a model whose attention the backends cannot serve."""


class BackendUnavailableError(PagedServeError, ValueError):
    """An attention backend that is unknown, not built, or cannot run here
    (for this device, dtype or CPU); the message says why."""


class InvalidStructuredOutputError(PagedServeError, ValueError):
    """A JSON schema, regular expression, choice list or grammar that cannot be
    compiled into a grammar. ``kind`` names the StructuredOutputsParams field
    ("json", "regex", "choice", "grammar", "json_object")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UnenforceableConstraintError(PagedServeError, ValueError):
    """A structured-output constraint combined with a sampling field that the
    grammar's mask could not honour at the same time (the grammar decides
    which tokens come and where the output ends): refused rather than served
    without one of them. ``param`` names that field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
