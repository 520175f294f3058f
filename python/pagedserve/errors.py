"""Errors PagedServe raises. The C++ core's typed exceptions are mapped by
pybind11 to the classes re-exported here (same names on both sides)."""

from ._core import (  # noqa: F401
    BlockPoolError,
    KernelArgumentError,
    OutOfBlocksError,
    PagedServeError,
    RequestRejectedError,
    UnknownRequestError,
)
