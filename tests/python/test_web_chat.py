"""The web chat page at / in a real headless Chromium (Debian's `chromium`
package, driven by Playwright for Python): a streamed multi-turn chat, Stop
(the server aborts the request and frees it), API errors shown in the page, and
the API-key prompt of a server run with --api-key.

Screenshots are saved into $PAGEDSERVE_TEST_ARTIFACTS (default tests/artifacts/)."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from serverlib import MODEL, metrics, start_server, stop_server

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed "
                                                             "(it is in the `test` extra: pip install '.[test]')")
CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no `chromium` executable (Debian: apt-get install chromium; `make test` installs it as root)",
                allow_module_level=True)

expect = sync_api.expect
ARTIFACTS = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS") or Path(__file__).parents[1] / "artifacts")
API_KEY = "web-chat-test-key"
STREAM_TIMEOUT_MS = 60_000  # a short answer on a busy 2-core machine


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page (own sessionStorage); fails the test on any uncaught JavaScript error."""
    context = browser.new_context(viewport={"width": 1100, "height": 700})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture(scope="module")
def keyed_server(smollm2_dir):
    """Base URL of a second server that needs `Authorization: Bearer API_KEY` on /v1/*."""
    proc, base = start_server("--dtype", "float32", "--max-model-len", "512", "--api-key", API_KEY,
                              "--log-level", "warning")
    yield base
    stop_server(proc)


def screenshot(page, name: str) -> None:
    """Saves the page as ARTIFACTS/<name>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / f"{name}.png")


def settings(page, **values: str) -> None:
    """Fills the page's sampling settings, e.g. settings(page, temperature="0")."""
    for field, value in values.items():
        page.fill("#" + field.replace("_", "-"), value)


def send(page, text: str) -> dict:
    """Types `text`, sends it with Enter; returns the JSON body the page POSTed."""
    page.fill("#prompt", text)
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#prompt", "Enter")
    return json.loads(request.value.post_data)


def wait_running(base: str, count: int, timeout: float) -> float:
    """Polls /metrics until vllm:num_requests_running == count; returns the seconds waited."""
    start = time.monotonic()
    while metrics(base)["vllm:num_requests_running"] != count:
        assert time.monotonic() - start < timeout, f"vllm:num_requests_running did not become {count} in {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_chat_streams_answers_and_stop_frees_the_request(page, server):
    page.goto(server + "/")
    expect(page.locator("#model")).to_have_text(MODEL)
    expect(page.locator("#stat-running")).to_have_text("0")

    settings(page, temperature="0", max_tokens="40")
    body = send(page, "What is the capital of France?")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL and body["temperature"] == 0 and body["max_tokens"] == 40
    answer = page.locator(".message.assistant").last
    expect(answer).to_contain_text("Paris", timeout=STREAM_TIMEOUT_MS)
    expect(page.locator("#status")).to_have_text("Done", timeout=STREAM_TIMEOUT_MS)
    assert answer.evaluate("element => element.children.length") == 0  # the model's text is text, not HTML
    expect(page.locator("#stat-ttft")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#stat-tps")).to_have_text(re.compile(r"^\d+\.\d$"))
    expect(page.locator("#stat-cached")).to_have_text(re.compile(r"^\d+ of \d+$"))
    expect(page.locator("#stat-kv")).to_have_text(re.compile(r"^\d+\.\d %$"))
    expect(page.locator("#stat-running")).to_have_text("0", timeout=5_000)
    screenshot(page, "web_chat_answer")

    # The second turn carries the first, then is stopped while it streams.
    settings(page, max_tokens="1000")
    body = send(page, "Write a very long story about a dragon.")
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert "Paris" in body["messages"][1]["content"] and body["max_tokens"] == 1000
    story = page.locator(".message.assistant").last
    expect(story).to_have_text(re.compile(r"\S+(\s+\S+){5}"), timeout=STREAM_TIMEOUT_MS)  # a few words streamed
    expect(page.locator("#stat-running")).to_have_text("1", timeout=5_000)  # the live panel polls /metrics
    assert metrics(server)["vllm:num_requests_running"] == 1
    page.click("#stop")
    expect(page.locator("#status")).to_have_text("Stopped")
    expect(story).to_have_class(re.compile(r"\bstopped\b"))
    expect(page.locator("#stat-tps")).to_have_text("–")  # no usage chunk for a stopped answer
    expect(page.locator("#send")).to_be_enabled()
    waited = wait_running(server, 0, timeout=5)
    print(f"num_requests_running back to 0 {waited:.2f} s after Stop")
    expect(page.locator("#stat-running")).to_have_text("0", timeout=5_000)
    screenshot(page, "web_chat_stopped")

    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)


def test_api_errors_are_shown(page, server):
    page.goto(server + "/")
    settings(page, temperature="-1")
    send(page, "Hi")
    expect(page.locator("#error")).to_contain_text("temperature: Input should be greater than or equal to 0")
    expect(page.locator(".message")).to_have_count(0)  # the failed turn is taken back
    screenshot(page, "web_chat_error")


def test_page_asks_for_the_api_key_and_retries(page, keyed_server):
    page.goto(keyed_server + "/")
    key_form = page.locator("#key-form")
    expect(key_form).to_be_visible()  # GET /v1/models answered 401
    expect(page.locator("#key-message")).to_contain_text("didn't provide an API key")

    settings(page, temperature="0", max_tokens="40")
    send(page, "What is the capital of France?")  # 401 too: sent again once a key is entered
    page.fill("#api-key", "not-the-key")
    page.click("#key-form button")
    expect(page.locator("#key-message")).to_contain_text("Incorrect API key")
    expect(key_form).to_be_visible()
    screenshot(page, "web_chat_api_key")

    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    expect(key_form).to_be_hidden()
    expect(page.locator(".message.assistant").last).to_contain_text("Paris", timeout=STREAM_TIMEOUT_MS)
    expect(page.locator("#model")).to_have_text(MODEL)
    expect(page.locator(".message.user")).to_have_count(1)
    assert page.evaluate("sessionStorage.getItem('pagedserve.apiKey')") == API_KEY


def _kv(page) -> dict:
    """The KV panel's numbers (the data-* attributes of its canvas, set at each poll)."""
    return page.locator("#kv-map").evaluate("c => Object.fromEntries(Object.entries(c.dataset).map("
                                            "([k, v]) => [k, Number(v)]))")


def _wait_kv(page, what: str, predicate, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kv = _kv(page)
        if kv and predicate(kv):
            return kv
        assert time.monotonic() < deadline, f"the KV panel never showed {what}: last {kv}"
        time.sleep(0.1)


def test_kv_panel_follows_a_stream_its_stop_and_a_prefix_hit(page, server):
    """Issue 31: the KV map panel changes while a long answer streams, shows its
    blocks freed when it is stopped, and shows a prefix hit as shared cells."""
    import threading

    import httpx

    page.goto(server + "/")
    idle = _wait_kv(page, "the pool", lambda kv: kv.get("numBlocks", 0) > 0 and kv["inUse"] == 0)
    expect(page.locator("#kv-summary")).to_contain_text(f"{idle['numBlocks']} blocks x 16 tokens")
    settings(page, temperature="0", max_tokens="1000")
    send(page, "Write a very long story about a dragon.")
    first = _wait_kv(page, "the streaming answer's blocks", lambda kv: kv["inUse"] > 0)
    grown = _wait_kv(page, "the answer's blocks grow", lambda kv: kv["inUse"] > first["inUse"], timeout=60)
    screenshot(page, "kv_panel_streaming")
    page.click("#stop")
    expect(page.locator("#status")).to_have_text("Stopped")
    freed = _wait_kv(page, "the blocks freed", lambda kv: kv["inUse"] == 0 and kv["owners"] == 0)
    assert freed["cached"] >= grown["inUse"] - 1  # its full blocks stay in the prefix cache, evictable

    # two requests with one long prompt: the second reads the first's full blocks, which both then hold
    prompt = "Here is a long shared preamble about the sea and its ships. " * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "ignore_eos": True}
    threads = [threading.Thread(target=httpx.post, args=(server + "/v1/completions",),
                                kwargs={"json": body, "timeout": 120}) for _ in range(2)]
    threads[0].start()
    _wait_kv(page, "the first request", lambda kv: kv["inUse"] > 0)
    threads[1].start()
    shared = _wait_kv(page, "shared cells", lambda kv: kv["shared"] > 0 and kv["owners"] == 2)
    assert shared["shared"] >= 5  # the preamble's full 16-token blocks
    screenshot(page, "kv_panel_prefix_hit")
    for t in threads:
        t.join()
    _wait_kv(page, "the pool idle again", lambda kv: kv["inUse"] == 0)


def test_kv_panel_draws_a_pool_of_100k_blocks(page, tiny_tools_server):
    """The tiny model's default KV memory is 131,072 blocks: the panel draws
    them (one pixel per block on a 240 x 547 canvas) and stays responsive."""
    base, _ = tiny_tools_server
    page.goto(base + "/")
    kv = _wait_kv(page, "the pool", lambda kv: kv.get("numBlocks", 0) >= 100_000)
    timing = page.evaluate("""async () => {
        const { draw } = await import('./static/kvmap.js');
        const m = await (await fetch('v1/kv')).json();
        const canvas = document.createElement('canvas');
        const t0 = performance.now();
        const { cell, perCell } = draw(canvas, m);
        return { ms: performance.now() - t0, cell, perCell, height: canvas.height, n: m.num_blocks };
    }""")
    assert timing["n"] == kv["numBlocks"] and timing["perCell"] == 1 and timing["cell"] == 1
    assert timing["height"] == -(-timing["n"] // 240)
    assert timing["ms"] < 500, timing  # one redraw, on a busy 2-core machine
    print(f"KV map of {timing['n']} blocks drawn in {timing['ms']:.0f} ms")
    screenshot(page, "kv_panel_131072_blocks")
