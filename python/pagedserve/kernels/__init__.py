"""Attention backends. Each implements DESIGN.md section 4's contract:
``reshape_and_cache`` and ``paged_attention``. ``get_backend`` is the one
selection point; tests run every available backend against ``torch``."""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("cpu", "torch")


def get_backend(name: str | None = None) -> ModuleType:
    """Returns the attention backend module for ``name``.

    None -> the default on this machine: ``cpu`` (the C++ kernel). ``torch`` is
    the PyTorch reference. Raises ValueError for an unknown backend.
    """
    name = name or "cpu"
    if name == "cpu":
        from . import cpu

        return cpu
    if name == "torch":
        from . import torch_ref

        return torch_ref
    raise ValueError(f"unknown attention backend '{name}', choose from {BACKENDS}")
