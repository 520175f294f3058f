"""Prefix caching end to end: a hit really skips compute and never changes the
greedy output; salts separate tenants; eviction under a small pool is safe."""

import random

import pytest

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def one(llm, prompt, salt=None):
    rid = llm.engine.add_request(prompt, GREEDY, cache_salt=salt)
    final = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    return final


def rand_prompt(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(params=["tiny", "smollm2"])
def setup(request, tiny_llama_dir):
    if request.param == "tiny":
        return dict(model=tiny_llama_dir, skip_tokenizer_init=True), 512
    request.getfixturevalue("smollm2_dir")
    return dict(), 49152


@pytest.mark.parametrize("n", [50, 64])  # 64 = an exact multiple of block_size
def test_same_prompt_twice_hits_and_gives_the_same_output(setup, n):
    kw, vocab = setup
    llm = LLM(**kw)
    prompt = rand_prompt(random.Random(n), n, vocab)
    first = one(llm, prompt)
    hits_before = llm.engine.prefix_cache_stats.hits
    second = one(llm, prompt)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.num_cached_tokens == 0
    # every full block but the one holding the last prompt token is reused
    assert second.num_cached_tokens == (n - 1) // 16 * 16
    assert llm.engine.prefix_cache_stats.hits - hits_before == second.num_cached_tokens


def test_shared_prefix_output_equals_caching_off(setup):
    kw, vocab = setup
    rng = random.Random(1)
    system = rand_prompt(rng, 100, vocab)
    questions = [system + rand_prompt(rng, 7 + i, vocab) for i in range(3)]
    on, off = LLM(**kw), LLM(**kw, enable_prefix_caching=False)
    got = [one(on, q) for q in questions]
    want = [one(off, q) for q in questions]
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert [g.num_cached_tokens for g in got] == [0, 96, 96]
    assert off.engine.prefix_cache_stats.hits == 0


def test_prompts_evicting_each_other_still_match_caching_off(tiny_llama_dir):
    rng = random.Random(2)
    kw = dict(model=tiny_llama_dir, skip_tokenizer_init=True)
    prompts = [rand_prompt(rng, 60, 512) for _ in range(4)] * 2  # each comes back after the others
    small, off = LLM(**kw, num_kv_blocks=6), LLM(**kw, enable_prefix_caching=False)
    got = [one(small, p).outputs[0].token_ids for p in prompts]
    assert got == [one(off, p).outputs[0].token_ids for p in prompts]
    assert small.engine.prefix_cache_stats.evictions > 0


def test_different_cache_salts_never_share(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True)
    prompt = list(range(10, 80))
    assert one(llm, prompt, "alice").num_cached_tokens == 0
    assert one(llm, prompt, "bob").num_cached_tokens == 0
    assert one(llm, prompt, "alice").num_cached_tokens == 64
    assert one(llm, prompt).num_cached_tokens == 0  # no salt is a salt of its own
