"""Issue 30, a real scoring client: lm-evaluation-harness (`lm_eval`,
local-completions model, remote tokenizer through /tokenize and
/tokenizer_info) runs a 16-question multiple-choice task (tests/data, no hub)
against the session SmolLM2 server, and every choice's log-likelihood it reports
equals PagedServe's offline prompt logprobs of the same tokens (within 1e-4)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from pagedserve import LLM, SamplingParams


DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tiny_mc.jsonl"


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The (context, continuation) token ids lm_eval scores: trailing spaces of
    the context move to the continuation, the continuation's ids are those of
    the whole text after the context's (lm_eval's TemplateAPI._encode_pair)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def test_lm_eval_loglikelihoods_equal_offline_prompt_logprobs(server, tmp_path):
    from pagedserve.bench.lm_eval_task import run_lm_eval

    model = httpx.get(server + "/v1/models", timeout=30).json()["data"][0]["id"]
    run = run_lm_eval(server, model, DATA, tmp_path)
    assert len(run.samples) == 16 and 0.0 <= run.accuracy <= 1.0

    llm = LLM(dtype="float32", max_model_len=2048)  # what the session server runs
    tok = llm.engine.tokenizer
    pairs, reported = [], []
    for sample in run.samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            pairs.append(encode_pair(tok, args["arg_0"], args["arg_1"]))
            reported.append(float(resp[0][0]))
    outs = llm.generate([ctx + cont for ctx, cont in pairs],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    for (ctx, cont), out, ll in zip(pairs, outs, reported):
        ours = math.fsum(e.logprob for e in out.prompt_logprobs[len(ctx):])
        assert len(out.prompt_logprobs) - len(ctx) == len(cont)
        assert abs(ours - ll) < 1e-4, (ctx, cont, ours, ll)
    # lm_eval's accuracy is the share of questions whose gold choice scored highest
    correct = 0
    for sample in run.samples:
        scores = [float(r[0][0]) for r in sample["resps"]]
        correct += scores.index(max(scores)) == sample["doc"]["answer"]
    assert run.accuracy == pytest.approx(correct / 16)
