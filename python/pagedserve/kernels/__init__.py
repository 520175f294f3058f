"""Attention backends and their registry.

Each backend is a subclass of ``pagedserve.kernels.backend.AttentionBackend``,
named here by "module:Class" and imported only when asked for. The CLI's
``--attention-backend`` choices, the tests' parity suite and the benchmarks
all enumerate this registry: adding a backend means its folder (C++ under
csrc/backends/<name>/ with its CMake option, Python here), and one line below.
``auto`` picks the available backend with the highest priority for the
device, dtype and model.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from ..errors import BackendUnavailableError
from ..mkl_vml import warm_up_mkl_vml
from .backend import AttentionBackend, AttentionFeatures, Availability

# Every torch path of the engine (model runner, attention backends) imports
# this registry before its first step: settle oneMKL's lazy VML dispatch (see
# pagedserve.mkl_vml) before any multi-threaded float op.
warm_up_mkl_vml()

_REGISTRY: dict[str, str | type[AttentionBackend]] = {
    "cpu": "pagedserve.kernels.cpu:CpuAttentionBackend",
    "torch": "pagedserve.kernels.torch_ref:TorchAttentionBackend",
    "metal": "pagedserve.kernels.metal:MetalAttentionBackend",
}


def register_backend(name: str, backend: str | type[AttentionBackend]) -> None:
    """Adds (or replaces) a registry entry: an AttentionBackend subclass, or
    "module:Class" imported (and checked) on first use. Raises ValueError for a
    reserved or empty name or an entry of another kind."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a backend needs a non-empty name other than 'auto', got {name!r}")
    if isinstance(backend, str):
        if backend.count(":") != 1 or not all(backend.split(":")):
            raise ValueError(f"a backend entry must be 'module:Class', got {backend!r}")
    else:
        _check_class(name, backend)
    _REGISTRY[name] = backend


def _check_class(name: str, cls) -> type[AttentionBackend]:
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise ValueError(f"attention backend '{name}' is {cls!r}, not an AttentionBackend subclass")
    if inspect.isabstract(cls):
        raise ValueError(f"attention backend '{name}' ({cls.__name__}) does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls


def backend_names() -> list[str]:
    """Every registered backend name, available here or not."""
    return list(_REGISTRY)


def get_backend_class(name: str) -> type[AttentionBackend]:
    """The class registered under ``name``. Raises BackendUnavailableError
    (a ValueError) for an unknown name or one whose module cannot be imported."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise BackendUnavailableError(f"unknown attention backend '{name}', choose from {backend_names()} or 'auto'")
    if isinstance(entry, str):
        module, _, cls_name = entry.partition(":")
        try:  # a backend whose native library fails to load says so, whatever it raises
            entry = getattr(importlib.import_module(module), cls_name)
        except Exception as e:
            raise BackendUnavailableError(f"attention backend '{name}' cannot be loaded: {e}") from e
    try:
        return _check_class(name, entry)
    except ValueError as e:
        raise BackendUnavailableError(str(e)) from e


def why_not(cls: type[AttentionBackend], device: torch.device | str, dtype: torch.dtype | None = None,
            features: AttentionFeatures | None = None) -> str | None:
    """Why backend ``cls`` cannot serve this device / dtype / model, or None if it can."""
    avail: Availability = cls.availability()
    if not avail.available:
        return avail.reason
    dev = torch.device(device).type
    if dev not in cls.devices:
        return f"it runs on {', '.join(cls.devices)}, not {dev}"
    if dtype is not None and dtype not in cls.dtypes:
        return f"it supports {', '.join(str(d).removeprefix('torch.') for d in cls.dtypes)}, not {dtype}"
    missing = cls.unsupported_features(features) if features is not None else []
    if missing:
        return f"the model needs {', '.join(missing)}, which it does not implement"
    return None


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on ``device`` here, best first."""
    ok = []
    for name in backend_names():
        try:
            cls = get_backend_class(name)
        except BackendUnavailableError:
            continue
        if why_not(cls, device) is None:
            ok.append((cls.priority, name))
    return [name for _, name in sorted(ok, key=lambda p: -p[0])]


def resolve_backend(name: str | None = "auto", device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None,
                    features: AttentionFeatures | None = None) -> type[AttentionBackend]:
    """The backend class to use: ``name``, or for "auto"/None the available one
    with the highest priority that serves device, dtype and features.

    Raises:
        BackendUnavailableError (a ValueError) naming the reason when the named
        backend cannot serve them, or when none can.
    """
    if name in (None, "auto"):
        reasons = []
        candidates = []
        for n in backend_names():
            try:
                cls = get_backend_class(n)
            except BackendUnavailableError as e:
                reasons.append(str(e))
                continue
            why = why_not(cls, device, dtype, features)
            if why is None:
                candidates.append(cls)
            else:
                reasons.append(f"{n}: {why}")
        if not candidates:
            raise BackendUnavailableError("no attention backend can serve this model here: " + "; ".join(reasons))
        return max(candidates, key=lambda c: c.priority)
    cls = get_backend_class(name)
    why = why_not(cls, device, dtype, features)
    if why is not None:
        raise BackendUnavailableError(f"attention backend '{name}' cannot be used: {why}")
    return cls


__all__ = ["AttentionBackend", "available_backends", "backend_names", "get_backend_class", "register_backend",
           "resolve_backend", "why_not"]
