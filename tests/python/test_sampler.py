"""Sampler: greedy, top-k / top-p masking, and seeded reproducibility whatever
else is in the batch (on the engine, with the tiny Llama)."""

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model.sampler import Sampler, apply_top_k_top_p


def test_top_k_and_top_p_masks():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, False, True, True]
    # softmax: [0.644, 0.237, 0.087, 0.032]; top_p 0.8 keeps the first two
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.8)).tolist() == [False, False, True, True]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.5)).tolist() == [False, True, True, True]


def test_greedy_rows_take_argmax_and_sampled_rows_stay_in_top_k():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    rows = [(SamplingParams(temperature=0), [None]), (SamplingParams(temperature=1.0, top_k=3), [g, g]),
            (SamplingParams(top_k=1), [None])]
    for _ in range(20):
        t = Sampler()(logits, rows)
        assert len(t) == 4  # the second row draws two tokens (a request forking into n = 2)
        assert t[0] == int(logits[0].argmax()) and t[3] == int(logits[2].argmax())
        assert set(t[1:3]) <= set(torch.topk(logits[1], 3).indices.tolist())


def test_seed_reproducible_whatever_else_is_in_the_batch(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([[11, 12, 13], prompt, list(range(20, 60))], [other, seeded, other],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == crowd
    unseeded = [llm.generate([prompt], other, use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # sampling really samples
