"""A roofline for every CPU kernel family: this machine's peaks, measured here,
and what each kernel reaches of them, per ISA variant, at 1, 8, 32 and 128 rows.

    python bench/roofline.py [--threads N] [--rows 1,8,32,128] [--isas avx2,avx512_vnni] [--ms 150]
                             [--families gemm,gemm_int8,attention,ops,output] [--types q4_k,q6_k,...]

Peaks (the roof), each the best of several tries:
  * read bandwidth: torch summing a float32 tensor of 8x the last-level cache, on
    --threads threads (what a decode step's weight stream can get;
    pagedserve.bench.bandwidth, the serving benchmark's --weights floor uses it too);
  * FMA peak: `_core.cpu.peak_ops('fma')` (gemm/kernel_table.h), independent
    register-resident chains of the variant's widest float32 fused multiply-add, on
    --threads threads at once;
  * int8-dot peak: the same with u8 x s8 multiply-accumulates as the variant's
    integer kernels issue them (vpdpbusd, or vpmaddubsw + vpmaddwd + vpaddd).
Each variant's fractions are against its own compute peaks and the one bandwidth.

Kernels (the Python bindings the engine and the native step call; random inputs):
  gemm       QuantizedWeight.linear_f32, the default exact float32 path, per GGUF type,
             K = 1536, N = 8960 (Qwen2.5-1.5B's gate/up projection), several
             copies cycled so that the weights come from memory as in a decode step;
  gemm_int8  QuantizedWeight.linear (int8 activations: --quantization q4 / q8), same shapes;
  attention  the paged attention backend 'cpu': decode (rows = sequences of 1,024
             tokens each) and prefill (one sequence, rows = new tokens after 1,024),
             12 query / 2 KV heads of 128 (Qwen2.5-1.5B);
  ops        rms_norm [rows, 1536], silu_and_mul [rows, 2 x 8960], rotary_embedding;
  output     QuantizedWeight.greedy_logits, the pruned greedy output layer: 151,936 x 896 Q8_0
             (Qwen2.5-0.5B's tied embedding) and 151,936 x 1536 Q6_K (Qwen2.5-1.5B Q4_K_M's).
Per cell: time per call (best of --rounds rounds of about --ms ms each), bytes moved
(weights as held + activations in + out; K and V read), GB/s and the fraction of the
read bandwidth, GFLOP/s (2 per multiply-add) and the fraction of the variant's FMA peak
(gemm_int8: of its int8-dot peak). The larger fraction says which roof bounds the cell.
A checkout-only script (not under ``pagedserve bench``); 2-4 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pagedserve.bench.bandwidth import last_level_cache_bytes, read_bandwidth
from quant_linear import per_call_ms  # bench/quant_linear.py (this script's folder is on sys.path)

GGUF_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16")
K, N = 1536, 8960
# (type, vocabulary, hidden): Qwen2.5-0.5B's tied Q8_0 embedding, Qwen2.5-1.5B Q4_K_M's Q6_K output layer
OUTPUT_LAYERS = (("q8_0", 151936, 896), ("q6_k", 151936, 1536))
CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 1024, 12, 2, 128, 16


def best_seconds(fn, budget_ms: float, rounds: int) -> float:
    """The best over `rounds` rounds of the mean seconds per call within a round (each about budget_ms)."""
    return min(per_call_ms(fn, budget_ms) for _ in range(rounds)) / 1e3


def measure_peaks(cpu, threads: int, rounds: int) -> dict:
    """{'fma', 'int8_dot'} in G op/s for the active variant, `threads` threads at once."""
    out = {}
    with ThreadPoolExecutor(threads) as pool:
        for kind in ("fma", "int8_dot"):
            iters = 2_000_000
            while True:  # about 50 ms per thread
                t0 = time.perf_counter()
                cpu.peak_ops(kind, iters)
                if time.perf_counter() - t0 > 0.05:
                    break
                iters *= 2
            best = 0.0
            for _ in range(rounds):
                t0 = time.perf_counter()
                ops = sum(pool.map(lambda _: cpu.peak_ops(kind, iters), range(threads)))
                best = max(best, ops / (time.perf_counter() - t0) / 1e9)
            out[kind] = best
    return out


def random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [rows, bytes] GGUF blocks of `qtype` (random values, finite small scales) or f16 bytes."""
    import gguf

    from big_gguf import k_blocks  # bench/big_gguf.py (this script's folder is on sys.path)

    if qtype == "f16":
        return torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32).astype(np.float16).view(np.uint8))
    if qtype.endswith("_k"):
        return torch.from_numpy(k_blocks(qtype.upper(), rows, cols, rng))
    w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype.upper()]))


class Row:
    """One printed cell: seconds per call, bytes moved, flops, the roof its flops are held against."""

    def __init__(self, family, isa, what, rows, seconds, nbytes, flops, compute_peak):
        self.family, self.isa, self.what, self.rows = family, isa, what, rows
        self.seconds, self.nbytes, self.flops, self.compute_peak = seconds, nbytes, flops, compute_peak

    def line(self, bandwidth: float) -> str:
        gbs = self.nbytes / self.seconds / 1e9
        gflops = self.flops / self.seconds / 1e9
        bw_frac = gbs / bandwidth
        fl_frac = gflops / self.compute_peak if self.compute_peak else 0.0
        bound = "memory" if bw_frac >= fl_frac else "compute"
        return (f"| {self.family} | {self.isa} | {self.what} | {self.rows} | {self.seconds * 1e3:.3f} | {gbs:.1f} | "
                f"{bw_frac:.2f} | {gflops:.1f} | {fl_frac:.2f} | {bound} |")


def gemm_rows(cpu, isa, peaks, rows_list, types, threads, args, rng, int8: bool) -> list[Row]:
    out = []
    for qtype in types:
        if int8 and qtype == "f16":
            continue  # linear (int8 activations) reads block types only
        raw = random_weight(qtype, N, K, rng)
        first = cpu.QuantizedWeight(raw, qtype, N, K)
        copies = max(1, min(16, math.ceil(4 * last_level_cache_bytes() / first.nbytes)))
        ws = [first] + [cpu.QuantizedWeight(raw, qtype, N, K) for _ in range(copies - 1)]
        for m in rows_list:
            x = torch.randn(m, K)
            y = torch.empty(m, N)
            state = {"i": 0}

            def call():
                w = ws[state["i"] % len(ws)]
                state["i"] += 1
                if int8:
                    w.linear(x, y, None, threads)
                else:
                    w.linear_f32(x, y, None, threads)

            s = best_seconds(call, args.ms, args.rounds)
            nbytes = first.nbytes + 4 * m * (K + N)
            out.append(Row("gemm_int8" if int8 else "gemm", isa, qtype, m, s, nbytes, 2.0 * m * N * K,
                           peaks["int8_dot" if int8 else "fma"]))
    return out


def attention_rows(isa, peaks, rows_list, args) -> list[Row]:
    from pagedserve.kernels import get_backend_class
    from pagedserve.kernels.backend import AttentionMetadata, AttentionSpec

    out = []
    g = torch.Generator().manual_seed(0)
    for kind in ("decode", "prefill"):
        for m in rows_list:
            b = m if kind == "decode" else 1
            q_len = 1 if kind == "decode" else m
            seq = CONTEXT + q_len - 1 if kind == "decode" else CONTEXT + m
            nb = (seq + BLOCK - 1) // BLOCK
            num_blocks = b * nb + 4
            backend = get_backend_class("cpu")(AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, BLOCK, num_blocks,
                                                             torch.float32))
            k_cache, v_cache = backend.split_kv_cache(backend.allocate_kv_cache(1)[0])
            tables = torch.randperm(num_blocks, generator=g)[: b * nb].view(b, nb).to(torch.int32)
            pos = torch.arange(seq)
            slots = (tables.long()[:, pos // BLOCK] * BLOCK + pos % BLOCK).flatten()
            backend.reshape_and_cache(torch.randn(b * seq, KV_HEADS, HEAD_DIM, generator=g),
                                      torch.randn(b * seq, KV_HEADS, HEAD_DIM, generator=g), k_cache, v_cache, slots)
            query = torch.randn(b * q_len, HEADS, HEAD_DIM, generator=g)
            qsl = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32)
            new_slots = slots.view(b, seq)[:, seq - q_len:].flatten()
            md = AttentionMetadata(new_slots, qsl, torch.full((b,), seq, dtype=torch.int32), tables)
            plan = backend.make_plan(md)
            scale = HEAD_DIM ** -0.5
            s = best_seconds(lambda: backend.paged_attention(query, k_cache, v_cache, plan, scale), args.ms,
                             args.rounds)
            kv_bytes = 2 * b * seq * KV_HEADS * HEAD_DIM * 4
            # causal prefill: query i sees CONTEXT + i + 1 keys
            keys_seen = b * seq if kind == "decode" else sum(CONTEXT + i + 1 for i in range(m))
            flops = 4.0 * keys_seen * HEADS * HEAD_DIM
            out.append(Row("attention", isa, kind, m, s, kv_bytes + 2 * query.numel() * 4, flops, peaks["fma"]))
    return out


def ops_rows(cpu, isa, peaks, rows_list, threads, args) -> list[Row]:
    out = []
    hidden, inter = K, N
    weight = torch.rand(hidden) + 0.5
    cache = torch.randn(4096, HEAD_DIM)
    for m in rows_list:
        x = torch.randn(m, hidden)
        y = torch.empty(m, hidden)
        s = best_seconds(lambda: cpu.rms_norm(y, x, weight, 1e-6, threads), args.ms, args.rounds)
        out.append(Row("ops", isa, "rms_norm", m, s, 8 * m * hidden, 4.0 * m * hidden, peaks["fma"]))
        gu = torch.randn(m, 2 * inter)
        act = torch.empty(m, inter)
        s = best_seconds(lambda: cpu.silu_and_mul(act, gu, threads), args.ms, args.rounds)
        out.append(Row("ops", isa, "silu_and_mul", m, s, 12 * m * inter, 6.0 * m * inter, peaks["fma"]))
        q = torch.randn(m, HEADS * HEAD_DIM)
        k = torch.randn(m, KV_HEADS * HEAD_DIM)
        positions = torch.arange(m, dtype=torch.int64)
        s = best_seconds(lambda: cpu.rotary_embedding(positions, q, k, HEAD_DIM, cache, True, threads), args.ms,
                         args.rounds)
        elems = m * (HEADS + KV_HEADS) * HEAD_DIM
        out.append(Row("ops", isa, "rotary_embedding", m, s, 8 * elems, 3.0 * elems, peaks["fma"]))
    return out


def output_rows(cpu, isa, peaks, rows_list, threads, args, rng) -> list[Row]:
    out = []
    for qtype, vocab, hidden in OUTPUT_LAYERS:
        w = cpu.QuantizedWeight(random_weight(qtype, vocab, hidden, rng), qtype, vocab, hidden)
        for m in rows_list:
            x = torch.randn(m, hidden)
            y = torch.empty(m, vocab)
            s = best_seconds(lambda: w.greedy_logits(x, y, threads), args.ms, args.rounds)
            out.append(Row("output", isa, f"greedy {qtype}", m, s, w.nbytes + 4 * m * (hidden + vocab),
                           2.0 * m * vocab * hidden, peaks["fma"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: every core)")
    ap.add_argument("--rows", default="1,8,32,128", help="rows per call (tokens, or sequences for decode)")
    ap.add_argument("--isas", default=None,
                    help="variants, comma-separated (default: one per distinct GEMM or attention table here)")
    ap.add_argument("--families", default="gemm,gemm_int8,attention,ops,output")
    ap.add_argument("--types", default=",".join(GGUF_TYPES), help="GGUF types of the gemm families")
    ap.add_argument("--ms", type=float, default=150.0, help="time per round per cell")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell; the best counts")
    args = ap.parse_args()

    from pagedserve import _core

    cpu = _core.cpu
    rows_list = [int(v) for v in args.rows.split(",")]
    families = args.families.split(",")
    types = args.types.split(",")
    if args.isas:
        isas = args.isas.split(",")
    else:
        isas = sorted(set(cpu.variants_for("gemm")) | set(cpu.variants_for("attention")),
                      key=[n for n, _, _ in cpu.compiled_isas()].index)
    flags = " ".join(f for f in cpu.cpu_features() if f.startswith(("avx", "fma", "amx", "neon", "sve", "dotprod",
                                                                      "i8mm")))
    torch.set_num_threads(args.threads)
    bw = read_bandwidth(args.threads)
    print(f"CPU flags: {flags}; {os.cpu_count()} cores; last-level cache {last_level_cache_bytes() >> 20} MiB; "
          f"threads {args.threads}; torch {torch.__version__}")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s (torch summing 8x the last-level cache, {args.threads} threads)")
    rng = np.random.default_rng(0)
    for isa in isas:
        cpu.set_kernel_isa(isa)
        peaks = measure_peaks(cpu, args.threads, args.rounds)
        tables = cpu.kernel_tables()
        print(f"\n## {isa} (attention {tables['attention']}, ops {tables['ops']}, gemm {tables['gemm']}): "
              f"FMA peak {peaks['fma']:.0f} GFLOP/s, int8-dot peak {peaks['int8_dot']:.0f} GOP/s "
              f"({args.threads} threads)")
        print("| family | variant | kernel | rows | ms per call | GB/s | of bandwidth | GFLOP/s | of compute peak "
              "| bound |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
        rows: list[Row] = []
        if "gemm" in families:
            rows += gemm_rows(cpu, isa, peaks, rows_list, types, args.threads, args, rng, int8=False)
        if "gemm_int8" in families:
            rows += gemm_rows(cpu, isa, peaks, rows_list, types, args.threads, args, rng, int8=True)
        if "attention" in families:
            rows += attention_rows(isa, peaks, rows_list, args)
        if "ops" in families:
            rows += ops_rows(cpu, isa, peaks, rows_list, args.threads, args)
        if "output" in families:
            rows += output_rows(cpu, isa, peaks, rows_list, args.threads, args, rng)
        for r in rows:
            print(r.line(bw / 1e9), flush=True)


if __name__ == "__main__":
    main()
