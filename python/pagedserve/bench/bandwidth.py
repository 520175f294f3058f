"""The memory-bandwidth floor of one user's decode step: the bytes a token
reads from a GGUF file's weights over the read bandwidth measured on this
machine. At one user a decoder's step reads every weight once (the 1.5B's
decode is memory-bound), so no engine can be faster than this floor; the
serving benchmark (``--weights FILE.gguf``) and bench/roofline.py print
against it.
"""
from __future__ import annotations

import math
import os
import time


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size in bytes (Linux sysfs; 32 MiB where it cannot be read)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for d in entries:
        try:
            with open(f"{base}/{d}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


def read_bandwidth(threads: int | None = None, tries: int = 5) -> float:
    """Bytes per second torch reads when it sums a float32 tensor of 8x the
    last-level cache (at least 256 MiB) on `threads` threads (default: every
    core): the best of `tries` passes after one warm-up. Allocates that tensor
    for the call."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        n = max(8 * last_level_cache_bytes(), 256 << 20) // 4
        a = torch.ones(n)
        a.sum()
        best = math.inf
        for _ in range(tries):
            t0 = time.perf_counter()
            a.sum()
            best = min(best, time.perf_counter() - t0)
        return 4 * n / best
    finally:
        torch.set_num_threads(before)


def decode_bytes_per_token(gguf_path: str) -> int:
    """Bytes of a GGUF file's tensors that one decode step reads: every tensor
    as stored, except the token embedding (a step reads one row of it), which
    counts whole when the file has no ``output.weight`` (a tied embedding is
    also the output layer). Raises OSError / ValueError for a file gguf-py
    cannot read."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes and "token_embd.weight" in sizes:
        total -= sizes["token_embd.weight"]
    return total
