"""Decode attention over a paged KV cache: latency and peak temporary memory of
  gather   - gather each sequence's blocks into a contiguous K/V, then
             torch scaled_dot_product_attention (pagedserve.kernels.torch_ref.dense_attention)
  torch    - the PyTorch blockwise online-softmax reference (pagedserve.kernels.torch_ref)
  cpu      - the C++ kernel (pagedserve.kernels.cpu), reading the blocks in place

Decode step: B sequences of S tokens, one query each, H heads (MHA), D = 64,
float32, block_size 16, shuffled block tables. Latency: median of --repeats
calls. Memory: growth of the process's peak resident set during the first call
of the method in a fresh process (measured, 4 KiB page resolution; inputs are
allocated and touched before).

    python bench/attention.py [--batch 16] [--heads 12] [--seq-lens 128 512 2048]
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

METHODS = ("gather", "torch", "cpu")


def make_inputs(b: int, h: int, s: int, d: int = 64, block_size: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = (s + block_size - 1) // block_size
    num_blocks = b * nb + 8
    k_cache = torch.randn(num_blocks, h, d, block_size, generator=g)
    v_cache = torch.randn(num_blocks, h, block_size, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: b * nb].view(b, nb).to(torch.int32)
    query = torch.randn(b, h, d, generator=g)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    seq_lens = torch.full((b,), s, dtype=torch.int32)
    return query, k_cache, v_cache, qsl, seq_lens, tables


def method_fn(name: str):
    from pagedserve.kernels import cpu, torch_ref

    return {"gather": torch_ref.dense_attention, "torch": torch_ref.paged_attention,
            "cpu": cpu.paged_attention}[name]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(name: str, b: int, h: int, s: int, repeats: int) -> dict:
    """Runs in a fresh process: first-call memory growth, then latency."""
    args = make_inputs(b, h, s)
    fn = method_fn(name)
    scale = args[0].shape[-1] ** -0.5
    with torch.inference_mode():
        before = peak_rss_bytes()
        out = fn(*args, scale)
        grown = peak_rss_bytes() - before
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args, scale)
            times.append(time.perf_counter() - t0)
    return {"method": name, "seq_len": s, "median_ms": statistics.median(times) * 1e3,
            "peak_mem_bytes": grown, "checksum": float(out.double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.batch, args.heads, int(args.worker[1]), args.repeats)))
        return

    from pagedserve.kernels import cpu

    rows = {}
    for s in args.seq_lens:
        for m in METHODS:
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--heads", str(args.heads),
                   "--repeats", str(args.repeats), "--worker", m, str(s)]
            rows[(m, s)] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"decode, B={args.batch}, H={args.heads} (MHA), D=64, float32, block_size 16, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} calls; memory = peak RSS growth")
    print("| S | method | latency (ms) | vs gather | peak temp memory | gather / this |")
    print("|---:|---|---:|---:|---:|---:|")
    for s in args.seq_lens:
        base = rows[("gather", s)]
        for m in METHODS:
            r = rows[(m, s)]
            mem = r["peak_mem_bytes"]
            mem_s = f"{mem / 2**20:.2f} MiB" if mem >= 4096 else "< 4 KiB"
            ratio = f"{base['peak_mem_bytes'] / max(mem, 4096):.0f}x" + ("" if mem >= 4096 else " (at least)")
            print(f"| {s} | {m} | {r['median_ms']:.3f} | {r['median_ms'] / base['median_ms']:.2f} | {mem_s} | {ratio} |")
        sums = {m: rows[(m, s)]["checksum"] for m in METHODS}
        assert max(sums.values()) - min(sums.values()) < 1e-2 * max(1.0, abs(sums["gather"])), sums
    print(f"\nC++ kernel scratch per worker thread (its own accounting): "
          f"{cpu.scratch_bytes(args.heads, args.heads, 64, 16)} bytes, the same at every S")


if __name__ == "__main__":
    main()
