"""One user's time per output token (TPOT) on the engine, without HTTP: for
each configuration, a 64-word prompt is generated to 1 and to 65 tokens
(greedy, ignore_eos) in alternation, and (t65 - t1) / 64 is the decode time
per token of that round. Configurations run one after another in this
process, each over --rounds rounds after a warm-up; the median and the spread
(min - max) are printed per configuration, then each one's ratio to the first.

    python bench/decode_tpot.py [--model gemma3-270m] [--rounds 5] \\
        [--config "linear_impl=gguf" --config "linear_impl=torch" --config "dtype=bfloat16"]

A --config is comma-separated LLM keyword arguments (EngineArgs fields) with
Python literals or bare strings as values; none means the defaults. Measure
on an otherwise idle machine: a busy one inflates every figure. A checkout-only
script (not under ``pagedserve bench``).
"""
from __future__ import annotations

import argparse
import ast
import gc
import statistics
import time

from pagedserve import LLM, SamplingParams

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)  # 64 words


def parse_config(text: str) -> dict:
    """"dtype=bfloat16,num_kv_blocks=128" -> {"dtype": "bfloat16", "num_kv_blocks": 128}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def measure(model: str, config: dict, rounds: int) -> list[float]:
    """Per round, the decode milliseconds per token of one request alone."""
    llm = LLM(model=model, **{"num_kv_blocks": 256, **config})
    prompt = llm.engine.tokenizer(PROMPT)["input_ids"]

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    run(8)  # warm-up
    per_token = []
    for _ in range(rounds):
        one, full = run(1), run(65)
        per_token.append((full - one) / 64 * 1000)
    del llm
    gc.collect()
    return per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--config", action="append", default=None, help="LLM keyword arguments, k=v,k=v")
    args = ap.parse_args()
    configs = args.config or [""]
    results = []
    for text in configs:
        ms = measure(args.model, parse_config(text), args.rounds)
        results.append((text or "defaults", ms))
        print(f"{args.model} [{text or 'defaults'}]: TPOT median {statistics.median(ms):.2f} ms "
              f"(min {min(ms):.2f}, max {max(ms):.2f}, {len(ms)} rounds)", flush=True)
    base = statistics.median(results[0][1])
    for name, ms in results:
        print(f"{name}: {statistics.median(ms):.2f} ms per token, {statistics.median(ms) / base:.2f}x {results[0][0]}")


if __name__ == "__main__":
    main()
