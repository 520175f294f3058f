"""Server behaviour around the requests: --api-key, the request body size
limit, and SIGTERM (stop accepting, let running requests finish, abort the
rest cleanly before the graceful-shutdown timeout, exit 0). Own server process:
the shutdown test ends it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from serverlib import MODEL, start_server, stop_server

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def keyed_server(smollm2_dir):
    proc, base = start_server("--dtype", "float32", "--max-model-len", "2048", "--log-level", "warning", "--max-request-body-size",
                              "64KiB", "--timeout-graceful-shutdown", "4", env={"PAGEDSERVE_API_KEY": KEY})
    yield proc, base
    if proc.poll() is None:
        stop_server(proc)


def test_api_key_guards_v1_only(keyed_server):
    _, base = keyed_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(base + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(base + path).status_code == 200


def test_oversized_body_is_413_and_server_keeps_serving(keyed_server):
    _, base = keyed_server
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x " * 40000}, headers=auth)
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]
    chunked = httpx.post(base + "/v1/completions", headers=auth, content=iter([b"{" + b" " * 70000, b"}"]))
    assert chunked.status_code == 413
    assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      headers=auth).status_code == 200


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(keyed_server):
    proc, base = keyed_server
    auth = {"Authorization": f"Bearer {KEY}"}
    results = {}

    def short():
        results["short"] = httpx.post(base + "/v1/completions", headers=auth, timeout=60, json={
            "model": MODEL, "prompt": "Tell me a story", "max_tokens": 12, "ignore_eos": True}).json()

    def long():
        with httpx.stream("POST", base + "/v1/completions", headers=auth, timeout=60, json={
                "model": MODEL, "prompt": "Tell me a long story", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}) as r:
            results["long"] = b"".join(r.iter_bytes())

    threads = [threading.Thread(target=f) for f in (short, long)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # both admitted and decoding
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    assert proc.wait(timeout=30) == 0
    waited = time.time() - start
    for t in threads:
        t.join(timeout=10)
    assert results["short"]["choices"][0]["finish_reason"] == "length"  # ran to its end
    assert results["short"]["usage"]["completion_tokens"] == 12
    events = results["long"].split(b"\n\n")
    assert results["long"].endswith(b"data: [DONE]\n\n")  # a well-formed end, not a cut connection
    last = json.loads(events[-3][6:])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert waited < 4 + 10
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)
