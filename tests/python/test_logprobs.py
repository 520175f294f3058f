"""Engine-level logprobs: prompt logprobs (for echo) and sampled-token logprobs
equal Hugging Face's log_softmax, through chunked prefill, a warm prefix cache
and preemption (the tiny random Llama: fast, no tokenizer)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of the logits at every position."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check(out, model, num_top: int) -> None:
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    ref = hf_logprobs(model, ids)
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == len(ids) - 1
    for pos, e in enumerate(entries):  # entry pos is token pos + 1 given tokens 0..pos
        assert e.token_id == ids[pos + 1]
        assert abs(e.logprob - ref[pos, ids[pos + 1]].item()) < 1e-4
        top = torch.topk(ref[pos], num_top)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert max(abs(lp - r) for (_, lp), r in zip(e.top, top.values.tolist())) < 1e-4


def test_prompt_and_output_logprobs_through_chunks_and_a_warm_cache(tiny_llama_dir, tiny):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 33, 5)]
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=24, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # cache the prompts
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert out.num_cached_tokens == 0  # prompt logprobs need every position computed
        check(out, tiny, 3)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None and plain.outputs[0].logprobs is None


def test_prompt_logprobs_survive_preemption(tiny_llama_dir, tiny):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(6)]
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=14, block_size=16,
              skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for out in outs:
        check(out, tiny, 1)
