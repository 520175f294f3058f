"""Speculative decoding (--speculative ngram, issue 28 parts 2 and 3):
prompt-lookup proposals, greedy acceptance, speculative sampling, and outputs
identical to decoding without it, with structured outputs, stop strings,
logprobs, n > 1 and preemption in the mix, in every dtype the default model is
served in.
The scheduler's side (drafts scheduled, rolled back, never cached) is
tests/cpp/test_speculative_scheduling.cc."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.engine.ngram_proposer import NgramProposer
from pagedserve.engine.spec_decode import DraftRows, SpeculativeDecoder, eligible


def test_the_proposer_takes_the_longest_most_recent_match():
    p = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    # "7 8 9" occurs at 0 and at 5: the most recent earlier occurrence (5) wins; its followers 4 5 are cut by the end
    assert p.propose([7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 7, 8, 9]) == [4, 5, 7]
    # no trigram or bigram match: the unigram 9's most recent earlier occurrence
    assert p.propose([9, 1, 2, 3, 5, 9]) == [1, 2, 3]
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([5]) == []
    assert NgramProposer(2, prompt_lookup_min=2).propose([9, 1, 2, 3, 5, 9]) == []  # unigrams not allowed
    longest = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=2)
    # the bigram "1 2" (at 3) beats the unigram "2"'s more recent occurrence (at 6)
    assert longest.propose([0, 0, 0, 1, 2, 8, 2, 5, 1, 2]) == [8, 2]
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(2, prompt_lookup_min=3, prompt_lookup_max=2)


class _Scheduler:
    def __init__(self):
        self.accepted = []

    def accept_draft_tokens(self, request_id, index, n):
        self.accepted.append((request_id, index, n))


def test_verification_keeps_the_matching_prefix_and_stops_at_a_stop_token():
    sched = _Scheduler()
    spec = SpeculativeDecoder(sched, NgramProposer(3), eos_token_ids=[2])
    vocab = 16

    def logits_for(tokens):  # one row per draft: its argmax is the model's prediction there
        x = torch.zeros(len(tokens), vocab)
        x[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return x

    greedy = SamplingParams(temperature=0, max_tokens=10)
    drafts = [DraftRows("a", 0, [5, 6, 7], [0, 1, 2]),   # the model agrees on 5, 6, not 7: keeps 5 6, samples 9
              DraftRows("b", 0, [5, 6], [3, 4]),         # all kept: the step's own token follows
              DraftRows("c", 0, [4, 2, 3], [5, 6, 7]),   # EOS (2) agreed on: it ends the sequence as the sampled token
              DraftRows("d", 0, [4, 2, 3], [8, 9, 10])]  # ignore_eos: EOS is an ordinary token
    model = [5, 6, 9] + [5, 6] + [4, 2, 3] + [4, 2, 3]
    out = spec.verify(drafts, logits_for(model), [11, 12, 13, 14],
                      [greedy, greedy, greedy, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)])
    assert [(v.accepted, v.token_id) for v in out] == [([5, 6], 9), ([5, 6], 12), ([4], 2), ([4, 2, 3], 14)]
    assert sched.accepted == [("a", 0, 2), ("b", 0, 2), ("c", 0, 1), ("d", 0, 3)]


def test_a_kept_draft_whose_text_ends_in_a_stop_string_becomes_the_sampled_token():
    """verify() gives each kept draft's text to its choice (add_text) and cuts
    there when a stop string ends: that draft is the sampled token and the
    scheduler keeps only the drafts before it, so the output ends with the text."""
    sched = _Scheduler()
    spec = SpeculativeDecoder(sched, NgramProposer(3), eos_token_ids=[2])
    rows = torch.zeros(4, 16)
    rows[torch.arange(4), torch.tensor([5, 6, 7, 8])] = 1.0  # the model agrees with every draft
    seen = []

    def add_text(token):  # a stop string completes with token 6's text
        seen.append(token)
        return token == 6

    greedy = SamplingParams(temperature=0, max_tokens=10)
    [v, w] = spec.verify([DraftRows("a", 0, [5, 6, 7], [0, 1, 2]), DraftRows("b", 0, [8], [3])], rows, [11, 12],
                         [greedy, greedy], add_text=[add_text, lambda token: False])
    assert (v.accepted, v.token_id, v.token_row, v.ended_text) == ([5], 6, 1, True)
    assert (w.accepted, w.token_id, w.ended_text) == ([8], 12, False)
    assert seen == [5, 6] and sched.accepted == [("a", 0, 1), ("b", 0, 1)]


class _Grammar:
    """A GrammarState stand-in: allows the tokens of `allowed` (any order) and
    records what it accepts."""

    def __init__(self, allowed):
        self.allowed, self.accepted = set(allowed), []

    def mask_logits(self, x):
        out = torch.full_like(x, float("-inf"))
        out[list(self.allowed)] = x[list(self.allowed)]
        return out

    def accept(self, token):
        self.accepted.append(token)
        self.allowed.discard(token)  # each token once: the state after a draft differs from the one before it
        return True


def test_a_constrained_choice_judges_each_draft_in_the_grammar_state_after_the_drafts_before_it():
    sched = _Scheduler()
    spec = SpeculativeDecoder(sched, NgramProposer(3), eos_token_ids=[2])
    greedy = SamplingParams(temperature=0, max_tokens=10)
    rows = torch.zeros(3, 16)
    rows[:, 7] = 5.0  # the unconstrained argmax everywhere: 7, which neither grammar allows
    rows[:, 4] = torch.tensor([4.0, 3.0, 3.0])
    rows[:, 5] = torch.tensor([1.0, 4.0, 1.0])
    last = torch.zeros(16)
    last[9], last[6] = 3.0, 2.0
    # a: drafts 4, 5 are the masked argmaxes in turn; once kept they leave the grammar, so the third row's masked
    # argmax is 6, and the draft 4 (forbidden now) is rejected, 6 in its place
    a = _Grammar({4, 5, 6})
    # b: every draft kept; the token after them is redrawn from the last row in the state after them (6, not 9)
    b = _Grammar({4, 5, 6})
    out = spec.verify([DraftRows("a", 0, [4, 5, 4], [0, 1, 2]), DraftRows("b", 0, [4], [3])],
                      torch.cat([rows, rows[:1]]), [9, 9], [greedy, greedy], None, [a, b], [last, last])
    assert [(v.accepted, v.token_id, v.rows, v.token_row) for v in out] == [([4, 5], 6, [0, 1], 2), ([4], 6, [3], None)]
    assert a.accepted == [4, 5] and b.accepted == [4]  # the engine advances by the sampled token itself
    unconstrained = spec.verify([DraftRows("c", 0, [4], [0])], rows[:1], [9], [greedy])[0]
    assert (unconstrained.accepted, unconstrained.token_id) == ([], 7)


def test_only_requests_with_penalties_are_not_proposed_for():
    assert eligible(SamplingParams(temperature=0))
    assert eligible(SamplingParams(temperature=0.7, top_k=20, seed=1))
    assert eligible(SamplingParams(temperature=0, logprobs=1, n=2))
    assert eligible(SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    assert not eligible(SamplingParams(temperature=0, repetition_penalty=1.2))
    assert not eligible(SamplingParams(temperature=0, frequency_penalty=0.5))


def _repetitive_prompts(n: int) -> list[list[int]]:
    """Token-id prompts that repeat a random phrase (the model tends to go on
    repeating it, so prompt lookup proposes and the model accepts), and plain
    random ones."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(n):
        phrase = torch.randint(100, 20000, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append(phrase * 4 if i % 3 else torch.randint(100, 20000, (30,), generator=g).tolist())
    return prompts


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_equal_decoding_without_speculation_beside_a_request_it_does_not_propose_for(caplog):
    prompts = _repetitive_prompts(12)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(enable_prefix_caching=False)
    want = _tokens(base.generate(prompts, greedy, use_tqdm=False))  # batched: the same as alone (batch invariance)
    # a penalty: not proposed for, so it must sample what it did without speculation
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, frequency_penalty=0.5)
    want_sampled = _tokens(base.generate(prompts[:2], sampled, use_tqdm=False))
    del base

    spec = LLM(speculative="ngram", num_speculative_tokens=4, enable_prefix_caching=True)
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        assert _tokens(spec.generate(prompts, greedy, use_tqdm=False)) == want  # all at once
    # each finished request logs its own acceptance; together they are the scheduler's counts
    found = [re.search(r"speculative decoding: (\d+) of (\d+) draft tokens accepted", r.getMessage())
             for r in caplog.records]
    counts = [(int(m[1]), int(m[2])) for m in found if m]
    assert len(counts) == len(prompts)
    assert sum(a for a, _ in counts) == spec.engine.scheduler.num_accepted_tokens
    assert sum(d for _, d in counts) == spec.engine.scheduler.num_draft_tokens
    # a seeded sampling request with a penalty in the same batches takes no drafts and samples what it did alone
    mixed = spec.generate(prompts[:6] + prompts[:2], [greedy] * 6 + [sampled] * 2, use_tqdm=False)
    assert _tokens(mixed) == want[:6] + want_sampled
    s = spec.engine.scheduler
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    metrics = spec.engine.metrics
    assert metrics.spec_decode_num_accepted_tokens._value.get() == s.num_accepted_tokens
    assert metrics.spec_decode_num_draft_tokens._value.get() == s.num_draft_tokens
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks


def test_stop_strings_and_max_tokens_end_a_speculative_output_where_they_would_without_it():
    base = LLM(enable_prefix_caching=False)
    spec = LLM(speculative="ngram", num_speculative_tokens=6, enable_prefix_caching=False)
    text = "one two three four five six seven eight nine ten. " * 3
    prompt = f"Repeat: {text}\nAgain: {text[:60]}"
    for params in (SamplingParams(temperature=0, max_tokens=30, stop=["seven"]),
                   SamplingParams(temperature=0, max_tokens=7),
                   SamplingParams(temperature=0, max_tokens=30, stop=["eight", "nine"])):
        a = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (b.text, list(b.token_ids), b.finish_reason) == (a.text, list(a.token_ids), a.finish_reason)
    assert spec.engine.scheduler.num_accepted_tokens > 0


_WORDS = "one two three four five six seven eight nine ten".split()

# the engine arguments of each dtype the default model is served in (test_batch_invariance.py's)
_DTYPES = {"float32": {}, "bfloat16": {"dtype": "bfloat16", "linear_impl": "gguf"}, "q4": {"quantization": "q4"}}


def _mixed_requests() -> tuple[list[str], list[SamplingParams]]:
    """32 prompts that quote a passage and ask for it again (prompt lookup's
    case), each with one of: a grammar (lower-case words and spaces only: a
    draft holding "." or "," is rejected by it), stop strings, logprobs with
    alternatives, n = 2, or nothing more; all greedy."""
    g = torch.Generator().manual_seed(5)
    prompts, params = [], []
    for i in range(32):
        order = torch.randperm(len(_WORDS), generator=g).tolist()
        passage = ", ".join(" ".join(_WORDS[j] for j in order[k:k + 3]) for k in range(0, 9, 3)) + "."
        prompts.append(f"Copy the text exactly.\nText: {passage} {passage}\nCopy: {passage[:12]}")
        extra = [{"structured_outputs": StructuredOutputsParams(regex="( ?[a-z]+)+")},
                 {"stop": [_WORDS[order[4]], "."]}, {"logprobs": 2}, {"n": 2}, {}][i % 5]
        params.append(SamplingParams(temperature=0, max_tokens=24, **extra))
    return prompts, params


def _choices(outs):
    return [(c.text, list(c.token_ids), c.finish_reason,
             None if c.logprobs is None else [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs])
            for o in outs for c in o.outputs]


@pytest.mark.parametrize("config", list(_DTYPES))
def test_speculation_changes_no_token_text_or_logprob_in_any_dtype(config):
    """Issue 28: greedy outputs with speculation equal those without it, for 32
    mixed requests at once (grammars, stop strings, logprobs, n = 2) through a
    pool small enough to preempt, with prompts cut into chunks (and in float32
    also through a pool with room for all)."""
    prompts, params = _mixed_requests()
    base = LLM(enable_prefix_caching=False, **_DTYPES[config])
    want = _choices(base.generate(prompts, params, use_tqdm=False))
    del base
    assert sum(1 for text, *_ in want if "seven" in text or "five" in text) > 8  # the passages are copied

    if config == "float32":  # a pool with room for all (the other dtypes: the preempting pool only, CI's time)
        spec = LLM(speculative="ngram", num_speculative_tokens=4, enable_prefix_caching=False)
        assert _choices(spec.generate(prompts, params, use_tqdm=False)) == want
        s = spec.engine.scheduler
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens
        del spec
    tiny = LLM(speculative="ngram", num_speculative_tokens=4, enable_prefix_caching=True, num_kv_blocks=40,
               max_num_batched_tokens=64, **_DTYPES[config])
    assert _choices(tiny.generate(prompts, params, use_tqdm=False)) == want
    s = tiny.engine.scheduler
    assert s.num_preemptions > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert s.kv_cache_manager.num_free_blocks == 40


def test_seeded_sampling_under_speculation_is_reproducible_and_exact_with_a_point_mass():
    spec = SpeculativeDecoder(_Scheduler(), NgramProposer(3), eos_token_ids=[2])
    certain = torch.full((3, 8), -1e4)
    certain[:, 5] = 10.0  # p(5) = 1 at every position: a draft of 5 is always kept, any other never
    hot = SamplingParams(temperature=1.0, max_tokens=10)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        out = spec.verify([DraftRows("a", 0, [5, 5, 3], [0, 1, 2])], certain, [7], [hot], [g])[0]
        assert (out.accepted, out.token_id) == ([5, 5], 5)  # the third draft (3) rejected, 5 drawn in its place
    llm = LLM(speculative="ngram", enable_prefix_caching=False)
    prompts = _repetitive_prompts(6)
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=24, ignore_eos=True)
    first = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == first
    assert llm.engine.scheduler.num_accepted_tokens > 0


def _chi_square_p_value(a: list[int], b: list[int]) -> float:
    """p-value of Pearson's chi-square test that two samples of tokens come from
    one distribution (2 x K contingency table; categories expected below 5 in
    either row pooled into one), from the chi-square survival function
    Q(df / 2, x / 2) (torch.special.gammaincc)."""
    cats = sorted(set(a) | set(b))
    na, nb = len(a), len(b)
    counts = [(a.count(c), b.count(c)) for c in cats]
    big = [(x, y) for x, y in counts if (x + y) * min(na, nb) / (na + nb) >= 5]
    small = [(x, y) for x, y in counts if (x + y) * min(na, nb) / (na + nb) < 5]
    if small:
        big.append((sum(x for x, _ in small), sum(y for _, y in small)))
    stat = 0.0
    for x, y in big:
        for obs, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    df = len(big) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_speculative_sampling_keeps_the_distribution_of_the_verified_token(tmp_path):
    """A 16-token random Llama samples 3 tokens at temperature 1 after a prompt
    that ends in its own greedy continuation (so prompt lookup's draft is a
    likely token: p(draft) ~ 0.8 here), 1,500 seeds with and without
    speculation (unigram lookup: every first token gets a one-token draft).
    The second token is the one speculative sampling decides (the draft kept
    with probability p(d), else a draw from p without d); its distribution,
    with "the draft" as a category of its own, must be the model's: Pearson's
    chi-square test of homogeneity fails the test at p < 0.001 (a correct
    engine fails 1 run in 1,000; seeded, so this run's p-value is fixed:
    0.15 here). Power, by mutation: drawing the replacement from p itself (d
    included) moves the draft's share from 0.81 to 0.88 and gives p = 3e-16;
    keeping every draft (share 1.0) fails the acceptance count first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=1.0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    lookup = NgramProposer(1, prompt_lookup_min=1)
    n = 1500
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    prompt = list(range(3, 16)) * 2
    second = {}
    for mode in ("off", "ngram"):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, speculative=mode, prompt_lookup_min=1,
                  num_speculative_tokens=1, enable_prefix_caching=False, max_num_seqs=256, num_kv_blocks=1024,
                  max_num_batched_tokens=8192)
        if mode == "off":
            greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            prompt += list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        second[mode] = [-1 if lookup.propose(prompt + [t[0]]) == [t[1]] else t[1]
                        for t in (o.outputs[0].token_ids for o in outs)]
        if mode == "ngram":
            s = llm.engine.scheduler
            assert s.num_draft_tokens >= n * 9 // 10 and 0 < s.num_accepted_tokens < s.num_draft_tokens
        del llm
    share = second["off"].count(-1) / n
    assert 0.5 < share < 0.95 and len(set(second["off"])) > 3  # the draft likely, not certain
    assert _chi_square_p_value(second["off"], second["ngram"]) > 1e-3
