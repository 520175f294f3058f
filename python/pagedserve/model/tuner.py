"""The start-up tuner: every timing the engine takes to choose a path, and the
per-machine cache of what it chose (``$PAGEDSERVE_CACHE/<name>.json``).

Two choosers use it: the GEMM-path chooser (pagedserve.model.linear,
``--linear-impl auto``) and the gguf path's row bound (pagedserve.model.
gguf_linear). Both time candidate paths in rounds that alternate them, so a
burst of other load slows one round of each rather than one path, and keep
each path's best round.

A measurement is only cached when it can be trusted (a noisy one decides this
start and is measured again at the next):
  * its rounds agree: for every path and row count the second-best round is
    within ``NOISE_BOUND`` (15%) of the best; the tuner adds rounds (up to
    ``max_rounds``) while they do not;
  * nothing else ran: on Linux, the CPU time other processes used while it
    measured (``/proc/stat`` less this process's own ``os.times``) stays under
    ``BUSY_BOUND`` (10%) of one core's wall time.
A cache entry is keyed by, and records, what its numbers hold for: the CPU
(model name, features, the kernels' ISA variant), the thread count, torch's,
oneDNN's and MKL's versions, PagedServe's version, and the chooser's own key
(dtype, shapes).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NOISE_BOUND = 0.15  # second-best round / best round - 1, per path and row count, above which a measurement is noisy
BUSY_BOUND = 0.10  # other processes' CPU time / wall time while measuring, above which the machine was busy

Clock = Callable[[], float]  # seconds, monotonic


def now() -> float:
    """The tuner's clock (time.perf_counter); tests replace it (monkeypatch) or pass ``clock``."""
    return time.perf_counter()


def time_ms(fn: Callable[[], object], min_seconds: float, clock: Clock | None = None) -> float:
    """Best per-call milliseconds of fn() over repeated calls for about
    ``min_seconds`` (after one untimed call: kernel selection, page faults);
    ``clock``: seconds (default now())."""
    clock = clock or now
    fn()
    best, spent = float("inf"), 0.0
    while True:
        t0 = clock()
        fn()
        dt = clock() - t0
        best, spent = min(best, dt), spent + dt
        if spent >= min_seconds:
            return best * 1e3


@torch.inference_mode()
def time_cases(cases, rows, seconds_per_case: float = 0.01, after: Callable[[], object] | None = None,
               clock: Clock | None = None) -> dict[int, float]:
    """Milliseconds one pass over a model's linear layers takes at each row count
    ({rows: ms}). ``cases``: [(module, input [max(rows), in], layers of that
    shape)]; each distinct shape is timed once and counted as often as the model
    has it. ``after``: called after each layer call and timed with it (what a
    step runs between two GEMMs)."""
    def call(mod, x):
        return (lambda: mod(x)) if after is None else (lambda: (mod(x), after()))
    return {r: sum(count * time_ms(call(mod, x[:r]), seconds_per_case, clock) for mod, x, count in cases)
            for r in rows}


def _proc_stat_busy_seconds() -> float | None:
    """CPU seconds all processes have used since boot (user, nice, system, irq,
    softirq, steal: a hypervisor's steal is other load too), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:9]] + [0] * max(0, 8 - len(fields[1:9]))
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class LoadProbe:
    """Measures how much CPU time other processes used over a window
    (``start()`` ... ``share()``), as a share of one core's wall time; 0 where
    /proc/stat is absent. Tests inject their own (``share`` fixed)."""

    def __init__(self) -> None:
        self._t0 = self._busy0 = self._own0 = None

    def start(self) -> None:
        self._t0, self._busy0, self._own0 = time.monotonic(), _proc_stat_busy_seconds(), _own_cpu_seconds()

    def share(self) -> float:
        busy = _proc_stat_busy_seconds()
        if self._busy0 is None or busy is None:
            return 0.0
        wall = max(time.monotonic() - self._t0, 1e-3)
        others = (busy - self._busy0) - (_own_cpu_seconds() - self._own0)
        return max(0.0, others) / wall


@dataclass
class Measurement:
    """What measure() saw.

    Attributes:
        ms: per path, the best round's milliseconds at each row count ({name: {rows: ms}}).
        rounds: rounds run (each times every path once).
        spread: per path, the largest (second-best round / best round - 1) over the row counts.
        busy: other processes' CPU time over the measurement / its wall time (0 where unknown).
        trusted: spread within NOISE_BOUND for every path and busy under BUSY_BOUND: the
            result may be cached.
        why_not: why it is not trusted ("" when it is).
    """

    ms: dict[str, dict[int, float]]
    rounds: int
    spread: dict[str, float]
    busy: float
    trusted: bool
    why_not: str = ""


def measure(cases: dict[str, list], rows, *, rounds: int = 3, max_rounds: int = 6,
            after: Callable[[], object] | None = None, seconds_per_case: float = 0.01,
            clock: Clock | None = None, probe: LoadProbe | None = None,
            noise_bound: float = NOISE_BOUND, busy_bound: float = BUSY_BOUND) -> Measurement:
    """Times each path's ``cases`` (time_cases' form) at ``rows`` in rounds that
    alternate the paths, at least ``rounds`` and, while the rounds disagree by
    more than ``noise_bound``, up to ``max_rounds``. Returns the Measurement
    (best round per path and row count, and whether it may be cached)."""
    probe = probe or LoadProbe()
    probe.start()
    seen: dict[str, dict[int, list[float]]] = {name: {r: [] for r in rows} for name in cases}
    done = 0
    while True:
        for name, path_cases in cases.items():
            got = time_cases(path_cases, rows, seconds_per_case, after, clock)
            for r in rows:
                seen[name][r].append(got[r])
        done += 1
        spread = {name: max(_spread(v) for v in by_rows.values()) for name, by_rows in seen.items()}
        if done >= max_rounds or (done >= rounds and max(spread.values(), default=0.0) <= noise_bound):
            break
    busy = probe.share()
    ms = {name: {r: min(v) for r, v in by_rows.items()} for name, by_rows in seen.items()}
    worst = max(spread, key=spread.get) if spread else None
    if worst is not None and spread[worst] > noise_bound:
        why = (f"its rounds disagree: {worst}'s second-best round is {spread[worst]:.0%} above its best "
               f"after {done} rounds (bound {noise_bound:.0%})")
    elif busy > busy_bound:
        why = f"other processes used {busy:.0%} of a core while it measured (bound {busy_bound:.0%})"
    else:
        why = ""
    return Measurement(ms, done, spread, busy, not why, why)


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return float("inf")
    a, b = sorted(values)[:2]
    return b / a - 1.0 if a > 0 else float("inf")


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Versions of what the timed paths run: torch, oneDNN and MKL (as torch
    reports its build), PagedServe."""
    from importlib.metadata import PackageNotFoundError, version

    config = ""
    try:
        config = torch.__config__.show()
    except Exception:  # noqa: BLE001 - a build without the report only loses the detail
        pass
    onednn = re.search(r"oneDNN v([0-9][^ \n(]*)", config)
    mkl = re.search(r"Math Kernel Library Version ([0-9.]+)", config) or re.search(r"MKL[^\n]*?([0-9]{4}\.[0-9.]+)",
                                                                                   config)
    try:
        ours = version("pagedserve")
    except PackageNotFoundError:
        ours = "unknown"
    return {"torch": torch.__version__, "onednn": onednn.group(1) if onednn else "none",
            "mkl": mkl.group(1) if mkl else "none", "pagedserve": ours}


def machine() -> dict:
    """What a cached measurement holds for: the CPU and its features, the kernel
    ISA variant, the thread count, and library_versions()."""
    from ..kernels import cpu_core
    from ..hardware import cpu_capabilities

    caps = cpu_capabilities()
    model_name = ""
    try:
        with open("/proc/cpuinfo") as f:
            model_name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model_name = platform.processor()
    return {"cpu": model_name, "arch": caps.arch, "features": sorted(caps.features),
            "kernel_isa": cpu_core.kernel_isa(), "threads": torch.get_num_threads(), **library_versions()}


@dataclass
class TunerCache:
    """One chooser's cache file, ``$PAGEDSERVE_CACHE/<name>.json``: {key: entry}.
    A key is a hash of machine() and the chooser's own ``what`` (JSON-able);
    an entry records both, so the file says what each number holds for."""

    name: str
    _machine: dict = field(default_factory=dict, repr=False)

    @property
    def path(self) -> Path:
        from .cache import cache_dir

        return cache_dir() / f"{self.name}.json"

    def key(self, what) -> str:
        if not self._machine:
            self._machine = machine()
        return hashlib.sha256(json.dumps([self._machine, what], sort_keys=True).encode()).hexdigest()[:16]

    def read_all(self) -> dict:
        """The file's entries; a missing, unreadable or malformed file, or an entry
        that is not an object, counts as absent (measured again)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict)}

    def get(self, what) -> dict | None:
        """The entry for ``what`` on this machine, or None."""
        return self.read_all().get(self.key(what))

    def put(self, what, entry: dict, measured: Measurement) -> bool:
        """Stores ``entry`` for ``what`` if ``measured`` is trusted (returns True);
        a noisy measurement is logged and not stored (returns False). A file that
        cannot be written only costs a measurement next time."""
        if not measured.trusted:
            logger.warning("%s: not cached, measured again at the next start: %s", self.name, measured.why_not)
            return False
        data = self.read_all()
        data[self.key(what)] = {**entry, "for": what, "machine": self._machine, "rounds": measured.rounds,
                                "spread": {k: round(v, 4) for k, v in measured.spread.items()},
                                "busy": round(measured.busy, 4), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("could not cache %s in %s: %s", self.name, path, e)
            return False
        return True


__all__ = ["NOISE_BOUND", "BUSY_BOUND", "LoadProbe", "Measurement", "TunerCache", "library_versions", "machine",
           "measure", "time_cases", "time_ms"]
