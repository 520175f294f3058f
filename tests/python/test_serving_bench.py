"""`pagedserve bench serving` (pagedserve/bench/serving.py) against a real
PagedServe server on a tiny random model with SmolLM2's tokenizer: closed loop
sweep, Poisson open loop, side-by-side comparison, the token-count check passing
and failing (the server refuses the requests; the server stops them early), the
--json and --plot outputs, bad flags and an unreachable server; and the pure
helpers (percentiles, the Poisson schedule, the prompts) without a server."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import httpx
import pytest

from pagedserve.bench import serving
from serverlib import free_port, start_server, stop_server

MAX_MODEL_LEN = 128
SMALL = ["--num-requests", "6", "--input-len", "16", "--output-len", "8", "--warmup", "1"]


@pytest.fixture(scope="module")
def bench_server(smollm2_dir, tmp_path_factory):
    """Base URL (…/v1) of a server on a 2-layer random Llama with SmolLM2's tokenizer, max_model_len 128."""
    from conftest import make_tiny_chat_model

    model = make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_chat_llama"), MAX_MODEL_LEN)
    proc, base = start_server("--model", model, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                              "--log-level", "warning", ready_path="/v1/models")
    yield base + "/v1"
    stop_server(proc)


def run_main(argv: list[str]) -> int:
    """serving.main(argv) in this process; its exit status (0 when it returns)."""
    try:
        serving.main(argv, prog="pagedserve bench serving")
    except SystemExit as e:
        return e.code
    return 0


def check_metrics(run: dict, output_len: int = 8) -> None:
    """A run whose every request produced output_len tokens: finite, ordered metrics."""
    assert run["token_check_passed"] and run["exact_tokens"] == run["num_requests"] == 6, run["problems"]
    assert run["errors"] == 0 and run["problems"] == []
    assert run["output_tok_s"] > 0 and run["request_s"] > 0 and run["duration_s"] > 0
    assert run["output_tokens"] == 6 * output_len
    for m in ("ttft", "itl", "tpot", "e2e"):
        p50, p99 = run[f"{m}_p50_ms"], run[f"{m}_p99_ms"]
        assert math.isfinite(p50) and math.isfinite(p99) and 0 <= p50 <= p99, (m, p50, p99)
    assert run["ttft_p50_ms"] <= run["e2e_p50_ms"] and run["ttft_p99_ms"] <= run["e2e_p99_ms"]
    for r in run["requests"]:
        assert r["error"] is None and r["output_tokens"] == output_len
        assert 0 < r["ttft"] <= r["e2e"] and len(r["itl"]) >= 1 and all(g >= 0 for g in r["itl"])
    # the whole run lasts at least as long as its longest request, and its tokens/s follows from it
    assert run["duration_s"] >= max(r["e2e"] for r in run["requests"])
    assert run["output_tok_s"] == pytest.approx(run["output_tokens"] / run["duration_s"])


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(-5, 5) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert serving.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert serving.percentile([4, 1, 3, 2], 50) == 2.5 and serving.percentile([7], 99) == 7
    assert math.isnan(serving.percentile([], 50))
    with pytest.raises(ValueError):
        serving.percentile([1], 101)


def test_poisson_schedule_is_reproducible_for_a_seed():
    a = serving.poisson_arrivals(200, 4.0, seed=7)
    assert a == serving.poisson_arrivals(200, 4.0, seed=7)
    assert a != serving.poisson_arrivals(200, 4.0, seed=8)
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:]))
    long = serving.poisson_arrivals(20001, 4.0, seed=3)
    gaps = [y - x for x, y in zip(long, long[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)  # mean gap 1 / rate
    # exponential: the share of gaps above the mean is e^-1
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    for bad in (0, -1, math.inf):
        with pytest.raises(ValueError):
            serving.poisson_arrivals(3, bad, seed=0)


def test_synthetic_prompts_are_seeded_words():
    a = serving.synthetic_prompts(4, 16, seed=0)
    assert a == serving.synthetic_prompts(4, 16, seed=0) and a != serving.synthetic_prompts(4, 16, seed=1)
    assert serving.synthetic_prompts(2, 16, seed=0, start=2) == a[2:]  # prompt j depends on (seed, j) only
    assert len(set(a)) == 4
    for p in a:
        words = p.rstrip(".").lower().split()
        assert len(words) == 16 and all(w in serving.WORDS for w in words)


def test_closed_loop_sweep_writes_json_and_plot(bench_server, tmp_path, capsys):
    out_json, out_png = tmp_path / "serving.json", tmp_path / "serving.png"
    argv = ["--base-url", bench_server, "--label", "pagedserve", *SMALL, "--sweep", "1,3", "--json", str(out_json)]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(out_png)]
    except ImportError:
        out_png = None
    assert run_main(argv) == 0
    text = capsys.readouterr().out
    assert "| pagedserve | c=1 | 6/6 |" in text and "| pagedserve | c=3 | 6/6 |" in text and "FAIL" not in text
    result = json.loads(out_json.read_text())
    assert result["token_check_passed"] and result["servers"][0]["model"]  # the model came from GET /v1/models
    assert [r["concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        check_metrics(run)
        assert run["counted_by"] == ["usage"]
        assert 16 <= run["mean_prompt_tokens"] <= 20  # 16 words and a full stop, as the server counted them
    if out_png is None:
        pytest.skip("matplotlib is not installed (the `bench` extra): --plot not checked")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_open_loop_on_chat_counting_chunks(bench_server, tmp_path, capsys):
    """Open loop on /v1/chat/completions, the server told not to send usage: tokens counted as chunks."""
    out_json = tmp_path / "poisson.json"
    argv = ["--base-url", bench_server, *SMALL, "--request-rate", "40", "--max-concurrency", "2", "--endpoint", "chat",
            "--extra-body", '{"stream_options": {"include_usage": false}}', "--json", str(out_json)]
    assert run_main(argv) == 0
    assert "40 req/s, max 2 in flight | 6/6 |" in capsys.readouterr().out
    (run,) = json.loads(out_json.read_text())["runs"]
    check_metrics(run)
    assert run["mode"] == "rate" and run["counted_by"] == ["chunks"] and run["mean_prompt_tokens"] is None
    starts = sorted(r["start"] for r in run["requests"])
    assert starts[-1] - starts[0] > 0.02  # spread over the schedule (~0.125 s at 40 req/s), not all at once


def test_compare_prints_ratios_against_the_baseline(bench_server, tmp_path, capsys):
    out_json = tmp_path / "compare.json"
    argv = ["--compare", f"one={bench_server}", f"two={bench_server}", "--baseline", "two", *SMALL,
            "--concurrency", "2", "--json", str(out_json)]
    assert run_main(argv) == 0
    text = capsys.readouterr().out
    assert "| one | c=2 | 6/6 |" in text and "| two | c=2 | 6/6 |" in text and "| c=2 | two / one |" in text
    result = json.loads(out_json.read_text())
    (ratio,) = result["ratios"]
    one, two = result["runs"]
    assert ratio["output_tok_s_ratio"] == pytest.approx(two["output_tok_s"] / one["output_tok_s"])
    assert ratio["tpot_p50_ratio"] == pytest.approx(two["tpot_p50_ms"] / one["tpot_p50_ms"])
    assert "api_key" not in result["config"]


def test_token_check_fails_when_the_server_refuses(bench_server, tmp_path, capsys):
    """16-word prompts + 120 output tokens exceed max_model_len 128: every request is a 400, reported."""
    out_json = tmp_path / "refused.json"
    argv = ["--base-url", bench_server, *SMALL[:4], "--output-len", "120", "--concurrency", "2", "--warmup", "0",
            "--json", str(out_json)]
    assert run_main(argv) == 1
    text = capsys.readouterr().out
    assert "0/6 FAIL" in text and "6 of 6 request(s) failed the check (6 error(s))" in text
    assert "HTTP 400" in text and "maximum context length is 128" in text
    (run,) = json.loads(out_json.read_text())["runs"]
    assert not run["token_check_passed"] and run["errors"] == 6 and len(run["problems"]) == 6
    assert run["output_tok_s"] == 0


def test_token_check_fails_when_the_server_stops_early(bench_server, tmp_path, capsys):
    """A stop string the model really generates (found by asking the server first, greedy)
    makes the server end the requests before --output-len: reported as short, exit 1."""
    prompt = serving.synthetic_prompts(1, 16, seed=0)[0]  # the first request's prompt of the run below
    model = httpx.get(bench_server + "/models").json()["data"][0]["id"]
    first3 = httpx.post(bench_server + "/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()
    stop = first3["choices"][0]["text"]
    assert stop and first3["usage"]["completion_tokens"] == 3
    out_json = tmp_path / "short.json"
    argv = ["--base-url", bench_server, *SMALL, "--concurrency", "1", "--json", str(out_json),
            "--extra-body", json.dumps({"stop": [stop]})]
    assert run_main(argv) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "finish_reason stop" in text
    (run,) = json.loads(out_json.read_text())["runs"]
    assert not run["token_check_passed"] and run["errors"] == 0
    short = {p["request"] for p in run["problems"]}
    assert 0 in short
    for r in run["requests"]:
        assert (r["index"] in short) == (r["output_tokens"] < 8)
    assert 0 < run["requests"][0]["output_tokens"] <= 3 and run["requests"][0]["finish_reason"] == "stop"


def test_unreachable_server_is_one_line_and_exit_2():
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.bench.serving", "--base-url", url, "--warmup", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "error" in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "1,x"], "--sweep: not an integer"),
    (["--concurrency", "0"], "must be at least 1"),
    (["--concurrency", "2", "--request-rate", "3"], "not allowed with argument"),
    (["--max-concurrency", "2"], "--max-concurrency needs --request-rate"),
    (["--request-rate", "0"], "must be a finite number above 0"),
    (["--compare", "a=http://x", "--label", "b"], "not both"),
    (["--compare", "nourl"], "expected LABEL=URL"),
    (["--compare", "a=http://x", "a=http://y"], "labels must differ"),
    (["--compare", "a=http://x", "--baseline", "c"], "--baseline 'c' is none of the labels"),
    (["--extra-body", "[1]"], "expected a JSON object"),
    (["--endpoint", "embeddings"], "invalid choice"),
])
def test_bad_flags_are_one_line_usage_errors(argv, message, capsys):
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pagedserve bench serving: error:") and message in err[-1], err


def _tiny_gguf(path, with_output: bool):
    """A GGUF of F32 tensors of known sizes: token_embd 64 x 8, blk.0 weight 8 x 8, and output 32 x 8 or none."""
    gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.ones((64, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float32))
    if with_output:
        w.add_tensor("output.weight", np.ones((32, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_decode_bytes_per_token_counts_the_embedding_only_when_it_is_the_output_layer(tmp_path):
    from pagedserve.bench import bandwidth

    tied = _tiny_gguf(tmp_path / "tied.gguf", with_output=False)
    untied = _tiny_gguf(tmp_path / "untied.gguf", with_output=True)
    assert bandwidth.decode_bytes_per_token(tied) == 4 * (64 * 8 + 8 * 8)  # the embedding is read whole as the output
    assert bandwidth.decode_bytes_per_token(untied) == 4 * (8 * 8 + 32 * 8)  # one row of the embedding: not counted


def test_weights_flag_prints_one_users_bandwidth_floor(bench_server, tmp_path, capsys, monkeypatch):
    from pagedserve.bench import bandwidth

    monkeypatch.setattr(bandwidth, "read_bandwidth", lambda *a, **k: 1e6)  # 1 MB/s: the floor is bytes / 1e6 s
    weights = _tiny_gguf(tmp_path / "w.gguf", with_output=True)
    argv = ["--base-url", bench_server, "--label", "ps", *SMALL, "--concurrency", "1", "--weights", weights]
    assert run_main(argv) == 0
    text = capsys.readouterr().out
    floor = [line for line in text.splitlines() if line.startswith("bandwidth floor of one user's decode:")]
    # 4 * (64 + 256) = 1,280 bytes read per token at 1 MB/s: 1.28 ms
    assert len(floor) == 1 and "read per token / 0.0 GB/s read bandwidth = 1.28 ms" in floor[0], text
    ratio = [line for line in text.splitlines() if line.startswith("  ps c=1: TPOT p50 ")]
    assert len(ratio) == 1 and ratio[0].endswith("x the floor"), text
    # a file gguf-py cannot read is a one-line error, exit status 2, before any request
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert run_main(["--base-url", bench_server, *SMALL, "--weights", str(bad)]) == 2
    assert "--weights" in capsys.readouterr().err
