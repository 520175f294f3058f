"""Where PagedServe keeps what it derives from a model file, and the key it
files it under: ``$PAGEDSERVE_CACHE`` (default ``~/.cache/pagedserve``) and a
GGUF file's content fingerprint. A leaf module (no import of the loader), so
the packaged models, the GGUF index and the tuner can all use it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """Folder where derived files are kept (``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``)."""
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def gguf_fingerprint(path: Path, edge_bytes: int = 4 << 20) -> str:
    """Short content key of a GGUF file: SHA-256 (hashlib) of its size and its first
    and last edge_bytes bytes, so the same model installed in another virtual
    environment reuses what was derived from it, and a changed file does not."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(edge_bytes))
        f.seek(max(0, size - edge_bytes))
        h.update(f.read(edge_bytes))
    return h.hexdigest()[:12]


def publish_folder(tmp: Path, out: Path) -> Path:
    """Moves the finished folder ``tmp`` to ``out`` atomically (os.replace);
    where another process (a second server, a parallel test worker) published
    ``out`` first, drops ``tmp`` and keeps theirs. Returns ``out``. Raises
    OSError when the move fails and no ``out/config.json`` exists."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


__all__ = ["cache_dir", "gguf_fingerprint", "publish_folder"]
