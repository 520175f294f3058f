"""What scoring a prompt costs (issue 30: prompt_logprobs never read the prefix
cache, every position's logits are computed): one request of --prompt-len
tokens, max_tokens 1, timed cold (nothing cached), as a prefix-cache hit, and
with prompt_logprobs (same prompt, cached: the cache is not read). Rounds
alternate; the median and spread per case are printed, and the ratios.

    python bench/prompt_logprobs_cost.py [--prompt-len 1024] [--rounds 5] [--dtype float32]

A checkout-only script. Measure on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=args.prompt_len + 16)
    rng = random.Random(0)
    vocab = llm.engine.model.config.vocab_size

    def timed(ids, params) -> float:
        t = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        return time.perf_counter() - t

    plain, scored = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1, prompt_logprobs=0)
    timed([rng.randrange(100, vocab) for _ in range(args.prompt_len)], plain)  # warm-up
    cases = {"cold": [], "cache hit": [], "prompt_logprobs": []}
    for _ in range(args.rounds):
        ids = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]  # a fresh prompt each round
        cases["cold"].append(timed(ids, plain))
        cases["cache hit"].append(timed(ids, plain))
        cases["prompt_logprobs"].append(timed(ids, scored))
    base = statistics.median(cases["cold"])
    for name, times in cases.items():
        med = statistics.median(times)
        print(f"{name:<16} median {med * 1000:8.1f} ms  (spread {min(times) * 1000:.1f}-{max(times) * 1000:.1f})"
              f"  {med / base:.2f}x cold")


if __name__ == "__main__":
    main()
