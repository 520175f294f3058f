"""What ``--model`` names, resolved once: a ``ModelSource``.

``--model`` takes a packaged model's short name (pagedserve.model.packaged;
none: the default), a ``.gguf`` file, a local Hugging Face folder or a hub id.
``resolve_source`` turns it into one of three kinds of source, and everything
after start-up asks the source (never ``--model`` again):

  gguf    a GGUF file, read in place (model/gguf_load.py): the config and
          the tokenizer come from its metadata (transformers builds both
          without weights), kept as a few small files under the cache
          (``metadata_dir``: its reading of the metadata takes seconds),
          and its tensors go straight into the layers that read them.
  folder  a Hugging Face folder (config.json, safetensors, tokenizer).
  hub     a hub id, left to transformers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_dir, publish_folder
from .packaged import DEFAULT_MODEL, PACKAGED_MODELS

logger = logging.getLogger(__name__)

# raised when what metadata_dir writes changes, so an older folder is made again
METADATA_FORMAT = 2


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, tokenizer and weights come from.

    Attributes:
        kind: "gguf", "folder" or "hub".
        path: the GGUF file, the folder (both absolute), or the hub id.
        name: the name the server reports (``/v1/models``).
    """

    kind: str
    path: str
    name: str

    @property
    def gguf(self) -> Path | None:
        """The GGUF file, or None for a folder or hub id."""
        return Path(self.path) if self.kind == "gguf" else None

    def config_path(self) -> str:
        """What ``AutoConfig`` / ``AutoTokenizer.from_pretrained`` take for this
        source: the metadata folder of a GGUF (metadata_dir), else the folder
        or hub id itself."""
        return str(metadata_dir(self.gguf)) if self.kind == "gguf" else self.path


def resolve_source(model: str | None) -> ModelSource:
    """Maps ``--model`` to its source.

    None -> the default packaged model; a packaged model's short name (unless
    a folder of that name exists) -> its GGUF file; a path ending in ``.gguf``
    (any case), or a file that starts with GGUF's magic, -> that file; a
    folder -> itself; anything else -> a hub id.
    Raises FileNotFoundError naming the ``pip install`` line when a packaged
    model's package is missing, and when a ``.gguf`` path does not exist.
    """
    if model is None or (model in PACKAGED_MODELS and not Path(model).is_dir()):
        packaged = PACKAGED_MODELS[model or DEFAULT_MODEL]
        return ModelSource("gguf", str(packaged.locate()), packaged.served_name)
    from .gguf_format import is_gguf

    if model.lower().endswith(".gguf") or (Path(model).is_file() and is_gguf(Path(model))):
        if not Path(model).is_file():
            raise FileNotFoundError(f"no GGUF file at {model}")
        return ModelSource("gguf", str(Path(model).resolve()), Path(model).stem)
    if Path(model).is_dir():
        return ModelSource("folder", str(Path(model).resolve()), model.rstrip("/"))
    return ModelSource("hub", model, model)


@contextlib.contextmanager
def _metadata_read_once():
    """Within the block, transformers' GGUF metadata reader
    (``load_gguf_checkpoint(path, return_tensors=False)``, which parses every
    field: ~5 s for Qwen2.5's 151k-entry vocabulary) reads each file once:
    AutoConfig and AutoTokenizer each call it for the config (transformers
    5.x, for the architectures its faster reader does not cover yet). The
    same function's result, kept for the block only; calls with tensors pass
    through. That one read maps the file as a plain read-only array instead of
    a numpy.memmap (_PlainMapNumpy): gguf-py's reader takes one view of it per
    field part (910k for Qwen2.5), and the memmap subclass's per-view cost made
    the read 9.5 s where the plain array takes 6.4 s (Qwen2.5-Coder-1.5B, 2-core
    EPYC): the same bytes, read-only either way."""
    import gguf.gguf_reader as gguf_reader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, results = gguf_utils.load_gguf_checkpoint, {}

    def once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original(path, return_tensors=return_tensors, **kwargs)
        key = str(path)
        if key not in results:
            numpy_module = gguf_reader.np
            gguf_reader.np = _PlainMapNumpy(numpy_module)
            try:
                results[key] = original(path, return_tensors=False)
            finally:
                gguf_reader.np = numpy_module
        return copy.deepcopy(results[key])

    gguf_utils.load_gguf_checkpoint = once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


class _PlainMapNumpy:
    """numpy, except that memmap(path, mode="r") gives the mapping as a plain
    read-only ndarray (the same pages; no memmap subclass on every view): what
    _metadata_read_once hands gguf-py's reader module for one metadata read.
    Other modes are numpy's own."""

    def __init__(self, numpy_module) -> None:
        self._np = numpy_module

    def __getattr__(self, name: str):
        return getattr(self._np, name)

    def memmap(self, *args, **kwargs):
        mapped = self._np.memmap(*args, **kwargs)
        if mapped.mode != "r":
            return mapped
        return mapped.view(self._np.ndarray)


def metadata_dir(gguf: Path) -> Path:
    """A folder holding the config (config.json, generation_config.json) and
    the tokenizer (tokenizer.json, its config, the chat template) that
    transformers builds from ``gguf``'s metadata, without its weights. Made
    once under ``$PAGEDSERVE_CACHE/gguf-meta/``, a few MB, named by the file's
    stem and the SHA-256 of its whole header (gguf_format.read_tensor_index:
    metadata edited in place, such as a new EOS id, makes a new folder), and
    published atomically (cache.publish_folder). A folder missing a file its
    manifest lists (MANIFEST) is made again. Raises ModelLoadError when
    transformers cannot build the config or the tokenizer from the metadata."""
    from .gguf_format import read_tensor_index

    header = read_tensor_index(gguf)["header_sha256"][:16]
    out = cache_dir() / "gguf-meta" / f"{gguf.stem}-{header}-v{METADATA_FORMAT}"
    if _complete(out):
        return out
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ..errors import ModelLoadError

    logger.info("reading %s's metadata (config and tokenizer) into %s (once)", gguf.name, out)
    folder, name = str(gguf.parent), gguf.name
    try:
        with _metadata_read_once():
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (KeyError, ValueError, TypeError, OSError, AssertionError) as e:
        raise ModelLoadError(f"transformers cannot build the config and tokenizer from {gguf.name}'s metadata "
                             f"({type(e).__name__}: {e})") from e
    if hasattr(config, "quantization_config"):  # the weights are read in place, not by transformers' GGUF reader
        delattr(config, "quantization_config")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / MANIFEST).write_text(json.dumps({p: (tmp / p).stat().st_size for p in files}))
    if out.exists() and not _complete(out):  # a damaged folder: replaced
        shutil.rmtree(out, ignore_errors=True)
    return publish_folder(tmp, out)


MANIFEST = "pagedserve-manifest.json"  # {file name: bytes} of what metadata_dir wrote, written last


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds every file its manifest lists, at its size."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())
        return all((folder / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, TypeError, AttributeError):
        return False


__all__ = ["METADATA_FORMAT", "ModelSource", "metadata_dir", "resolve_source"]
