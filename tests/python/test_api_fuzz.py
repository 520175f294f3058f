"""API fuzzing with schemathesis against the server's own /openapi.json.

A real `python -m pagedserve.server` serves a tiny random Llama (hidden 64, 2
layers) with SmolLM2's tokenizer and chat template, so text prompts, chat
messages, /tokenize and /detokenize all run for real while generation stays
cheap (max_model_len 128). Every operation of the schema gets:

- schemathesis' coverage phase: deterministic boundary and schema-violating
  bodies, one field at a time, and every undocumented method;
- its fuzzing phase: PAGEDSERVE_FUZZ_EXAMPLES (default 25) Hypothesis examples
  per operation, positive (schema-valid) and negative (schema-invalid) bodies,
  derandomized (the same ones every run; PAGEDSERVE_FUZZ_SEED=<int> draws
  others).

Each response must be:

- not a 5xx (not_a_server_error),
- of a documented status code (status_code_conformance),
- of a documented media type (content_type_conformance),
- valid against the schema documented for that status and media type, every
  server-sent event of a stream included (response_schema_conformance).

positive_data_acceptance is not checked: the server refuses some schema-valid
bodies on purpose (an unknown model name, a parameter it does not implement, an
empty prompt, a prompt plus max_tokens longer than the context), with a
documented 400/404. Because of those, a random schema-valid body is almost
never served (it sets a few of the ~37 parameters the server refuses by name):
the positive bodies of the fuzzing phase are steered towards ones the server
serves (see `steer`), so that answers, streams, logprobs and echo get checked
too. The coverage phase and the negative bodies are sent as generated.

PAGEDSERVE_FUZZ_LOG=<file> appends one JSON line per request sent (operation,
method, phase, mode, status, media type, error message); bench/api_fuzz.py
runs this file with a larger budget and summarises that log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import zlib

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from serverlib import exit_report, start_server, stop_server

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "25"))
SEED = os.environ.get("PAGEDSERVE_FUZZ_SEED")  # other examples than the derandomized ones
LOG = os.environ.get("PAGEDSERVE_FUZZ_LOG")
MAX_MODEL_LEN = 128
MAX_STEERED_TOKENS = 24  # steered bodies ask for at most this many tokens per choice
REQUEST_TIMEOUT_S = 300.0  # n=64 choices to the end of the context, on a busy machine
# schemathesis reads 20 events of a stream by default, then hangs up: read (and
# check) every one, up to n=64 choices x 128 tokens, their ends, usage and [DONE]
MAX_STREAM_EVENTS = 64 * (MAX_MODEL_LEN + 2) + 2
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Parameters the server refuses by name when set (400): dropped from steered bodies.
REFUSED = (set(CompletionRequest.UNIMPLEMENTED) | set(ChatCompletionRequest.UNIMPLEMENTED)
           | {"tool_choice", "function_call", "response_format", "best_of", "priority",
              "chat_template_kwargs", "documents", "reasoning_effort", "continue_final_message", "dimensions"})


@pytest.fixture(scope="module")
def tiny_chat_model_dir(smollm2_dir, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer (vocabulary, special
    tokens, chat template)."""
    from conftest import make_tiny_chat_model

    return make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_chat_llama"), MAX_MODEL_LEN)


@dataclasses.dataclass
class FuzzServer:
    base: str
    model: str  # the served model's name
    vocab: int
    proc: subprocess.Popen  # from serverlib.start_server (its output in a file)

    def died(self) -> str | None:
        """None while the server runs, else its exit status and the end of its output."""
        return exit_report(self.proc)


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model_dir, tmp_path_factory):
    """The server (its output goes to a file, shown if it dies)."""
    log = str(tmp_path_factory.mktemp("fuzz_server") / "server.log")
    proc, base = start_server("--model", tiny_chat_model_dir, "--dtype", "float32",
                              "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
                              log=log, ready_path="/v1/models")
    try:
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        with open(os.path.join(tiny_chat_model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        yield FuzzServer(base, model, vocab, proc)
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json")
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    schema.config.phases.update(phases=["coverage", "fuzzing"])
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES, deterministic=True, database="none")
    if SEED:
        schema.config.seed = int(SEED)
    return schema


@pytest.fixture(autouse=True)
def _nodeid_for_schemathesis(request):
    """schemathesis 4.32's lazy-schema tests read and rename `request.node._nodeid`,
    which pytest 9.2 no longer has (it keeps the id elsewhere): give the node
    that attribute (only the renaming of its subtests is lost)."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def _token_ids(ids, vocab: int) -> list:
    """A non-empty list of ids inside the vocabulary (from any list of ints)."""
    return [i % vocab for i in ids] or [1]


def _prompt(prompt, vocab: int):
    if isinstance(prompt, str):
        return prompt or "Hello"
    if not prompt:
        return "Hello"
    if all(isinstance(p, int) for p in prompt):
        return _token_ids(prompt, vocab)
    return [(p or "Hello") if isinstance(p, str) else _token_ids(p, vocab) for p in prompt]


def _messages(messages: list) -> list:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("content") is None and m["role"] != "assistant":
            m["content"] = ""
        out.append(m)
    return out or [{"role": "user", "content": "Hello"}]


def steer(path: str, body, model: str, vocab: int):
    """A schema-valid body nudged towards one the server serves: no refused
    parameter, the served model's name, a non-empty prompt (or embeddings input) of known token ids,
    text messages, logprobs on with top_logprobs, stream on with stream_options,
    at most MAX_STEERED_TOKENS new tokens per choice when a limit is given, and
    half of the completions and chats streamed when `stream` is not given.
    Everything else (n up to 64, sampling parameters, stop strings, echo,
    logprobs, an absent max_tokens, ...) stays as generated."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k not in REFUSED}
    if body.get("model") is not None:
        body["model"] = model
    if path == "/detokenize" and isinstance(body.get("tokens"), list):
        body["tokens"] = _token_ids(body["tokens"], vocab)
    if path == "/tokenize" and (body.get("prompt") is None) == (body.get("messages") is None):
        body.pop("messages", None)
        body["prompt"] = body.get("prompt") or "Hello"
    if "prompt" in body and body["prompt"] is not None:
        body["prompt"] = _prompt(body["prompt"], vocab)
    if path == "/v1/embeddings" and body.get("input") is not None:
        body["input"] = _prompt(body["input"], vocab)
    if isinstance(body.get("messages"), list):
        body["messages"] = _messages(body["messages"])
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] = (body[key] - 1) % MAX_STEERED_TOKENS + 1
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if body.get("stream_options") is not None:
        body["stream"] = True
    if path in ("/v1/completions", "/v1/chat/completions") and body.get("stream") is None:
        body["stream"] = zlib.crc32(json.dumps(body, sort_keys=True).encode()) % 2 == 0  # half of them
    return body


def _log(case, response) -> None:
    error = None
    if response.status_code >= 400:
        try:
            error = response.json()["error"]["message"][:120]
        except Exception:  # not an ErrorResponse: the checks report it
            pass
    with open(LOG, "a") as f:
        f.write(json.dumps({
            "operation": case.operation.label,
            "method": case.method.upper(),  # another one than the operation's: a probe for 405
            "phase": case.meta.phase.name.value if case.meta else None,
            "mode": case.meta.generation.mode.value if case.meta else None,
            "status": response.status_code,
            "media_type": response.headers.get("content-type", [""])[0].split(";")[0],
            "error": error,
        }) + "\n")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_fuzz(case, fuzz_server):
    meta = case.meta
    if (meta is not None and meta.phase.name.value == "fuzzing" and meta.generation.mode == GenerationMode.POSITIVE
            and case.method.upper() == "POST"):
        case.body = steer(case.path, case.body, fuzz_server.model, fuzz_server.vocab)
    try:
        response = case.call(timeout=REQUEST_TIMEOUT_S)
    except requests.ConnectionError as e:
        if (why := fuzz_server.died()) is not None:
            pytest.fail(f"the server died: {why}", pytrace=False)
        raise e
    if LOG:
        _log(case, response)
    case.validate_response(response, checks=CHECKS)


def test_server_survived(fuzz_server):
    """After all that the server still runs (a crash shows its output here)."""
    assert fuzz_server.died() is None, f"the server died: {fuzz_server.died()}"
