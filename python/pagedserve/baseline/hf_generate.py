"""Hugging Face ``generate()`` baselines: one prompt at a time (sequential) and
one padded batch (static batching). References for tests and benchmarks, never
used in the serving path."""

from __future__ import annotations

import torch

# generate() with no EOS at all: it never stops early and never masks EOS, so
# EOS is a token like any other, as ignore_eos means in PagedServe and vLLM
# (min_new_tokens would instead forbid EOS: another greedy sequence whenever
# EOS is the argmax).
_IGNORE_EOS = {"eos_token_id": []}


@torch.inference_mode()
def generate_sequential(model, prompts: list[list[int]], max_new_tokens: int,
                        ignore_eos: bool = True) -> list[list[int]]:
    """Greedy ``generate()`` per prompt. prompts: token-id lists. Returns the new token ids per prompt."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        kw = _IGNORE_EOS if ignore_eos else {}
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                           do_sample=False, pad_token_id=model.generation_config.pad_token_id or 0, **kw)
        outs.append(y[0, len(ids):].tolist())
    return outs


@torch.inference_mode()
def generate_static_batch(model, prompts: list[list[int]], max_new_tokens: int,
                          pad_token_id: int = 0) -> list[list[int]]:
    """Greedy ``generate()`` on one left-padded batch, EOS ignored (every row runs
    max_new_tokens steps: static batching). Returns the new token ids per prompt."""
    width = max(len(p) for p in prompts)
    x = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    y = model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                       pad_token_id=pad_token_id, **_IGNORE_EOS)
    return y[:, width:].tolist()
