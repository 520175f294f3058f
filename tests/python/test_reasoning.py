"""Issue 30 part 4: reasoning parsers (--reasoning-parser). The split of fixed
texts, streamed in random pieces equal to the whole; the reasoning-token count;
the structured-output gate; and end to end, a tiny random model whose template
has <think> (its tokens restricted to a handful, sampled with seeds so the tags
fall at random places): reasoning_content and content streamed equal not
streamed, equal the raw text's split, a grammar constrains only the answer,
and a template that turns thinking off starts the grammar at once."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
import torch

from pagedserve.reasoning import PARSERS, ReasoningStreamer, get_parser, reasoning_token_count
from pagedserve.structured_output.reasoning_gate import ReasoningGate, StartTagTokens

CASES = {  # text -> (deepseek_r1 split, qwen3 split)
    "<think>abc</think>xyz": (("abc", "xyz"), ("abc", "xyz")),
    "abc</think>xyz": (("abc", "xyz"), (None, "abc</think>xyz")),
    "<think>still thinking": (("still thinking", None), ("still thinking", None)),
    "plain answer": (("plain answer", None), (None, "plain answer")),
    "<think>a</b></think>c</think>d": (("a</b>", "c</think>d"), ("a</b>", "c</think>d")),
    "<thin": (("<thin", None), (None, "<thin")),
}


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split_and_any_streaming_of_it(name):
    parser, rng = PARSERS[name], random.Random(0)
    for text, splits in CASES.items():
        want = splits[name == "qwen3"]
        assert parser.split(text) == want
        for _ in range(30):
            streamer, got, i = ReasoningStreamer(parser), ["", ""], 0
            while i < len(text):
                j = i + rng.randint(1, 5)
                for k, piece in enumerate(streamer.feed(text[i:j])):
                    got[k] += piece
                i = j
            for k, piece in enumerate(streamer.finish()):
                got[k] += piece
            assert tuple(got) == tuple(w or "" for w in want), (text, got)
    with pytest.raises(ValueError, match="unknown"):
        get_parser("nope")


def test_reasoning_token_count_ends_with_the_token_that_closes_the_tag():
    pieces = {1: b"<think>", 2: b"hm", 3: b"</th", 4: b"ink>", 5: b"ok"}
    parser = PARSERS["deepseek_r1"]
    assert reasoning_token_count(parser, [1, 2, 3, 4, 5, 5], pieces.__getitem__) == 4
    assert reasoning_token_count(parser, [2, 2, 3], pieces.__getitem__) == 3  # still open: all
    assert reasoning_token_count(PARSERS["qwen3"], [5, 3, 4], pieces.__getitem__) == 0  # no <think>: no reasoning


class _Grammar:
    """Stand-in GrammarState: allows only the tokens in `ok` (9 by default), records what it accepted."""

    def __init__(self, ok=(9,), accepted=None):
        self.ok, self.accepted = set(ok), list(accepted or [])

    def allowed(self):
        out = torch.zeros(10, dtype=torch.bool)
        out[sorted(self.ok)] = True
        return out

    def mask_logits(self, logits):
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def fork(self):
        return _Grammar(self.ok, self.accepted)

    def admits_any(self):
        return True

    def accept(self, token_id):
        self.accepted.append(token_id)
        return token_id in self.ok

    @property
    def terminated(self):
        return False


PIECES = {0: b"<", 1: b"<think>", 2: b"hm", 3: b"</think>", 4: b"th", 5: b"x", 6: b"ink>", 7: b"", 8: b"<t", 9: b"7"}
EOS = [7]


def _gate(name, grammar, ended=False):
    start = StartTagTokens(PARSERS[name].start, PIECES.__getitem__, 10, 10)
    return ReasoningGate(grammar, PARSERS[name], PIECES.__getitem__, EOS, start, ended)


def _allowed(gate):
    return set(torch.isfinite(gate.mask_logits(torch.zeros(10))).nonzero().flatten().tolist())


def test_the_gate_opens_after_the_reasoning():
    g = _Grammar()
    gate = _gate("deepseek_r1", g)  # the template opened the reasoning
    for t in (1, 2, 5):
        assert _allowed(gate) == set(range(10)) - {7} and gate.accept(t)  # free, but no end of sequence
    assert gate.accept(3) and g.accepted == []  # the closing tag is the last free token
    assert _allowed(gate) == {9} and gate.accept(9) and g.accepted == [9]
    assert not gate.accept(5)
    assert _allowed(_gate("deepseek_r1", _Grammar(), ended=True)) == {9}
    assert PARSERS["qwen3"].ended_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not PARSERS["qwen3"].ended_in_prompt("</think> earlier turn <think>\n")


def test_an_undecided_output_is_constrained_from_its_first_token():
    """qwen3: the first tokens may open <think> or begin the answer under the
    grammar, nothing else: a model that does not think never escapes the constraint."""
    g = _Grammar()
    gate = _gate("qwen3", g)
    assert _allowed(gate) == {0, 1, 8, 9}  # on the way to <think> ("<", "<think>", "<t") or the grammar's
    assert gate.accept(9) and g.accepted == [9] and gate.ended  # the answer began
    assert _allowed(gate) == {9}
    # "<" could begin either: the next token may continue the tag, or whatever the grammar takes after "<"
    g = _Grammar(ok=(0, 9))
    gate = _gate("qwen3", g)
    assert gate.accept(0) and not gate.ended and g.accepted == []
    assert _allowed(gate) == {0, 4, 9}  # "th" toward the tag; "<" and "7" the grammar's after "<"
    assert gate.accept(9) and gate.ended and g.accepted == [0, 9]
    # a "<" the grammar refuses: only the tag may follow
    gate = _gate("qwen3", _Grammar())
    assert gate.accept(0) and _allowed(gate) == {4}
    # opened: free (no end of sequence) until the end tag, then the grammar
    g = _Grammar()
    gate = _gate("qwen3", g)
    for t in (0, 4, 6):  # "<", "th", "ink>"
        assert gate.accept(t)
    assert gate.reasoning and not gate.ended and _allowed(gate) == set(range(10)) - {7}
    assert gate.accept(2) and gate.accept(3) and gate.ended and g.accepted == []
    assert _allowed(gate) == {9}


TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
            "{%- endif %}")


@pytest.fixture(scope="module")
def thinking_server(smollm2_dir, tmp_path_factory):
    from conftest import make_tiny_chat_model
    from serverlib import start_server, stop_server

    path = make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_thinking"), 512,
                                extra_tokens=["<think>", "</think>"], chat_template=TEMPLATE)
    proc, base = start_server("--model", path, "--dtype", "float32", "--max-model-len", "512",
                              "--reasoning-parser", "deepseek_r1", "--log-level", "warning")
    yield base
    stop_server(proc)


def _ids(base, text):
    return httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def _stream(base, body):
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    join = lambda key: "".join(c["delta"].get(key) or "" for e in events for c in e["choices"])  # noqa: E731
    return join("reasoning_content"), join("content"), events[-1]["usage"]


def test_reasoning_end_to_end_streamed_equals_whole_and_grammar_binds_only_the_answer(thinking_server):
    base = thinking_server
    allowed = [t for w in ("<think>", "</think>", " yes", " no", "1", "2") for t in _ids(base, w)]
    eos = _ids(base, httpx.get(base + "/tokenizer_info").json()["eos_token"])
    assert len(allowed) == 6 and len(eos) == 1
    messages = [{"role": "user", "content": "Think, then answer with digits."}]
    prompt = httpx.post(base + "/tokenize", json={"messages": messages}).json()["tokens"]
    # +100 on these tokens: the others' probabilities fall below e^-60 (allowed_token_ids would do the same,
    # but a structured-output constraint refuses it: the grammar may need a token it leaves out)
    bias = {str(t): 100 for t in allowed + eos}
    body = {"messages": messages, "max_tokens": 24, "temperature": 1.5, "logit_bias": bias}
    closed = words_in_reasoning = 0
    for seed in range(8):
        r = httpx.post(base + "/v1/chat/completions", json={**body, "seed": seed}, timeout=60).json()
        msg, usage = r["choices"][0]["message"], r["usage"]
        raw = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 1.5,
                                                         "logit_bias": bias, "seed": seed,
                                                         "logprobs": 0}, timeout=60).json()["choices"][0]
        assert (msg["reasoning_content"], msg["content"]) == PARSERS["deepseek_r1"].split(raw["text"])
        tokens = raw["logprobs"]["tokens"]
        reasoning = tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)
        assert usage["completion_tokens_details"]["reasoning_tokens"] == reasoning
        assert _stream(base, {**body, "seed": seed}) == (msg["reasoning_content"] or "", msg["content"] or "",
                                                         usage)
        # the same with a grammar over the answer: free thinking, then digits only
        constrained = {**body, "seed": seed, "structured_outputs": {"regex": "[12]+"}}
        c = httpx.post(base + "/v1/chat/completions", json=constrained, timeout=60).json()["choices"][0]["message"]
        if c["content"] is not None:
            closed += 1
            assert re.fullmatch("[12]+", c["content"]), c
        words_in_reasoning += bool(re.search(" yes| no", c["reasoning_content"] or ""))
        assert _stream(base, constrained)[:2] == (c["reasoning_content"] or "", c["content"] or "")
    assert closed >= 2 and words_in_reasoning >= 2  # both paths were taken
    # thinking turned off by the template: the answer (and its grammar) starts at once
    off = {**body, "seed": 0, "structured_outputs": {"regex": "[12]+"},
           "chat_template_kwargs": {"enable_thinking": False}}
    m = httpx.post(base + "/v1/chat/completions", json=off, timeout=60).json()["choices"][0]["message"]
    assert m["reasoning_content"] is None and re.fullmatch("[12]+", m["content"]), m
    # a </think> in the user's own text does not turn the reasoning off: only what the template adds counts
    tagged = {**body, "seed": 1, "messages": [{"role": "user", "content": "What does </think> mean?"}]}
    raw_split = httpx.post(base + "/v1/chat/completions", json=tagged, timeout=60).json()["choices"][0]["message"]
    tail = httpx.post(base + "/tokenize", json={"messages": tagged["messages"]}).json()["tokens"]
    text = httpx.post(base + "/v1/completions", json={"prompt": tail, "max_tokens": 24, "temperature": 1.5,
                                                      "logit_bias": bias, "seed": 1}).json()
    assert (raw_split["reasoning_content"], raw_split["content"]) == PARSERS["deepseek_r1"].split(
        text["choices"][0]["text"])
    # vLLM's echo of a final assistant message is split with the output
    cont = {**body, "seed": 2, "echo": True, "add_generation_prompt": False, "continue_final_message": True,
            "messages": messages + [{"role": "assistant", "content": "<think>Let me see"}]}
    e = httpx.post(base + "/v1/chat/completions", json=cont, timeout=60).json()["choices"][0]["message"]
    assert e["reasoning_content"].startswith("Let me see")  # the echoed "<think>Let me see" is reasoning
    assert _stream(base, cont)[:2] == (e["reasoning_content"], e["content"] or "")
