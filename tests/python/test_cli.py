"""The `pagedserve` console script: `serve` is the server's own parser and main
(positional MODEL = --model), `chat` streams multi-turn answers from a server or
an in-process engine and survives Ctrl-C, `bench` runs the packaged benchmarks
(bench/*.py call the same code), --help and --version."""

from __future__ import annotations

import importlib
import io
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedserve import EngineArgs, __version__
from pagedserve.cli import main as cli_main
from pagedserve.cli.bench import BENCHMARKS
from pagedserve.cli.chat import ChatError, chat_loop
from pagedserve.server import __main__ as server_main

REPO = Path(__file__).resolve().parents[2]


def pagedserve_cmd() -> list[str]:
    """The installed console script next to this Python (`make test` installs it),
    else `python -m pagedserve.cli` (a working tree run with PYTHONPATH=python)."""
    script = Path(sys.executable).with_name("pagedserve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pagedserve.cli"]


def cli_exit(capsys, *argv: str) -> str:
    """stdout of an in-process `pagedserve argv` that exits 0 (help, version)."""
    with pytest.raises(SystemExit) as e:
        cli_main(list(argv))
    assert e.value.code == 0
    return capsys.readouterr().out


# ---- serve ---------------------------------------------------------------------------------
def test_serve_is_the_server_main_with_the_same_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(server_main, "main", lambda argv, prog: calls.append((argv, prog)))
    flags = ["--dtype", "float32", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--port", "9000"]
    cli_main(["serve", "some/model", *flags])
    [(argv, prog)] = calls
    assert prog == "pagedserve serve"
    via_cli = server_main.build_parser(prog).parse_args(argv)
    direct = server_main.build_parser().parse_args(["--model", "some/model", *flags])
    assert vars(via_cli) == vars(direct)
    assert EngineArgs.from_cli_args(via_cli) == EngineArgs.from_cli_args(direct)
    assert EngineArgs.from_cli_args(via_cli).model == "some/model"


def test_model_positional_anywhere_but_not_twice(capsys):
    parser = server_main.build_parser("pagedserve serve")
    assert parser.parse_args(["--port", "9000", "m"]).model == "m"
    assert parser.parse_args([]).model is None
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["a", "--model", "b"])
    assert e.value.code == 2 and "given twice" in capsys.readouterr().err


def test_help_and_version(capsys):
    top = cli_exit(capsys, "--help")
    assert all(name in top for name in ("serve", "chat", "bench"))
    assert __version__ in cli_exit(capsys, "--version")
    serve = cli_exit(capsys, "serve", "--help")
    assert "pagedserve serve" in serve and "--max-num-seqs" in serve and "MODEL" in serve
    chat = cli_exit(capsys, "chat", "--help")
    assert all(flag in chat for flag in ("--url", "--api-key", "--system", "--temperature", "--max-tokens"))


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_bench_help(capsys, name):
    assert name in cli_exit(capsys, "bench", "--help")
    text = cli_exit(capsys, "bench", name, "--help")
    assert f"pagedserve bench {name}" in text and "--plot" in text


def test_bench_scripts_call_the_packaged_benchmarks():
    for name in ("throughput", "attention", "prefix_cache", "serving"):
        shim = runpy.run_path(str(REPO / "bench" / f"{name}.py"), run_name="shim")
        assert shim["main"] is importlib.import_module(f"pagedserve.bench.{name}").main


def test_pagedserve_serve_answers(tiny_llama_dir):
    from serverlib import start_server, stop_server

    proc, base = start_server("--dtype", "float32", "--skip-tokenizer-init", "--num-kv-blocks", "16",
                              "--log-level", "warning", command=[*pagedserve_cmd(), "serve", tiny_llama_dir])
    try:
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        r = httpx.post(base + "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == tiny_llama_dir  # the positional MODEL
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    finally:
        stop_server(proc)


# ---- chat ----------------------------------------------------------------------------------
def reference_answers(client, turns: list[str], max_tokens: int) -> list[str]:
    """Greedy answers to the turns as one conversation, from the server's non-streamed API."""
    from serverlib import MODEL

    messages, answers = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
        answers.append(out.choices[0].message.content)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def test_chat_with_a_server_keeps_the_history(server, client):
    turns = ["Name one colour.", "And another one?"]
    first, second = reference_answers(client, turns, max_tokens=12)
    proc = subprocess.run([*pagedserve_cmd(), "chat", "--url", server, "--temperature", "0", "--max-tokens", "12"],
                          input=f"{turns[0]}\n{turns[1]}\n/reset\n{turns[0]}\n/exit\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"> {first}\n> {second}\n> (history cleared)\n> {first}\n> ", proc.stdout


def test_ctrl_c_stops_the_answer_and_the_server_aborts_it(server):
    from serverlib import metrics, wait_idle

    aborts = "vllm:request_success_total{finished_reason=abort}"
    before = metrics(server).get(aborts, 0)
    # an answer long enough (1800 tokens, ~25 s) that the interrupt lands before its end even when this process
    # waits for a core: with 500 tokens (~6 s) a loaded 2-core CI machine once saw the whole answer first
    # SIGINT at its default in the child: an ignored SIGINT is inherited, and Python then installs no
    # KeyboardInterrupt handler (in the full suite the answer ran to its end, alone the test passed)
    proc = subprocess.Popen([*pagedserve_cmd(), "chat", "--url", server, "--temperature", "0", "--max-tokens", "1800"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdin.write("Tell me a long story about a dragon.\n")
        proc.stdin.flush()
        shown = proc.stdout.read(len("> ") + 5)  # the prompt, then the first characters of the answer
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("/exit\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (shown + out).endswith(" [stopped]\n> "), shown + out
    assert wait_idle(server)[aborts] == before + 1


class ScriptedBackend:
    """Answers "one two three" in three pieces; Ctrl-C arrives before the piece `interrupt_at`."""

    def __init__(self, interrupt_at: int | None = None, fail: bool = False) -> None:
        self.interrupt_at, self.fail, self.seen, self.closed = interrupt_at, fail, [], 0

    def describe(self) -> str:
        return "scripted"

    def stream(self, messages):
        self.seen.append([m["content"] for m in messages])
        try:
            if self.fail:
                raise ChatError("refused")
            for i, piece in enumerate(["one", " two", " three"]):
                if i == self.interrupt_at:
                    raise KeyboardInterrupt
                yield piece
        finally:
            self.closed += 1


def run_loop(backend, lines: list[str], system: str | None = None) -> str:
    """chat_loop's output (prompts included) for scripted input lines."""
    script, out = iter(lines), io.StringIO()

    def read(prompt: str) -> str:
        out.write(prompt)
        return next(script)  # StopIteration never reached: every script ends with /exit

    chat_loop(backend, system, read=read, out=out)
    return out.getvalue()


def test_chat_loop_history_after_a_stop_or_a_failure(capsys):
    stopped = ScriptedBackend(interrupt_at=2)
    assert run_loop(stopped, ["a", "b", "/exit"], system="sys") == "> one two [stopped]\n> one two [stopped]\n> "
    assert stopped.seen[1] == ["sys", "a", "one two", "b"]  # what was shown stays in the history
    assert stopped.closed == 2
    at_once = ScriptedBackend(interrupt_at=0)
    run_loop(at_once, ["a", "b", "/exit"])
    assert at_once.seen[1] == ["b"]  # stopped before any text: the turn is dropped
    failing = ScriptedBackend(fail=True)
    assert run_loop(failing, ["a", "", "b", "/exit"]) == "> > > > "
    assert failing.seen == [["a"], ["b"]] and "error: refused" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_chat_dir(smollm2_dir, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (fast to load)."""
    from conftest import make_tiny_chat_model

    return make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_chat_llama"), 512)


def test_chat_in_process(tiny_chat_dir):
    from pagedserve import LLM, SamplingParams
    from pagedserve.cli.chat_engine import EngineChat

    turns = ["Name one colour.", "And another one?"]
    chat = EngineChat(EngineArgs(model=tiny_chat_dir, dtype="float32"), temperature=0, max_tokens=8)
    shown = run_loop(chat, [*turns, "/exit"], system="Be brief.")
    llm, tok = LLM(model=tiny_chat_dir, dtype="float32"), chat.tokenizer  # the reference: one generate() per turn
    messages, expected = [{"role": "system", "content": "Be brief."}], ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids
        answer = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": answer})
        expected += f"> {answer}\n"
    assert shown == expected + "> " and len(shown) > 20, shown
    stream = chat.stream([{"role": "user", "content": "Tell me a long story."}])
    next(stream)
    stream.close()  # stopped early: the request is aborted, its blocks freed
    assert not chat.engine.has_unfinished_requests()
    assert chat.engine.num_free_blocks == chat.engine.num_kv_blocks
