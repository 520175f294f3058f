"""Decode attention over a paged KV cache: latency and peak temporary memory of
  gather        - gather each sequence's blocks into a contiguous K/V, then torch
                  scaled_dot_product_attention (pagedserve.kernels.torch_ref.dense_attention)
  <backend>     - every attention backend of the registry that runs here
                  (pagedserve.kernels), once per kernel variant it has
                  (cpu:avx512, cpu:avx2, cpu:baseline, ...), reading the blocks in place

Decode step: B sequences of S tokens, one query each, H heads (MHA), D = 64,
float32, block_size 16, shuffled block tables; K/V written through each
backend's own reshape_and_cache into its own layout. Latency: median of
--repeats calls of one layer's paged_attention with the step's plan built once
(as every layer of a step shares it); the plan's own build time is reported
apart. Memory: growth of the process's peak resident set during the first call
in a fresh process (measured, 4 KiB page resolution: the kernel's peak-RSS mark
is reset to the current RSS just before the call through /proc/self/clear_refs;
inputs are allocated and touched before).

    pagedserve bench attention [--batch 16] [--heads 12] [--seq-lens 128 512 2048] [--plot PATH]

(from a checkout, ``python bench/attention.py`` takes the same flags)

--plot PATH also writes the table as a PNG figure (needs matplotlib, the
``bench`` extra): latency and peak temporary memory vs S, one line per method.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from pagedserve.experiments import plots

WORKER_MODULE = "pagedserve.bench.attention"  # each measurement runs in a fresh `python -m` of this module


def methods() -> list[str]:
    """'gather' and every (backend[:variant]) that can run here."""
    from pagedserve.kernels import available_backends, get_backend_class

    out = ["gather"]
    for name in available_backends("cpu"):
        variants = [v.name for v in get_backend_class(name).variants() if v.available]
        out += [f"{name}:{v}" for v in reversed(variants)] if variants else [name]
    return out


def make_inputs(backend_name: str, b: int, h: int, s: int, d: int = 64, block_size: int = 16, seed: int = 0):
    """(backend, query, k_cache, v_cache, metadata) with the same logical K/V for every backend."""
    from pagedserve.kernels import get_backend_class
    from pagedserve.kernels.backend import AttentionMetadata, AttentionSpec

    g = torch.Generator().manual_seed(seed)
    nb = (s + block_size - 1) // block_size
    num_blocks = b * nb + 8
    tables = torch.randperm(num_blocks, generator=g)[: b * nb].view(b, nb).to(torch.int32)
    pos = torch.arange(s)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).flatten()
    keys = torch.randn(b * s, h, d, generator=g)
    values = torch.randn(b * s, h, d, generator=g)
    query = torch.randn(b, h, d, generator=g)
    backend = get_backend_class(backend_name)(AttentionSpec(h, h, d, block_size, num_blocks, torch.float32))
    k_cache, v_cache = backend.split_kv_cache(backend.allocate_kv_cache(1)[0])
    backend.reshape_and_cache(keys, values, k_cache, v_cache, slots)
    md = AttentionMetadata(slots, torch.arange(b + 1, dtype=torch.int32), torch.full((b,), s, dtype=torch.int32),
                           tables)
    return backend, query, k_cache, v_cache, md


def gather_attention(backend, query, k_cache, v_cache, md, scale):
    """The gather baseline on the torch backend's layout [N, Hkv, block_size, D]:
    one sequence at a time, its blocks copied into a contiguous K/V, then SDPA."""
    from pagedserve.kernels.torch_ref import dense_attention

    bs, hkv, d = k_cache.shape[2], k_cache.shape[1], k_cache.shape[3]
    qsl = md.query_start_loc.tolist()
    out = torch.empty(query.shape, dtype=torch.float32)
    for b, n in enumerate(md.seq_lens.tolist()):
        ids = md.block_tables[b, : (n + bs - 1) // bs].long()
        keys = k_cache[ids].transpose(1, 2).reshape(-1, hkv, d)[:n]
        values = v_cache[ids].transpose(1, 2).reshape(-1, hkv, d)[:n]
        q = query[qsl[b]:qsl[b + 1]]
        out[qsl[b]:qsl[b + 1]] = dense_attention(q, [keys], [values], torch.tensor([0, q.shape[0]]), scale)
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> int:
    """Resets the peak-RSS mark to the current RSS (Linux >= 4.0); returns the
    current RSS in bytes. Falls back to the lifetime peak where that fails."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(method: str, b: int, h: int, s: int, repeats: int) -> dict:
    """Runs in a fresh process: first-call memory growth, then latency."""
    name, _, variant = method.partition(":")
    backend, query, k_cache, v_cache, md = make_inputs("torch" if name == "gather" else name, b, h, s)
    if variant:
        type(backend).use_variant(variant)
    scale = query.shape[-1] ** -0.5
    with torch.inference_mode():
        before = reset_peak_rss()
        t0 = time.perf_counter()
        plan = None if name == "gather" else backend.make_plan(md)
        plan_ms = (time.perf_counter() - t0) * 1e3

        def call():
            if name == "gather":
                return gather_attention(backend, query, k_cache, v_cache, md, scale)
            return backend.paged_attention(query, k_cache, v_cache, plan, scale)

        out = call()
        grown = peak_rss_bytes() - before
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return {"method": method, "seq_len": s, "median_ms": statistics.median(times) * 1e3, "plan_ms": plan_ms,
            "peak_mem_bytes": grown, "checksum": float(out.double().sum())}


def plot(results: list[dict], path: str, title: str = "") -> str:
    """Writes a two-panel PNG to path and returns path. Left: one layer's decode
    attention latency (median, ms) vs S; right: peak temporary memory of the first
    call (peak RSS growth, MiB) vs S; one line per method, x axis log2 S, y axes log.
    A growth below the 4 KiB measurement resolution (often 0) is drawn at 4 KiB.
    results: the rows of :func:`worker` (method, seq_len, median_ms, peak_mem_bytes)."""
    seq_lens = sorted({r["seq_len"] for r in results})
    by = {(r["method"], r["seq_len"]): r for r in results}
    names = list(dict.fromkeys(r["method"] for r in results))
    fig, (lat, mem) = plots.new_figure(ncols=2)
    plots.draw_lines(lat, seq_lens, {m: [by[(m, s)]["median_ms"] for s in seq_lens] for m in names},
                     xlabel="S (tokens per sequence)", ylabel="latency per layer (ms, median)",
                     title="latency", logx=True, logy=True)
    plots.draw_lines(mem, seq_lens,
                     {m: [max(by[(m, s)]["peak_mem_bytes"], 4096) / 2**20 for s in seq_lens] for m in names},
                     xlabel="S (tokens per sequence)", ylabel="peak temporary memory (MiB; floor 4 KiB)",
                     title="scratch memory", logx=True, logy=True)
    for ax in (lat, mem):
        ax.set_xticks(seq_lens, labels=[str(s) for s in seq_lens])
        ax.minorticks_off()
    return plots.save(fig, path, suptitle=title)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the benchmark with command-line flags argv (default sys.argv[1:]) and prints its table.
    prog: the command name --help shows (default: the script's file name)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--methods", nargs="+", default=None, help="subset of: gather and the backends here")
    ap.add_argument("--plot", metavar="PATH", help="also write the results as a PNG figure to PATH")
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    plots.require_writable(ap, args.plot)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.batch, args.heads, int(args.worker[1]), args.repeats)))
        return

    from pagedserve.kernels import cpu

    chosen = args.methods or methods()
    rows = {}
    for s in args.seq_lens:
        for m in chosen:
            cmd = [sys.executable, "-m", WORKER_MODULE, "--batch", str(args.batch), "--heads", str(args.heads),
                   "--repeats", str(args.repeats), "--worker", m, str(s)]
            rows[(m, s)] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"decode, B={args.batch}, H={args.heads} (MHA), D=64, float32, block_size 16, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} calls; memory = peak RSS growth")
    print("| S | method | latency (ms) | vs gather | plan, once per step (ms) | peak temp memory | gather / this |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for s in args.seq_lens:
        base = rows[(chosen[0], s)]
        for m in chosen:
            r = rows[(m, s)]
            mem = r["peak_mem_bytes"]
            mem_s = f"{mem / 2**20:.2f} MiB" if mem >= 4096 else "< 4 KiB"
            r_mem = base["peak_mem_bytes"] / max(mem, 4096)
            ratio = (f"{r_mem:.0f}x" if r_mem >= 10 else f"{r_mem:.1f}x") + ("" if mem >= 4096 else " (at least)")
            plan = "" if m == "gather" else f"{r['plan_ms']:.3f}"
            print(f"| {s} | {m} | {r['median_ms']:.3f} | {r['median_ms'] / base['median_ms']:.2f} | {plan} | "
                  f"{mem_s} | {ratio} |")
        sums = {m: rows[(m, s)]["checksum"] for m in chosen}
        assert max(sums.values()) - min(sums.values()) < 1e-2 * max(1.0, abs(sums[chosen[0]])), sums
    print(f"\nC++ kernel scratch per worker thread (its own accounting): "
          f"{cpu.scratch_bytes(args.heads, args.heads, 64, 16)} bytes, the same at every S")
    if args.plot:
        plot(list(rows.values()), args.plot, title=f"decode attention, B={args.batch}, H={args.heads}, D=64, "
             f"float32, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
