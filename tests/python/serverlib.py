"""Helpers for the server tests: start `python -m pagedserve.server` as a real
uvicorn process on a free loopback port, read its /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, env: dict | None = None, log: str | None = None,
                 ready_path: str = "/health", command: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts the server with extra CLI args; returns (process, base URL) once
    `ready_path` answers 200. command: what comes before --port and args
    (default: python -m pagedserve.server). Its output goes to the file `log` (a temporary
    file when None; never an unread pipe, which would stall a chatty server),
    and the end of it is in the error when the server dies while starting."""
    port = free_port()
    if log is None:
        log = tempfile.mkstemp(prefix="pagedserve-server-", suffix=".log")[1]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*(command or [sys.executable, "-m", "pagedserve.server"]), "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    proc.log = log
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if (why := exit_report(proc)) is not None:
            raise RuntimeError(f"server died while starting: {why}")
        try:
            if httpx.get(base + ready_path, timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def exit_report(proc: subprocess.Popen) -> str | None:
    """None while a server from start_server runs, else its exit status and the end of its output."""
    if proc.poll() is None:
        return None
    with open(proc.log, errors="replace") as f:
        return f"exit status {proc.returncode}; the end of its output:\n" + "".join(f.readlines()[-60:])


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def metrics(base: str) -> dict[str, float]:
    """GET /metrics parsed with prometheus_client: {'name{label=value,...}': value},
    model_name label left out of the key."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(base: str, timeout: float = 5.0) -> dict[str, float]:
    """Polls /metrics until no request runs or waits (or timeout); returns the metrics."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.05)
