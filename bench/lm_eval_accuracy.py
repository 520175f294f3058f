"""lm-evaluation-harness against PagedServe servers, one configuration at a
time: each server is started, the multiple-choice task of
tests/data/lm_eval_tiny_mc.jsonl (or --data) is run through lm_eval's
local-completions model (pagedserve.bench.lm_eval_task), the server is
stopped; then every configuration's accuracy is printed side by side, with how
far each choice's log-likelihood moved from the first configuration's.

    python bench/lm_eval_accuracy.py [--config "--dtype float32" --config "--quantization q4"] [--data FILE]

A --config is the server's own command-line flags (default: float32 and
q4). A checkout-only script (not under ``pagedserve bench``). lm_eval comes
with the `bench` (and `test`) extra.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedserve.bench.lm_eval_task import run_lm_eval

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_evaluate(flags: list[str], data: Path, workdir: Path):
    """Starts `python -m pagedserve.server FLAGS` on a loopback port, runs the
    task, stops the server. Returns (model id, EvalRun). Raises RuntimeError if
    the server does not come up within 300 s."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(workdir / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.server", "--port", str(port), "--log-level",
                             "warning", *flags], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server {flags} did not start: see {workdir / 'server.log'}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        return model, run_lm_eval(base, model, data, workdir)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def loglikelihoods(run) -> list[float]:
    return [float(r[0][0]) for s in run.samples for r in s["resps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", help="server flags, e.g. \"--quantization q4\"")
    ap.add_argument("--data", type=Path, default=ROOT / "tests" / "data" / "lm_eval_tiny_mc.jsonl")
    args = ap.parse_args()
    configs = args.config or ["--dtype float32", "--quantization q4"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            t = time.perf_counter()
            model, run = serve_and_evaluate(shlex.split(config), args.data, workdir)
            runs.append(run)
            print(f"{config!r}: {model}, {len(run.samples)} questions, lm_eval {time.perf_counter() - t:.1f} s "
                  "(server start included)", flush=True)
    base = loglikelihoods(runs[0])
    print(f"\n{'server flags':<32} {'acc':>6} {'median |dLL|':>13} {'max |dLL|':>10}")
    for config, run in zip(configs, runs):
        diffs = [abs(a - b) for a, b in zip(loglikelihoods(run), base)]
        print(f"{config:<32} {run.accuracy:>6.3f} {statistics.median(diffs):>13.4f} {max(diffs):>10.4f}")
    print(f"(|dLL|: per choice, the log-likelihood's distance from {configs[0]!r}'s)")


if __name__ == "__main__":
    main()
