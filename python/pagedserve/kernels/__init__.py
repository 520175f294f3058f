"""Attention backends. Each implements DESIGN.md section 4's contract:
``reshape_and_cache`` and ``paged_attention``. ``get_backend`` is the one
selection point."""

from __future__ import annotations

from types import ModuleType

from . import torch_ref

BACKENDS = ("torch",)


def get_backend(name: str | None = None) -> ModuleType:
    """Returns the attention backend module for ``name`` (None -> the default on this machine).

    Raises ValueError for an unknown or unavailable backend.
    """
    name = name or "torch"
    if name == "torch":
        return torch_ref
    raise ValueError(f"unknown attention backend '{name}', choose from {BACKENDS}")
