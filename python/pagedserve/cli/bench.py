"""``pagedserve bench NAME [flags]``: the benchmarks of pagedserve.bench, each
with its own flags (``pagedserve bench NAME --help``)."""

from __future__ import annotations

from .commands import Command, run_subcommand

BENCHMARKS = {
    "throughput": Command("sequential HF generate() vs HF static batching vs PagedServe: output tokens/s",
                          "pagedserve.bench.throughput:main"),
    "attention": Command("decode attention over the paged KV cache: latency and peak temporary memory per kernel",
                         "pagedserve.bench.attention:main"),
    "prefix-cache": Command("time to first token and total time with prefix caching on vs off",
                            "pagedserve.bench.prefix_cache:main"),
    "metal-attention": Command("decode attention on the Metal GPU vs the CPU kernel: wall and GPU time, GB/s "
                               "(skipped where there is no Metal backend)",
                               "pagedserve.bench.metal_attention:main"),
    "serving": Command("load on any OpenAI-compatible server (closed loop, sweep, Poisson, side by side): "
                       "output tokens/s, TTFT, ITL, TPOT, E2E, and a check of the tokens produced",
                       "pagedserve.bench.serving:main"),
    "routing": Command("request routers side by side on `serve --replicas N` (Ray Serve): TTFT, prefix-cache "
                       "hit rate, requests per replica", "pagedserve.bench.routing:main"),
}


def main(argv: list[str], prog: str = "pagedserve bench") -> None:
    """Runs the benchmark named by argv[0] with the rest of argv as its flags."""
    run_subcommand(prog, "Run one of PagedServe's benchmarks (each prints a Markdown table).", BENCHMARKS, argv)
