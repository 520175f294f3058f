"""Decode attention on the Metal GPU (the ``metal`` backend) beside the C++ CPU
kernel (the ``cpu`` backend), on table E's workload: B sequences of S tokens,
one query each, H heads (MHA), D = 64, block_size 16, shuffled block tables,
float32 and float16.

For each row, the median after --warmup calls of --repeats calls of one
layer's paged_attention with the step's plan built once:
  wall      - the call as the model sees it: query into shared staging, one
              command buffer committed and waited on, output copied out;
  GPU       - that command buffer's GPUEndTime - GPUStartTime;
  GB/s      - bytes the kernels must read (K and V of every sequence, the
              queries, the block tables) / GPU time;
  of peak   - GB/s / the device's memory bandwidth (--bandwidth-gbs, default
              the nominal figure of the chip family named by the device:
              CHIP_BANDWIDTH_GBS);
  cpu       - the CPU kernel's wall time on the same workload (float32 rows:
              float32; float16 rows: bfloat16, the CPU backend's 16-bit dtype,
              the same bytes read), all torch threads.

    pagedserve bench metal-attention [--batch 16] [--heads 12] [--seq-lens 128 512 2048] [--plot PATH]

(from a checkout, ``python bench/metal_attention.py`` takes the same flags).
Without a Metal backend (any Linux machine, a Mac build without the Metal
toolchain) it prints that it was skipped and why, and exits 0.

--plot PATH also writes the table as a PNG figure (needs matplotlib, the
``bench`` extra): GPU, wall and CPU time vs S, one panel per dtype.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.experiments import plots

# Nominal unified-memory bandwidth (GB/s) of Apple silicon chips, by the family
# in the device name; where a family has several memory configurations, the
# highest (Apple's published figures). The longest matching name wins.
CHIP_BANDWIDTH_GBS = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
    "M5": 153,
}

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def chip_bandwidth_gbs(device_name: str) -> float | None:
    """The nominal bandwidth of the chip family in a Metal device name ("Apple M2 Pro" -> 200), or None."""
    words = device_name.replace("Apple", " ").split()
    best = None
    for family, gbs in CHIP_BANDWIDTH_GBS.items():
        parts = family.split()
        for i in range(len(words) - len(parts) + 1):
            if words[i:i + len(parts)] == parts and (best is None or len(parts) > len(best[0].split())):
                best = (family, gbs)
    return None if best is None else float(best[1])


def bytes_read(b: int, h: int, s: int, d: int, elem: int, block_size: int) -> int:
    """What one decode call must read: K and V of B sequences of S tokens, the queries, the block tables."""
    blocks = (s + block_size - 1) // block_size
    return 2 * b * s * h * d * elem + b * h * d * elem + b * blocks * 4


def make_case(backend_name: str, dtype: torch.dtype, b: int, h: int, s: int, d: int = 64, block_size: int = 16,
              seed: int = 0):
    """(backend, query, k_cache, v_cache, metadata) with the same logical K/V for every backend."""
    from pagedserve.kernels import get_backend_class
    from pagedserve.kernels.backend import AttentionMetadata, AttentionSpec

    g = torch.Generator().manual_seed(seed)
    nb = (s + block_size - 1) // block_size
    num_blocks = b * nb + 8
    tables = torch.randperm(num_blocks, generator=g)[: b * nb].view(b, nb).to(torch.int32)
    pos = torch.arange(s)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).flatten()
    keys = torch.randn(b * s, h, d, generator=g).to(dtype)
    values = torch.randn(b * s, h, d, generator=g).to(dtype)
    query = torch.randn(b, h, d, generator=g).to(dtype)
    backend = get_backend_class(backend_name)(AttentionSpec(h, h, d, block_size, num_blocks, dtype))
    k_cache, v_cache = backend.split_kv_cache(backend.allocate_kv_cache(1)[0])
    backend.reshape_and_cache(keys, values, k_cache, v_cache, slots)
    md = AttentionMetadata(slots, torch.arange(b + 1, dtype=torch.int32), torch.full((b,), s, dtype=torch.int32),
                           tables)
    return backend, query, k_cache, v_cache, md


def measure(backend_name: str, dtype: torch.dtype, b: int, h: int, s: int, warmup: int, repeats: int) -> dict:
    """Median wall (and, for metal, GPU) seconds of one layer's paged_attention, and its output."""
    backend, query, k_cache, v_cache, md = make_case(backend_name, dtype, b, h, s)
    scale = query.shape[-1] ** -0.5
    walls, gpus = [], []
    with torch.inference_mode():
        plan = backend.make_plan(md)
        out = None
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            out = backend.paged_attention(query, k_cache, v_cache, plan, scale)
            wall = time.perf_counter() - t0
            if i >= warmup:
                walls.append(wall)
                if backend_name == "metal":
                    gpus.append(backend.last_gpu_seconds)
    return {"wall": statistics.median(walls), "gpu": statistics.median(gpus) if gpus else None, "out": out}


def plot(rows: list[dict], path: str) -> str:
    """One panel per dtype: metal GPU, metal wall and CPU wall time (ms, median) vs S."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plots.new_figure(ncols=len(dtypes))
    for ax, dt in zip(axes, dtypes):
        sel = [r for r in rows if r["dtype"] == dt]
        seq = [r["seq_len"] for r in sel]
        plots.draw_lines(ax, seq, {"metal GPU": [r["gpu_ms"] for r in sel], "metal wall": [r["wall_ms"] for r in sel],
                                   f"cpu wall ({sel[0]['cpu_dtype']})": [r["cpu_ms"] for r in sel]},
                         xlabel="S (tokens per sequence)", ylabel="time per layer (ms, median)", title=dt,
                         logx=True, logy=True)
        ax.set_xticks(seq, labels=[str(s) for s in seq])
        ax.minorticks_off()
    return plots.save(fig, path, suptitle="decode attention, Metal GPU vs CPU kernel")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the benchmark with command-line flags argv (default sys.argv[1:]) and prints its table,
    or that it was skipped and why where there is no Metal backend.
    prog: the command name --help shows (default: the script's file name)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="decode sequences B (default 16)")
    ap.add_argument("--heads", type=int, default=12, help="query = KV heads H, head size 64 (default 12)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 2048], help="keys per sequence S, tokens")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                    help="cache dtypes (the CPU kernel runs float16 rows in bfloat16: it has no float16)")
    ap.add_argument("--warmup", type=int, default=5, help="calls before timing (default 5)")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls; the median is reported (default 30)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="the device's memory bandwidth in GB/s (default: the chip family's nominal figure, "
                         "see CHIP_BANDWIDTH_GBS in the module)")
    ap.add_argument("--plot", metavar="PATH", help="also write the results as a PNG figure to PATH")
    args = ap.parse_args(argv)

    from pagedserve.kernels.metal import MetalAttentionBackend, device_info

    avail = MetalAttentionBackend.availability()
    if not avail.available:  # before --plot is checked: a skipped run leaves no file behind
        print(f"metal-attention: skipped: {avail.reason}")
        return
    plots.require_writable(ap, args.plot)
    info = device_info()
    bandwidth = args.bandwidth_gbs or chip_bandwidth_gbs(info["name"])
    b, h = args.batch, args.heads
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        cpu_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        for s in args.seq_lens:
            gpu = measure("metal", dtype, b, h, s, args.warmup, args.repeats)
            cpu = measure("cpu", cpu_dtype, b, h, s, args.warmup, args.repeats)
            nbytes = bytes_read(b, h, s, 64, torch.empty((), dtype=dtype).element_size(), 16)
            gbs = nbytes / gpu["gpu"] / 1e9 if gpu["gpu"] else float("nan")
            diff = float((gpu["out"].float() - cpu["out"].float()).abs().max())
            rows.append({"dtype": name, "seq_len": s, "wall_ms": gpu["wall"] * 1e3, "gpu_ms": gpu["gpu"] * 1e3,
                         "gbs": gbs, "peak": gbs / bandwidth if bandwidth else None, "cpu_ms": cpu["wall"] * 1e3,
                         "cpu_dtype": str(cpu_dtype).removeprefix("torch."), "max_diff": diff})
    peak = (f"{bandwidth:g} GB/s ({'--bandwidth-gbs' if args.bandwidth_gbs else 'nominal for this chip family'})"
            if bandwidth else "unknown (pass --bandwidth-gbs)")
    print(f"decode, B={b}, H={h} (MHA), D=64, block_size 16 on {info['name']} (kernels: {info['library']}); "
          f"median of {args.repeats} calls after {args.warmup}; memory bandwidth {peak}; "
          f"cpu: {torch.get_num_threads()} threads")
    print("| dtype | S | metal wall (ms) | metal GPU (ms) | GB/s (GPU) | of peak | cpu wall (ms) | cpu dtype | "
          "cpu / metal wall | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        frac = f"{100 * r['peak']:.0f}%" if r["peak"] is not None else "n/a"
        print(f"| {r['dtype']} | {r['seq_len']} | {r['wall_ms']:.3f} | {r['gpu_ms']:.3f} | {r['gbs']:.1f} | {frac} | "
              f"{r['cpu_ms']:.3f} | {r['cpu_dtype']} | {r['cpu_ms'] / r['wall_ms']:.2f} | {r['max_diff']:.2g} |")
    print("\nwall - GPU = the per-call synchronisation (staging copies, command buffer commit and wait); "
          "max abs diff: metal vs the CPU kernel's output (16-bit rows: float16 vs bfloat16 inputs, so only "
          "roughly equal)")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
