"""Greedy outputs of the paged engine (default: C++ CPU attention kernel,
oneDNN linear layers) equal Hugging Face generate() run one prompt at a time,
whatever the batch, chunking or preemption; and every KV block comes back."""

import random

import pytest

from pagedserve import LLM, SamplingParams
from conftest import hf_greedy

PROMPT_LENS = [3, 17, 40, 64, 95, 130, 9, 200]  # several longer than the 64-token chunk


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def run(llm: LLM, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    prompts = make_prompts(512)
    return prompts, hf_greedy(tiny_llama_dir, prompts, 24)


def test_tiny_llama_batched_and_chunked_equals_hf(tiny_llama_dir, tiny_reference):
    prompts, want = tiny_reference
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=64, skip_tokenizer_init=True)
    assert run(llm, prompts, 24) == want
    assert llm.engine.num_preemptions == 0


@pytest.mark.parametrize("block_size", [16, 32])
def test_tiny_llama_with_preemption_equals_hf(tiny_llama_dir, tiny_reference, block_size):
    prompts, want = tiny_reference
    # 224 tokens of KV: the 200+24-token request just fits, all 8 together do not
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=224 // block_size,
              block_size=block_size, skip_tokenizer_init=True)
    assert run(llm, prompts, 24) == want
    assert llm.engine.num_preemptions > 0


def test_abort_in_every_state_frees_all_blocks(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=32, max_num_seqs=2, skip_tokenizer_init=True)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [eng.add_request(list(range(3, 3 + n)), params) for n in (100, 5, 7)]
    eng.step()  # ids[0] prefilling (chunk of 32), others waiting
    assert eng.num_free_blocks < eng.num_kv_blocks
    assert eng.abort_request(ids[0]).outputs[0].finish_reason == "abort"  # mid-prefill
    eng.step()
    eng.step()  # ids[1], ids[2] decoding
    assert eng.abort_request(ids[1]) is not None
    waiting = eng.add_request([5, 6, 7], params)
    assert eng.abort_request(waiting) is not None  # never scheduled
    assert eng.abort_request("no-such-request") is None
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.num_free_blocks == eng.num_kv_blocks


def test_rejected_requests_leave_nothing_behind(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=4, max_model_len=100, skip_tokenizer_init=True)
    for prompt, mt in [([], 4), (list(range(3, 99)), 8), (list(range(3, 70)), 1), ([3, 600], 2)]:
        with pytest.raises(ValueError):
            llm.generate([prompt], SamplingParams(max_tokens=mt), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == 4


def test_smollm2_batched_chunked_preempted_equals_hf(smollm2_dir):
    prompts = make_prompts(49152, seed=1)
    want = hf_greedy(smollm2_dir, prompts, 12)
    llm = LLM(dtype="float32", max_num_batched_tokens=64)
    assert run(llm, prompts, 12) == want
    # all 8 together need 44 blocks of 16; 24 blocks hold the largest (212 tokens)
    # but not all at once: preemption
    small = LLM(dtype="float32", max_num_batched_tokens=64, num_kv_blocks=24)
    assert run(small, prompts, 12) == want
    assert small.engine.num_preemptions > 0


def test_smollm2_cpu_kernel_equals_torch_reference_backend(smollm2_dir):
    prompts = make_prompts(49152, seed=2)
    cpu_out = run(LLM(dtype="float32", max_num_batched_tokens=64), prompts, 10)
    torch_out = run(LLM(dtype="float32", max_num_batched_tokens=64, attention_backend="torch"), prompts, 10)
    assert cpu_out == torch_out


def test_the_model_reads_its_kv_only_from_the_paged_store(tiny_llama_dir):
    """Wiping the paged store in the middle of a generation changes what follows:
    decode steps attend over our blocks, not over any cache of Hugging Face's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = list(range(10, 60))

    def generate(wipe_after_steps=None):
        eng = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True).engine
        eng.add_request(prompt, params, "r")
        tokens, steps = [], 0
        while eng.has_unfinished_requests():
            tokens += [t for o in eng.step() for t in o.outputs[0].delta_token_ids]
            steps += 1
            if steps == wipe_after_steps:
                assert eng.kv_cache.store.abs().sum() > 0  # the prompt's K/V are in our store
                eng.kv_cache.store.zero_()
        return tokens

    assert generate() == generate()
    assert generate(wipe_after_steps=3) != generate()


def test_bfloat16_engine_runs_on_both_backends(tiny_llama_dir, tiny_reference):
    prompts, want = tiny_reference
    outs = {b: run(LLM(model=tiny_llama_dir, dtype="bfloat16", max_num_batched_tokens=64, skip_tokenizer_init=True,
                       attention_backend=b), prompts, 24) for b in ("cpu", "torch")}
    assert all(len(o) == 24 for o in outs["cpu"])
    # bfloat16 rounds differently from the float32 reference: most, not all, tokens
    # agree (seen: 152 of 192; a broken path would agree on ~1 in 512); the two
    # backends see the same bfloat16 inputs and agree far more (seen: 192 of 192)
    total = 24 * len(prompts)
    assert sum(a == b for x, y in zip(outs["cpu"], want) for a, b in zip(x, y)) >= 0.5 * total
    assert sum(a == b for x, y in zip(outs["cpu"], outs["torch"]) for a, b in zip(x, y)) >= 0.9 * total


def test_a_request_that_fails_to_build_leaves_nothing_in_the_scheduler(tiny_llama_dir, monkeypatch):
    from pagedserve.engine import llm_engine

    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True)

    def broken(*args, **kwargs):
        raise RuntimeError("request state failure")

    monkeypatch.setattr(llm_engine.Request, "create", broken)
    with pytest.raises(RuntimeError):
        llm.engine.add_request([5, 6, 7], SamplingParams(seed=3))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
