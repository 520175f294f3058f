"""Greedy rows' output layer (GGUFFloatLinear.greedy_logits, the C++ in
csrc/backends/cpu/gemm/greedy_logits.h): an int8 pass with a worst-case error
bound per output picks the outputs that could be a row's maximum, and only
those are computed exactly. On the default model's Q8_0 output layer and its
own hidden states the kept values are the full layer's bit for bit, the argmax
is the same and most of the vocabulary is skipped; the engine takes that path
only for rows that read nothing but their argmax, and its greedy tokens equal
the full layer's."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model import gguf_linear
from pagedserve.model.gguf_linear import GGUFFloatLinear
from pagedserve.model.runner import ModelRunner
from pagedserve.model.sampler import Sampler, SamplingRow

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "List three colours:", "Translate to French: good morning", "1, 2, 3, 4,", "Once upon a time",
           "The largest planet is"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", enable_prefix_caching=False, num_kv_blocks=128)


def _hidden_states(llm, monkeypatch) -> torch.Tensor:
    """The final hidden states the engine's output layer saw while greedy-decoding PROMPTS (float32)."""
    seen = []
    compute = ModelRunner.compute_logits

    def spy(self, hidden, argmax_only=False):
        seen.append(hidden.detach().clone())
        return compute(self, hidden, argmax_only)

    monkeypatch.setattr(ModelRunner, "compute_logits", spy)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    monkeypatch.undo()
    return torch.cat(seen).float().contiguous()


def test_kept_logits_are_the_full_layers_and_the_argmax_is_the_same(llm, monkeypatch):
    """On the model's own hidden states: every finite value equals linear_f32's bit for bit, every -inf
    stands where linear_f32's value is below its row's maximum, argmax per row is the same, and more than
    99% of the vocabulary is skipped (the path does skip work)."""
    head = llm.engine.runner.lm_head
    assert isinstance(head, GGUFFloatLinear) and head.prunes_greedy_logits, "the default output layer is Q8_0 blocks"
    hidden = _hidden_states(llm, monkeypatch)
    assert hidden.shape[0] >= 2 * len(PROMPTS)
    full = head(hidden)
    got = head.greedy_logits(hidden)
    kept = torch.isfinite(got)
    assert torch.equal(got[kept].view(torch.int32), full[kept].view(torch.int32))
    row_max = full.max(dim=1, keepdim=True).values
    assert bool((full[~kept] < row_max.expand_as(full)[~kept]).all()), "a row maximum was skipped"
    assert torch.equal(got.argmax(dim=1), full.argmax(dim=1))
    assert kept.float().mean().item() < 0.01, f"kept {kept.float().mean().item():.3%} of the logits"
    # one row: the full layer (no faster there)
    assert torch.equal(head.greedy_logits(hidden[:1]), full[:1])


def test_the_engine_prunes_only_rows_that_read_just_their_argmax(llm, monkeypatch):
    """Greedy decoding takes the pruned output layer and gives the tokens of the full one; a request that
    asks for logprobs or samples at a temperature gets the full layer."""
    calls = []
    greedy_logits = GGUFFloatLinear.greedy_logits

    def spy(self, x):
        calls.append(x.shape[0])
        return greedy_logits(self, x)

    monkeypatch.setattr(gguf_linear.GGUFFloatLinear, "greedy_logits", spy)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    pruned = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert calls and max(calls) == len(PROMPTS), "greedy decoding did not take the pruned output layer"
    monkeypatch.setattr(Sampler, "takes_only_argmax", staticmethod(lambda rows: False))
    full = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert pruned == full
    monkeypatch.undo()
    monkeypatch.setattr(gguf_linear.GGUFFloatLinear, "greedy_logits", spy)
    calls.clear()
    with_logprobs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in with_logprobs] == [t[:8] for t in full]
    assert all(len(lp.top) == 2 and all(v > float("-inf") for _, v in lp.top)
               for o in with_logprobs for lp in o.outputs[0].logprobs)
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=8, seed=1), use_tqdm=False)
    assert calls == [], "rows that read more than their argmax took the pruned layer"


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=0), True),
    (SamplingParams(temperature=0, n=2), True),
    (SamplingParams(temperature=0, logprobs=0), False),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0, logit_bias={5: 1.0}), False),
    (SamplingParams(temperature=0, min_tokens=3), False),
])
def test_takes_only_argmax_names_the_rows_that_read_nothing_else(params, expected):
    row = SamplingRow(params, [None] * params.n, [1, 2, 3], [[] for _ in range(params.n)])
    assert Sampler.takes_only_argmax([row]) is expected
    assert Sampler.takes_only_argmax([SamplingRow(SamplingParams(temperature=0), [None], [1], [[]]), row]) is expected
