"""Allocator experiment: how much reserved KV memory holds real tokens, and how
many requests fit at once, with the real C++ paged allocator versus a naive
contiguous allocator that reserves max_model_len slots per request (the
baseline of the vLLM paper, Kwon et al. 2023, section 3).

Requests (prompt + output lengths) come from a seeded workload; the paged side
runs them through pagedserve._core.KVCacheManager exactly as the scheduler
does (allocate the prompt, then append one slot per generated token).

    python -m pagedserve.experiments.fragmentation [--workload {uniform,bimodal,heavy-tailed} ...] [--plot PATH]

--plot PATH also writes the table as a PNG figure (needs matplotlib, the
``bench`` extra): requests admitted and share of reserved slots holding tokens,
paged vs contiguous.
"""

from __future__ import annotations

import argparse
import random

from .. import _core
from . import plots

WORKLOADS = ("uniform", "bimodal", "heavy-tailed")


def sample_lengths(workload: str, n: int, max_model_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs, each summing to at most max_model_len tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if workload == "uniform":
            p, o = rng.randint(16, max_model_len // 2), rng.randint(16, max_model_len // 2)
        elif workload == "bimodal":  # mostly short chat turns, some long documents
            p = rng.randint(16, 128) if rng.random() < 0.8 else rng.randint(1024, max_model_len - 256)
            o = rng.randint(16, 256)
        elif workload == "heavy-tailed":  # log-normal lengths (most short, a few very long)
            p, o = int(rng.lognormvariate(5.0, 1.0)) + 1, int(rng.lognormvariate(4.5, 1.0)) + 1
        else:
            raise ValueError(f"unknown workload '{workload}', choose from {WORKLOADS}")
        p = min(p, max_model_len - 1)
        out.append((p, max(1, min(o, max_model_len - p))))
    return out


def paged(lengths: list[tuple[int, int]], num_blocks: int, block_size: int) -> dict:
    """Admits requests FCFS into the real allocator until one does not fit at full length."""
    kv = _core.KVCacheManager(num_blocks, block_size)
    admitted, tokens = 0, 0
    for i, (p, o) in enumerate(lengths):
        if not kv.can_allocate(p + o):
            break
        kv.allocate(i, p)
        for _ in range(o):  # grow as decoding does
            kv.append(i, 1)
        admitted += 1
        tokens += p + o
    reserved = (num_blocks - kv.num_free_blocks) * block_size
    return {"admitted": admitted, "tokens": tokens, "reserved": reserved}


def contiguous(lengths: list[tuple[int, int]], num_slots: int, max_model_len: int) -> dict:
    """A contiguous allocator reserving max_model_len slots per request."""
    admitted = min(len(lengths), num_slots // max_model_len)
    tokens = sum(p + o for p, o in lengths[:admitted])
    return {"admitted": admitted, "tokens": tokens, "reserved": admitted * max_model_len}


def plot(results: dict[str, dict[str, dict]], path: str, title: str = "") -> str:
    """Writes a two-panel bar PNG to path and returns path. Left: requests admitted
    at once from the same KV memory; right: reserved slots that hold tokens (%,
    100% minus internal fragmentation); one bar per allocator, one group per workload.
    results: workload -> allocator name -> the dict of :func:`paged` / :func:`contiguous`."""
    workloads = list(results)
    names = list(dict.fromkeys(name for rows in results.values() for name in rows))
    fig, (adm_ax, use_ax) = plots.new_figure(ncols=2)
    plots.draw_bars(adm_ax, workloads, {n: [results[w][n]["admitted"] for w in workloads] for n in names},
                    ylabel="requests admitted at once", title="requests that fit")
    plots.label_bars(adm_ax, "{:.0f}")
    plots.draw_bars(use_ax, workloads,
                    {n: [100 * _utilisation(results[w][n]) for w in workloads] for n in names},
                    ylabel="reserved slots holding tokens (%)", title="memory utilisation")
    plots.label_bars(use_ax, "{:.1f}%")
    for ax in (adm_ax, use_ax):
        ax.set_xlabel("workload")
        plots.legend_below(ax)
    return plots.save(fig, path, suptitle=title)


def _utilisation(r: dict) -> float:
    return r["tokens"] / r["reserved"] if r["reserved"] else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=WORKLOADS, nargs="+", default=["uniform"],
                    help="one or more workloads, one table each (and one bar group each in the figure)")
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV memory, in blocks of block_size tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PATH", help="also write the results as a PNG figure to PATH")
    args = ap.parse_args()
    plots.require_writable(ap, args.plot)

    num_slots = args.num_blocks * args.block_size
    results = {}
    for i, workload in enumerate(dict.fromkeys(args.workload)):
        lengths = sample_lengths(workload, 10_000, args.max_model_len, args.seed)
        rows = results[workload] = {
            "paged (C++ KVCacheManager)": paged(lengths, args.num_blocks, args.block_size),
            f"contiguous, {args.max_model_len} slots per request": contiguous(lengths, num_slots, args.max_model_len)}
        mean_len = sum(p + o for p, o in lengths) / len(lengths)
        if i:
            print()
        print(f"workload {workload}: mean request {mean_len:.0f} tokens (prompt + output); "
              f"KV memory {num_slots} token slots ({args.num_blocks} blocks of {args.block_size})")
        print("| allocator | requests admitted at once | reserved slots | slots holding tokens | "
              "internal fragmentation |")
        print("|---|---:|---:|---:|---:|")
        for name, r in rows.items():
            used = _utilisation(r)
            print(f"| {name} | {r['admitted']} | {r['reserved']} | {used:.1%} | {1 - used:.1%} |")
        a, b = (r["admitted"] for r in rows.values())
        print(f"\npaged admits {a / max(b, 1):.1f}x as many requests from the same memory")
    if args.plot:
        plot(results, args.plot, title=f"KV memory {num_slots} token slots ({args.num_blocks} blocks "
             f"of {args.block_size}), max_model_len {args.max_model_len}")


if __name__ == "__main__":
    main()
