"""Batch invariance of the default engine (issue 28, part 1): a request's logits are
the same bits whatever else its steps hold: alone, beside eleven other requests,
with its prompt cut into 16-token chunks, and on one or two threads. Checked on
the logprob of every emitted token (a function of that row's logits alone).

The default model runs on the GGUF's blocks in float32, whose GEMM sums each
output in k order whatever the call's row count (tests/cpp/test_quant_linear.cc),
and the CPU attention kernel scores each query row the same way in any tile
(tests/cpp/test_attention_cpu.cc)."""
from __future__ import annotations

import torch

from pagedserve import LLM, SamplingParams


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(5, 60, (12,), generator=g).tolist()
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]


def _run(llm: LLM, prompts: list[list[int]], batched: bool) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp.logprob for lp in c.logprobs]))
    return result


def test_default_engine_gives_each_request_the_same_logit_bits_under_any_load():
    prompts = _prompts()
    llm = LLM(enable_prefix_caching=False)
    assert llm.engine.dtype == torch.float32 and llm.engine.linear_path.startswith("gguf")
    alone = _run(llm, prompts, batched=False)
    assert _run(llm, prompts, batched=True) == alone  # all at once: one prefill of 12 prompts, then shared decodes
    del llm
    chunked = LLM(enable_prefix_caching=False, max_num_batched_tokens=16)
    assert _run(chunked, prompts, batched=True) == alone  # prompts cut at other boundaries, mixed with decodes
    del chunked
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        try:
            one = LLM(enable_prefix_caching=False)
            assert _run(one, prompts, batched=True) == alone
            del one
        finally:
            torch.set_num_threads(threads)


def test_where_the_blocks_serve_some_call_sizes_they_serve_every_size(monkeypatch):
    """A start-up measurement that gives the dense path the large calls (the blocks up to 128 rows here)
    would make a row's GEMM depend on its step's size: with batch invariance (the default) the blocks
    serve every call; --no-batch-invariant keeps the measured bound."""
    from pagedserve.model import gguf_linear

    def bounded(self, *args, **kwargs):
        self.set_max_rows(128)
        return gguf_linear.GGUFTuning({"gguf": {1: 1.0, 128: 9.0}, "dense": {1: 3.0, 128: 5.0}}, "injected")

    monkeypatch.setattr(gguf_linear.GGUFFloatMethod, "tune", bounded)
    on = LLM(enable_prefix_caching=False)
    assert "calls of every size" in on.engine.linear_path
    del on
    off = LLM(enable_prefix_caching=False, batch_invariant=False)
    assert "calls of up to 128 rows" in off.engine.linear_path
