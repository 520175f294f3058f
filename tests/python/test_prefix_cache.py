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
        return dict(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True), 512
    request.getfixturevalue("smollm2_dir")
    return dict(dtype="float32"), 49152


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


def test_prompts_evicting_each_other_still_match_caching_off(setup):
    kw, vocab = setup
    rng = random.Random(2)
    prompts = [rand_prompt(rng, 60, vocab) for _ in range(4)] * 2  # each comes back after the others
    small, off = LLM(**kw, num_kv_blocks=6), LLM(**kw, enable_prefix_caching=False)
    got = [one(small, p).outputs[0].token_ids for p in prompts]
    assert got == [one(off, p).outputs[0].token_ids for p in prompts]
    assert small.engine.prefix_cache_stats.evictions > 0


def test_different_cache_salts_never_share(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)
    prompt = list(range(10, 80))
    assert one(llm, prompt, "alice").num_cached_tokens == 0
    assert one(llm, prompt, "bob").num_cached_tokens == 0
    assert one(llm, prompt, "alice").num_cached_tokens == 64
    assert one(llm, prompt).num_cached_tokens == 0  # no salt is a salt of its own


# ---- parallel sampling: fork + copy-on-write ----------------------------------

def choices(llm, prompt, params):
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    assert [c.index for c in out.outputs] == list(range(params.n))
    return [c.token_ids for c in out.outputs]


def test_n2_greedy_gives_two_copies_of_n1(setup):
    kw, vocab = setup
    llm = LLM(**kw)
    prompt = rand_prompt(random.Random(5), 21, vocab)  # the last prompt block is partial: shared, then copied
    params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    two = choices(llm, prompt, SamplingParams(n=2, **params))
    assert two[0] == two[1] == choices(llm, prompt, SamplingParams(n=1, **params))[0]
    assert llm.engine.scheduler.kv_cache_manager.num_cow_copies > 0


def test_n4_sampled_with_seed_is_reproducible_and_copy_on_write_keeps_choices_apart(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)
    prompt = rand_prompt(random.Random(6), 37, 512)
    params = dict(temperature=1.0, max_tokens=20, ignore_eos=True)
    four = choices(llm, prompt, SamplingParams(n=4, seed=42, **params))
    assert four == choices(llm, prompt, SamplingParams(n=4, seed=42, **params))
    assert len({tuple(c) for c in four}) > 1  # the choices really differ
    # each choice equals a lone request sampling with that choice's seed: the forked
    # sequences attended over their own K/V, never over a sibling's writes
    for i, tokens in enumerate(four):
        alone = SamplingParams(n=1, seed=SamplingParams(seed=42).choice_seed(i), **params)
        assert choices(llm, prompt, alone)[0] == tokens


def test_abort_of_a_forked_request_frees_every_block(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)
    eng = llm.engine
    rid = eng.add_request(list(range(5, 30)), SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.scheduler.num_running == 3
    assert eng.abort_request(rid).finished
    assert eng.num_free_blocks == eng.num_kv_blocks
