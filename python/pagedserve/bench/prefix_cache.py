"""Prefix caching: TTFT and total time with caching on versus off, in one run.

N requests (default 32) share a SYSTEM_LEN-token system prompt (default 1024)
followed by a different QUESTION_LEN-token question (default 32), and generate
OUTPUT_LEN tokens (default 16, greedy, EOS ignored, float32) on SmolLM2. They
are sent one after another (each request's time to first token is its own
prefill, not queueing behind others). With caching on, the first request
computes the system prompt and the others reuse its KV blocks. Prints TTFT
median / p90 and total time of each mode, the ratio, and checks that both
modes produced the same tokens.

    pagedserve bench prefix-cache [--num-requests 32] [--system-len 1024] [--question-len 32] [--output-len 16]
                                [--plot PATH]

(from a checkout, ``python bench/prefix_cache.py`` takes the same flags)

--plot PATH also writes the table as a PNG figure (needs matplotlib, the
``bench`` extra): TTFT median / p90 and total time, caching off vs on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.experiments import plots


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], float, list[list[int]], int]:
    """Serves the prompts one at a time; returns (TTFTs in s, total s, token ids, cached prompt tokens)."""
    eng = llm.engine
    ttfts, tokens, cached = [], [], 0
    t0 = time.perf_counter()
    for p in prompts:
        rid = eng.add_request(p, params)
        final = None
        while final is None:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    final = out
        ttfts.append(final.first_token_time - final.arrival_time)
        tokens.append(final.outputs[0].token_ids)
        cached += final.num_cached_tokens
    return ttfts, time.perf_counter() - t0, tokens, cached


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def plot(results: dict[str, tuple[list[float], float, list[list[int]], int]], path: str, title: str = "") -> str:
    """Writes a two-panel bar PNG to path and returns path. Left: time to first
    token, median and p90 (ms), prefix caching off vs on; right: total time of all
    requests (s). results: mode ("off" / "on") -> the tuple :func:`run` returns."""
    modes = [m for m in ("off", "on") if m in results]
    fig, (ttft_ax, total_ax) = plots.new_figure(ncols=2)
    plots.draw_bars(ttft_ax, ["TTFT median", "TTFT p90"],
                    {f"caching {m}": [statistics.median(results[m][0]) * 1e3, p90(results[m][0]) * 1e3]
                     for m in modes}, ylabel="time to first token (ms)", title="TTFT (lower is better)")
    plots.label_bars(ttft_ax, "{:.1f}")
    plots.draw_bars(total_ax, ["all requests"], {f"caching {m}": [results[m][1]] for m in modes},
                    ylabel="total time (s)", title="total time (lower is better)")
    plots.label_bars(total_ax, "{:.2f}")
    for ax in (ttft_ax, total_ax):
        plots.legend_below(ax, ncols=len(modes))
    return plots.save(fig, path, suptitle=title)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the benchmark with command-line flags argv (default sys.argv[1:]) and prints its table.
    prog: the command name --help shows (default: the script's file name)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--plot", metavar="PATH", help="also write the results as a PNG figure to PATH")
    args = ap.parse_args(argv)
    plots.require_writable(ap, args.plot)

    g = torch.Generator().manual_seed(0)
    on = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True)
    off = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    vocab = on.engine.model.config.vocab_size
    system = torch.randint(100, vocab, (args.system_len,), generator=g).tolist()
    prompts = [system + torch.randint(100, vocab, (args.question_len,), generator=g).tolist()
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for llm in (on, off):  # untimed warm-up on an unrelated prompt
        llm.generate([torch.randint(100, vocab, (64,), generator=g).tolist()], warm, use_tqdm=False)

    results = {}
    for name, llm in (("off", off), ("on", on)):
        results[name] = run(llm, prompts, params)
        print(f"caching {name}: {results[name][1]:.2f} s", flush=True)

    print(f"\n{args.num_requests} requests, one at a time: {args.system_len}-token shared system prompt + "
          f"{args.question_len}-token question, {args.output_len} output tokens, greedy, "
          f"{str(on.engine.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads")
    print("| prefix caching | TTFT median (ms) | TTFT p90 (ms) | total (s) | prompt tokens from cache |")
    print("|---|---:|---:|---:|---:|")
    for name in ("off", "on"):
        ttfts, total, _, cached = results[name]
        print(f"| {name} | {statistics.median(ttfts) * 1e3:.1f} | {p90(ttfts) * 1e3:.1f} | {total:.2f} | "
              f"{cached} of {args.num_requests * (args.system_len + args.question_len)} |")
    ratio = statistics.median(results["on"][0]) / statistics.median(results["off"][0])
    print(f"\nmedian TTFT with caching / without: {ratio:.3f} (target <= 0.15)")
    same = sum(a == b for a, b in zip(results["on"][2], results["off"][2]))
    print(f"identical outputs with and without caching: {same}/{args.num_requests}")
    if args.plot:
        plot(results, args.plot, title=f"{args.num_requests} requests one at a time: {args.system_len}-token shared "
             f"prefix + {args.question_len}-token question, {str(on.engine.dtype).removeprefix('torch.')}")


if __name__ == "__main__":
    main()
