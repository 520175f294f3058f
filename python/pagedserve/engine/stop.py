"""Stop strings: find them in the growing output text, cut the text before
them, and hold back any tail that could still become one (so a streamed client
never sees part of a stop string)."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Tracks one request's output text against its stop strings.

    Args:
        stop: the stop strings (non-empty).
        include_stop_str: keep the stop string that ends the text (vLLM's
            include_stop_str_in_output), else cut the text before it.

    Attributes:
        matched: the stop string that ended the text (the earliest in the
            text; of two starting there, the first in `stop`), or None.
    """

    def __init__(self, stop: list[str], include_stop_str: bool = False):
        self.stop = list(stop)
        self.include_stop_str = include_stop_str
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.matched: str | None = None

    def append(self, delta: str, check: bool = True) -> bool:
        """Adds text; returns True (and truncates self.text before the stop
        string, or after it with include_stop_str) if a stop string appeared
        that ends in this text. check=False only adds it (min_tokens: no stop
        yet)."""
        start = max(0, len(self.text) - self.max_len + 1)
        self.text += delta
        if not self.stop or not check:
            return False
        hits = self._hits(self.text, start)
        if hits:
            i, k = min(hits)
            self.matched = self.stop[k]
            self.text = self.text[: i + (len(self.matched) if self.include_stop_str else 0)]
            return True
        return False

    def would_stop(self, delta: str) -> bool:
        """Whether append(delta) would find a stop string; changes nothing."""
        return bool(self.stop) and bool(self._hits(self.text + delta, max(0, len(self.text) - self.max_len + 1)))

    def _hits(self, text: str, start: int) -> list[tuple[int, int]]:
        """(position, index in self.stop) of each stop string found in text at or after start."""
        return [(i, k) for k, i in enumerate(text.find(s, start) for s in self.stop) if i >= 0]

    def releasable(self) -> int:
        """Length of the prefix of self.text that can be shown: everything but the
        longest tail that is a proper prefix of some stop string."""
        return len(self.text) - held_back(self.text, self.stop)


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of
    markers (0: none): what a stream holds back while it could still become a
    marker (a stop string, a reasoning tag, the opening of tool calls)."""
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0

