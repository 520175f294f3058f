"""Issue 33 part 3, the engine side: embedding requests are prefill-only
requests through the same scheduler (PoolingParams). Their pooled final
hidden states equal the Hugging Face model's (last token or mean, normalised)
through chunked prefill, preemption and prefix-cache hits, beside generation
requests that keep their own tokens; an aborted one gives back its blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM, PoolingParams, SamplingParams
from pagedserve.engine.outputs import PoolingRequestOutput

LENGTHS = (5, 40, 70)  # tokens: inside one block, across blocks, across several 16-token chunks


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _reference(model_dir: str, prompts: list[list[int]], pooling_type: str) -> list[torch.Tensor]:
    """The Hugging Face decoder's final hidden states (after its last norm),
    one prompt at a time, pooled and normalised in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
            out.append(F.normalize(h[-1] if pooling_type == "last" else h.mean(0), dim=-1).float())
    return out


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    """Prompts prefilled in 16-token chunks."""
    return LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_pooled_hidden_states_equal_hugging_face(tiny_llm, tiny_llama_dir, pooling_type):
    prompts = _prompts(512)
    outs = tiny_llm.embed(prompts, PoolingParams(pooling_type), use_tqdm=False)
    ref = _reference(tiny_llama_dir, prompts, pooling_type)
    for out, want, ids in zip(outs, ref, prompts):
        assert isinstance(out, PoolingRequestOutput) and out.finish_reason == "stop"
        assert out.prompt_token_ids == ids and out.embedding.dtype == torch.float32
        assert abs(out.embedding.norm().item() - 1) < 1e-6
        torch.testing.assert_close(out.embedding, want, atol=1e-5, rtol=0)
    assert tiny_llm.engine.num_free_blocks == tiny_llm.engine.num_kv_blocks


def test_unnormalised_mean_is_the_mean(tiny_llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    ids = _prompts(512)[1]
    out = tiny_llm.embed([ids], PoolingParams("mean", normalize=False), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0)
    torch.testing.assert_close(out.embedding, want, atol=1e-5, rtol=1e-5)
    assert abs(out.embedding.norm().item() - 1) > 1e-3  # not normalised


def test_prefix_cache_hit_skips_compute_for_last_pooling_only(tiny_llm):
    ids = _prompts(512, seed=4)[2]  # 70 tokens: 4 full 16-token blocks, not embedded before
    first, second = (tiny_llm.embed([ids], use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    torch.testing.assert_close(second.embedding, first.embedding, atol=1e-5, rtol=0)
    # mean pooling needs every position's hidden state: it reads no cached blocks
    means = [tiny_llm.embed([ids], PoolingParams("mean"), use_tqdm=False)[0] for _ in range(2)]
    assert [m.num_cached_tokens for m in means] == [0, 0]
    torch.testing.assert_close(means[1].embedding, means[0].embedding, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_preempted_and_batched_with_generation(tiny_llama_dir, pooling_type):
    """An 8-block pool (128 tokens) with three embedding prompts and two
    generation requests at once: requests are preempted mid-prefill; every
    embedding equals the one computed alone in a roomy pool, and the
    generated tokens equal those generated alone."""
    prompts = _prompts(512)
    roomy = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16)
    alone = [roomy.embed([p], PoolingParams(pooling_type), use_tqdm=False)[0].embedding for p in prompts]
    gen_params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gen_prompts = [prompts[1][:20], prompts[2][:30]]
    gen_alone = [roomy.generate([p], gen_params, use_tqdm=False)[0].outputs[0].token_ids for p in gen_prompts]
    del roomy

    tight = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16,
                num_kv_blocks=8, enable_prefix_caching=False)
    eng = tight.engine
    gen_ids = [eng.add_request(p, gen_params) for p in gen_prompts]
    emb_ids = [eng.add_request(p, PoolingParams(pooling_type)) for p in prompts]
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert eng.num_preemptions > 0
    for rid, want in zip(emb_ids, alone):
        torch.testing.assert_close(final[rid].embedding, want, atol=1e-5, rtol=0)
    assert [final[rid].outputs[0].token_ids for rid in gen_ids] == gen_alone
    assert eng.num_free_blocks == eng.num_kv_blocks


def test_abort_mid_prefill_frees_every_block(tiny_llm):
    eng = tiny_llm.engine
    rid = eng.add_request(_prompts(512, seed=5)[2], PoolingParams())  # not in the prefix cache
    eng.step()  # the first 16-token chunk
    assert eng.num_free_blocks < eng.num_kv_blocks
    out = eng.abort_request(rid)
    assert isinstance(out, PoolingRequestOutput) and out.finish_reason == "abort" and out.embedding is None
    assert eng.num_free_blocks == eng.num_kv_blocks and not eng.has_unfinished_requests()


def test_bad_pooling_params_and_prompts():
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("cls")


def test_prompt_must_leave_one_token(tiny_llm):
    with pytest.raises(ValueError, match="one token of max_model_len"):
        tiny_llm.embed([[5] * tiny_llm.engine.max_model_len], use_tqdm=False)
    with pytest.raises(ValueError):
        tiny_llm.embed([[]], use_tqdm=False)
    for bad in ([1.5, 2], [True, 3]):
        with pytest.raises(ValueError, match="integers"):
            tiny_llm.embed([bad], use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_engine_default_pooling_is_embedding_pooling(tiny_llama_dir, tiny_llm):
    ids = _prompts(512)[1]
    mean_llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, embedding_pooling="mean")
    by_default = mean_llm.embed([ids], use_tqdm=False)[0].embedding
    torch.testing.assert_close(by_default, tiny_llm.embed([ids], PoolingParams("mean"), use_tqdm=False)[0].embedding,
                               atol=1e-5, rtol=0)
    assert (by_default - tiny_llm.embed([ids], use_tqdm=False)[0].embedding).abs().max() > 1e-3  # last differs
