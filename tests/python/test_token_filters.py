"""Issue 30 part 2 at the engine: bad words, allowed_token_ids and min_tokens
hold for every choice of n > 1, greedy and sampled, through a KV pool small
enough to preempt (the tiny random Llama: fast, no tokenizer, so bad words go
in as token ids)."""

from __future__ import annotations

import random

from pagedserve import LLM, SamplingParams


def contains(seq: list[int], word: list[int]) -> bool:
    return any(seq[i:i + len(word)] == word for i in range(len(seq) - len(word) + 1))


def test_filters_hold_for_every_choice_under_preemption(tiny_llama_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(30)] for _ in range(6)]
    roomy = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)
    free = [o.outputs[0].token_ids for o in roomy.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    tight = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=12, block_size=16,
                skip_tokenizer_init=True)
    params = []
    for i, out in enumerate(free):
        bad = [[out[0]], out[3:5]]  # the greedy first token, and a two-token sequence it produced
        allowed = sorted(set(rng.sample(range(3, 512), 40)) | set(out[:2]))
        kind = i % 3
        params.append(SamplingParams(
            n=2, temperature=0 if i % 2 else 0.8, seed=i, max_tokens=24, ignore_eos=True,
            bad_words_token_ids=bad if kind == 0 else None,
            allowed_token_ids=allowed if kind == 1 else None,
            min_tokens=12 if kind == 2 else 0, stop_token_ids=[out[5]] if kind == 2 else []))
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    for i, (out, p, greedy) in enumerate(zip(outs, params, free)):
        assert len(out.outputs) == 2
        for c in out.outputs:
            ids = c.token_ids
            if p.bad_words_token_ids:
                assert ids and not any(contains(ids, w) for w in p.bad_words_token_ids), (i, ids)
            if p.allowed_token_ids:
                assert len(ids) == 24 and set(ids) <= set(p.allowed_token_ids)
            if p.min_tokens:
                assert 12 <= len(ids) and (len(ids) == 24 or ids[-1] == greedy[5])
        if p.bad_words_token_ids and p.temperature == 0:
            assert out.outputs[0].token_ids[0] != greedy[0]  # the greedy first token was taken away
    # without min_tokens the stop token ends the greedy output at once
    plain = roomy.generate([prompts[5]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[5][5]]),
                           use_tqdm=False)[0].outputs[0]
    assert len(plain.token_ids) <= 6
