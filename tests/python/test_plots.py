"""--plot PATH writes a real PNG figure (matplotlib): the fragmentation experiment
(run with and without --plot: the printed tables must not change) and
bench/attention.py run end to end at tiny sizes; the throughput and prefix-cache
benchmarks' plot() (pagedserve.bench) draw made-up results (their runs need the model)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parents[2] / "bench"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.is_file() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    h, w, channels = matplotlib.image.imread(path).shape
    assert h >= 200 and w >= 300 and channels in (3, 4)


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def load_bench(name: str):
    """The benchmark's module in the package (bench/<name>.py only calls its main())."""
    return importlib.import_module(f"pagedserve.bench.{name}")


def test_fragmentation_plot(tmp_path):
    png = tmp_path / "figs" / "fragmentation.png"  # the parent folder is created
    args = ["-m", "pagedserve.experiments.fragmentation", "--workload", "uniform", "bimodal", "--num-blocks", "256"]
    plain = run(*args)
    assert plain.count("| paged (C++ KVCacheManager) |") == 2, plain  # one table per workload
    assert run(*args, "--plot", str(png)) == plain
    assert_png(png)


def test_attention_plot(tmp_path):
    png = tmp_path / "attention.png"
    args = [str(BENCH / "attention.py"), "--batch", "2", "--heads", "2", "--seq-lens", "32", "64",
            "--repeats", "2", "--methods", "gather", "torch"]
    out = run(*args, "--plot", str(png))
    assert out.count("| 32 |") == 2 and out.count("| 64 |") == 2, out
    assert_png(png)


def test_throughput_and_prefix_cache_plots(tmp_path):
    rows = [("HF generate(), sequential", 40.0, 51.2), ("HF generate(), static batch", 8.0, 256.0),
            ("PagedServe", 5.0, 409.6)]
    throughput = load_bench("throughput")
    assert_png(Path(throughput.plot(rows, str(tmp_path / "throughput.png"), title="made up")))
    assert_png(Path(throughput.plot(rows[1:], str(tmp_path / "no_sequential.png"))))  # --skip-sequential
    results = {"off": ([0.40, 0.42, 0.45, 0.41], 6.1, [], 0), "on": ([0.40, 0.03, 0.04, 0.03], 2.2, [], 3072)}
    assert_png(Path(load_bench("prefix_cache").plot(results, str(tmp_path / "prefix_cache.png"))))
