"""Incremental detokenization and stop strings, on SmolLM2's tokenizer."""

import dataclasses

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.stop import StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", [
    " Paris is the capital of France.",
    "naïve café — 東京タワー and emoji 🎉🙂 done",
    "  two leading spaces, then\ttabs\nand newlines",
])
def test_incremental_equals_full_decode_and_never_splits_utf8(tokenizer, text):
    prompt = tokenizer("Question: say something.").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.step(t) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
    if any(ord(c) > 0x7FF for c in text):  # some character spans several tokens
        assert "" in pieces[:-1]


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer("The capital of France is").input_ids
    [paris] = tokenizer(" Paris", add_special_tokens=False).input_ids
    assert IncrementalDetokenizer(tokenizer, prompt).step(paris) == " Paris"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    assert detok.step(eos) == "" and detok.flush() == ""


def test_stop_string_is_cut_and_its_prefix_held_back():
    m = StopStringMatcher(["DEFG"])
    assert not m.append("ABC")
    assert m.releasable() == 3
    assert not m.append("D")
    assert m.releasable() == 3  # "D" could start "DEFG"
    assert not m.append("E")
    assert m.releasable() == 3
    assert not m.append("X")  # "DEX" can no longer become the stop
    assert m.releasable() == 6
    assert m.append("DEFGHI")
    assert m.text == "ABCDEX"


def test_stop_string_split_over_pieces_and_earliest_wins():
    m = StopStringMatcher(["world", "lo w"])
    for piece in ["hel", "lo", " wo"]:
        found = m.append(piece)
    assert found and m.text == "hel"


def test_the_stop_string_that_matched_is_named_and_may_stay_in_the_text():
    m = StopStringMatcher(["world", "lo w"], include_stop_str=True)
    assert not m.append("hel") and m.matched is None
    assert m.append("lo world") and m.matched == "lo w" and m.text == "hello w"  # the earliest, kept
    tie = StopStringMatcher(["ab", "abc"], include_stop_str=True)
    assert tie.append("xabcd") and tie.matched == "ab" and tie.text == "xab"  # same start: the first listed


def test_text_added_unchecked_never_stops_and_only_later_text_is_checked():
    m = StopStringMatcher(["stop"])
    assert not m.append("no stop here", check=False) and m.text == "no stop here"  # min_tokens not reached
    assert not m.append(" then", check=True)  # the earlier "stop" is not found again
    assert m.append(" sto") is False and m.append("p now") and m.text == "no stop here then "


def test_no_stop_strings_release_everything():
    m = StopStringMatcher([])
    assert not m.append("anything")
    assert m.releasable() == len("anything")


def test_gguf_fingerprint_follows_content_not_location(tmp_path):
    from pagedserve.model.loader import gguf_fingerprint

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    b.write_bytes(a.read_bytes())
    c.write_bytes(a.read_bytes()[:-1] + b"x")
    assert gguf_fingerprint(a) == gguf_fingerprint(b) != gguf_fingerprint(c)


@pytest.fixture(scope="module")
def tiny_llm(smollm2_dir, tmp_path_factory):
    from conftest import make_tiny_chat_model
    from pagedserve import LLM

    return LLM(model=make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_text"), 256), dtype="float32")


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_stop_string_in_held_back_text_ends_a_length_finish_with_stop(tiny_llm, tokenizer, max_tokens):
    """The scheduler's update() decides every finish: a token whose text ends in
    an incomplete UTF-8 character (" " + 0xE2) is held back by the detokenizer;
    at max_tokens the flush reveals the stop string " ", so the reason is
    "stop" (STOP_IF_FINISHED), while the same flag on an earlier token does not
    end the output."""
    from pagedserve import SamplingParams

    [held] = tokenizer.convert_tokens_to_ids(["Ġâ"])
    assert tokenizer.decode([held]).endswith("\ufffd")
    forced = SamplingParams(temperature=0, max_tokens=max_tokens, allowed_token_ids=[held], ignore_eos=True)
    [out] = tiny_llm.generate(["Hello"], dataclasses.replace(forced, stop=[" "]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == [held] * max_tokens
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", " ", "")
    [plain] = tiny_llm.generate(["Hello"], forced, use_tqdm=False)  # no stop string: the length finish stays
    assert plain.outputs[0].finish_reason == "length" and plain.outputs[0].token_ids == [held] * max_tokens
