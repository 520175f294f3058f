"""Sampler: greedy, penalties, min-p / top-k / top-p masking, raw logprobs,
prompt logprobs, SamplingParams validation, and seeded reproducibility whatever
else is in the batch (on small logits tensors, and on the engine with the tiny
Llama)."""

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model.sampler import (Sampler, SamplingRow, apply_min_p, apply_penalties,
                                      apply_top_k_top_p, compute_prompt_logprobs)


def row(params, n=1, gen=None, prompt=(), outputs=None):
    """A SamplingRow drawing n tokens (all with generator gen)."""
    return SamplingRow(params, [gen] * n, list(prompt), outputs if outputs is not None else [[]] * n)


def greedy_token(logits, params, prompt=(), output=()):
    return Sampler()(torch.tensor([logits]), [row(params, prompt=prompt, outputs=[list(output)])]).token_ids[0]


def test_top_k_and_top_p_masks():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, False, True, True]
    # softmax: [0.644, 0.237, 0.087, 0.032]; top_p 0.8 keeps the first two
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.8)).tolist() == [False, False, True, True]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.5)).tolist() == [False, True, True, True]


def test_greedy_rows_take_argmax_and_sampled_rows_stay_in_top_k():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=1.0, top_k=3), 2, g),
            row(SamplingParams(top_k=1))]
    for _ in range(20):
        t = Sampler()(logits, rows).token_ids
        assert len(t) == 4  # the second row draws two tokens (a request forking into n = 2)
        assert t[0] == int(logits[0].argmax()) and t[3] == int(logits[2].argmax())
        assert set(t[1:3]) <= set(torch.topk(logits[1], 3).indices.tolist())


def test_greedy_token_is_torch_argmax_on_ties_nan_and_inf():
    """The batched greedy pick is torch.argmax's: the first maximum of a row,
    NaN counting as the maximum (the sampler computes it with numpy)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (6, 4096), generator=g).float()  # many ties at the maximum
    logits[1, 100], logits[1, 5] = float("nan"), float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    logits[4, ::2] = float("inf")
    rows = [row(SamplingParams(temperature=0)) for _ in range(6)]
    got = Sampler()(logits, rows).token_ids
    assert got == torch.argmax(logits, dim=-1).tolist()
    assert got[1] == 5 and got[2] == 7 and got[3] == 0 and got[4] == 0


def test_seed_reproducible_whatever_else_is_in_the_batch(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([[11, 12, 13], prompt, list(range(20, 60))], [other, seeded, other],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == crowd
    unseeded = [llm.generate([prompt], other, use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # sampling really samples


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    # positive: token 0 (2.0) seen in the prompt -> 2.0 / 2 = 1.0 < 1.5
    pos = [2.0, 1.5, 0.0]
    assert greedy_token(pos, SamplingParams(temperature=0)) == 0
    assert greedy_token(pos, SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0]) == 1
    assert greedy_token(pos, SamplingParams(temperature=0, repetition_penalty=2.0), output=[0]) == 1
    assert greedy_token(pos, SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0]) == 0  # 1.67 > 1.5
    # negative: -1.0 * 2 = -2.0 < -1.2 (dividing would have raised it to -0.5)
    neg = [-1.0, -1.2, -3.0]
    assert greedy_token(neg, SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 0]) == 1
    # exact values: each distinct seen token once, whatever its count
    p = SamplingParams(repetition_penalty=2.0)
    prompt_mask = torch.tensor([True, False, False, False])
    out = apply_penalties(torch.tensor([2.0, 1.0, -1.0, -3.0]), prompt_mask, [2, 2, 2], p)
    assert out.tolist() == [1.0, 1.0, -2.0, -3.0]
    # penalty < 1 favours repeats
    assert greedy_token([1.0, 1.5], SamplingParams(temperature=0, repetition_penalty=0.5), prompt=[0]) == 0


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = [3.0, 2.5, 2.0, 0.0]
    assert greedy_token(logits, SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0),
                        prompt=[0, 0, 0]) == 0  # the prompt does not count
    freq = SamplingParams(temperature=0, frequency_penalty=0.4)
    assert greedy_token(logits, freq, output=[0]) == 0  # 3.0 - 0.4 = 2.6 > 2.5
    assert greedy_token(logits, freq, output=[0, 0]) == 1  # 3.0 - 0.8 = 2.2 < 2.5
    pres = SamplingParams(temperature=0, presence_penalty=0.4)
    assert greedy_token(logits, pres, output=[0, 0, 0]) == 0  # once, whatever the count: 2.6
    assert greedy_token(logits, SamplingParams(temperature=0, presence_penalty=0.6), output=[0]) == 1  # 2.4
    assert greedy_token(logits, SamplingParams(temperature=0, presence_penalty=-0.6), output=[1]) == 1  # 3.1
    both = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(torch.tensor(logits), None, [1, 0, 1, 1], both)
    assert out.tolist() == [3.0 - 0.5 - 0.25, 2.5 - 1.5 - 0.25, 2.0, 0.0]


def test_each_draw_is_penalised_with_its_own_output():
    # one row forking into 3 choices: their histories differ, so do their argmaxes
    # (third: 3.0 - 1.2 = 1.8, 2.5 - 0.8 = 1.7 < 2.0)
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]])
    r = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.4), [None] * 3, [], [[], [0, 0], [0, 0, 0, 1, 1]])
    assert Sampler()(logits, [r]).token_ids == [0, 1, 2]


def test_min_p_masks_tokens_below_the_threshold_after_temperature():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log()
    # T = 1, min_p 0.15: threshold 0.075 drops tokens 3 and 4
    assert torch.isinf(apply_min_p(logits, 0.15)).tolist() == [False, False, False, True, True]
    g = torch.Generator().manual_seed(0)
    seen = set(Sampler()(logits[None], [row(SamplingParams(min_p=0.15), 2000, g)]).token_ids)
    assert seen == {0, 1, 2}
    # T = 2 flattens the distribution (p ~ sqrt(p): token 3 at 0.35 of the max, token 4 at 0.28):
    # min_p 0.3 then keeps token 3, which it would drop before the temperature
    seen = set(Sampler()(logits[None], [row(SamplingParams(temperature=2.0, min_p=0.3), 2000, g)]).token_ids)
    assert seen == {0, 1, 2, 3}


def test_seeded_draws_identical_whatever_else_is_in_the_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01, seed=7)
    penalised = SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.3, seed=8)

    def draw(rows, logits):
        return Sampler()(logits, rows).token_ids

    gens = lambda s: [torch.Generator().manual_seed(s), torch.Generator().manual_seed(s + 1)]  # noqa: E731
    alone = draw([SamplingRow(seeded, gens(7), [1, 2], [[], []]),
                  SamplingRow(penalised, gens(8), [3, 4], [[5], [5, 6]])], logits[1:3])
    other = SamplingParams(temperature=1.0)
    crowd = draw([row(other, 3), SamplingRow(seeded, gens(7), [1, 2], [[], []]),
                  SamplingRow(penalised, gens(8), [3, 4], [[5], [5, 6]]), row(SamplingParams(temperature=0))], logits)
    assert crowd[3:7] == alone
    unseeded = {tuple(draw([row(other, 5)], logits[:1])) for _ in range(3)}
    assert len(unseeded) > 1  # sampling really samples


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    g = torch.Generator().manual_seed(1)
    rows = [row(SamplingParams(temperature=0.7, logprobs=5, frequency_penalty=1.0), 2, g, outputs=[[1, 2], [3]]),
            row(SamplingParams(logprobs=None), 1, g),
            row(SamplingParams(temperature=0, logprobs=0), 1)]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == 4
    for k, i in [(0, 0), (1, 0), (3, 2)]:
        assert out.logprobs[k] == pytest.approx(float(raw[i, out.token_ids[k]]), abs=1e-5)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[3] == []
    top = out.top_logprobs[0]
    assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert [t for t, _ in top] == torch.topk(raw[0], 5).indices.tolist()
    assert all(v == pytest.approx(float(raw[0, t]), abs=1e-5) for t, v in top)
    assert out.top_logprobs[1] == top


def test_sampled_token_logprob_present_outside_the_top_n_and_unpenalised():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0]])
    # repetition penalty 2 on tokens 0 and 1: [1.5, 1.45, 2.8, 0] -> greedy picks token 2, not in the top 1
    r = row(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1), prompt=[0, 1])
    out = Sampler()(logits, [r])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [2]
    assert out.logprobs == [pytest.approx(float(raw[2]), abs=1e-6)]  # raw: before the penalty
    assert out.top_logprobs == [[(0, pytest.approx(float(raw[0]), abs=1e-6))]]


def test_no_logprobs_requested_gives_none():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [row(SamplingParams(temperature=0), 2), row(SamplingParams(), 1)])
    assert out.logprobs == [None] * 3 and out.top_logprobs == [None] * 3


def test_compute_prompt_logprobs_matches_a_direct_computation():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 2
    targets = torch.tensor([3, 0, 39, 7, 7, 12])
    lp, top, rank = compute_prompt_logprobs(logits, targets, 4)
    for t in range(6):
        row_lp = [math.log(e) for e in torch.softmax(logits[t].double(), 0).tolist()]
        assert lp[t] == pytest.approx(row_lp[targets[t]], abs=1e-5)
        assert rank[t] == 1 + sum(v > row_lp[targets[t]] for v in row_lp)
        best = sorted(range(40), key=lambda v: row_lp[v], reverse=True)[:4]
        assert [i for i, _ in top[t]] == best
        assert [v for _, v in top[t]] == pytest.approx([row_lp[i] for i in best], abs=1e-5)
    assert compute_prompt_logprobs(logits, targets, 0)[1] == [[]] * 6
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, targets[:5], 1)


def test_rows_must_match_the_logits():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [row(SamplingParams())])
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(torch.zeros(1, 5), [SamplingRow(SamplingParams(), [None, None], [], [[]])])


@pytest.mark.parametrize("field, bad", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("nan")),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 2.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", 21)])
def test_sampling_params_rejects_out_of_range_values(field, bad):
    with pytest.raises(ValueError, match=f"{field}.*{bad}"):
        SamplingParams(**{field: bad})


def test_sampling_params_accepts_range_ends():
    for kw in [dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(repetition_penalty=2.0),
               dict(min_p=0.0), dict(min_p=1.0), dict(logprobs=0, prompt_logprobs=20)]:
        SamplingParams(**kw)
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(temperature=0, frequency_penalty=1.0).greedy


def test_token_filters_mask_bias_and_hold_back_stop_tokens_until_min_tokens():
    from pagedserve.model.sampler import apply_token_filters

    x = torch.arange(8, dtype=torch.float32)
    p = SamplingParams(temperature=0, allowed_token_ids=[1, 5], logit_bias={1: 10.0}, max_tokens=4)
    y = apply_token_filters(x, p, [], eos_token_ids=[7])
    assert y[1] == 11.0 and y[5] == 5.0 and torch.isinf(y[[0, 2, 3, 4, 6, 7]]).all() and x[0] == 0.0
    held = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6], max_tokens=4)
    assert int(torch.argmax(apply_token_filters(x, held, [3], eos_token_ids=[7]))) == 5  # EOS 7 and stop 6 masked
    assert int(torch.argmax(apply_token_filters(x, held, [3, 4], eos_token_ids=[7]))) == 7  # min_tokens reached
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, max_tokens=4)
    assert int(torch.argmax(apply_token_filters(x, ignoring, [], eos_token_ids=[7]))) == 7  # EOS is no stop here
    rows = [SamplingRow(held, [None], [], [[3]])]
    assert Sampler([7])(x[None], rows).token_ids == [5]
    with pytest.raises(ValueError):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={1: 100.5})
    with pytest.raises(ValueError):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_mask_a_last_token_only_after_the_tokens_before_it():
    from pagedserve.model.sampler import apply_token_filters

    x = torch.arange(8, dtype=torch.float32)
    p = SamplingParams(temperature=0, bad_words_token_ids=[[6], [2, 3, 7]])
    assert p.has_token_filters
    masked = lambda out: torch.isinf(apply_token_filters(x, p, out, [])).nonzero().flatten().tolist()  # noqa: E731
    assert masked([]) == [6]  # a one-token word: always
    assert masked([2]) == [6] and masked([3]) == [6]  # the prefix not complete yet
    assert masked([5, 2, 3]) == [6, 7]  # ... and here it is: 7 would end the word
    assert masked([2, 3, 1]) == [6]
    with pytest.raises(ValueError):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError):
        SamplingParams(bad_words=["  "])


def test_filters_that_leave_no_token_end_the_choice_as_at_eos():
    x = torch.arange(8, dtype=torch.float32)
    p = SamplingParams(temperature=0, allowed_token_ids=[5], bad_words_token_ids=[[5]])
    assert Sampler([7])(x[None], [SamplingRow(p, [None], [], [[]])]).token_ids == [7]
    sampled = SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[5], bad_words_token_ids=[[5]])
    assert Sampler([7])(x[None], [SamplingRow(sampled, [torch.Generator().manual_seed(1)], [], [[]])]).token_ids == [7]
