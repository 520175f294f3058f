"""Quantized linear benchmark: pagedserve._core.cpu.QuantizedWeight (GGUF Q4_1 /
Q8_0 blocks x int8 activations, integer SIMD) against torch's float32 and
bfloat16 F.linear, on SmolLM2-135M's linear shapes, side by side in one run.

    python bench/quant_linear.py [--threads N] [--ms 150] [--rounds 5] [--m 1,8,32,128]

Weights are random (numpy), quantised with gguf-py (gguf.quants.quantize); the
torch baselines use the dequantised weights. Each cell is the median over
--rounds rounds of the mean time per call within a round (each round runs every
implementation for about --ms milliseconds, in turn, so they see the same machine
state). Prints ms per call and the ratios torch / ours (> 1: ours is faster).
A checkout-only script (not under ``pagedserve bench``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

# (in_features K, out_features N): q/o proj, k/v proj, gate/up, down, lm_head
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def per_call_ms(fn, budget_ms: float) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(budget_ms / 1000 / one))
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="threads for every implementation (default: torch's, %(default)s here)")
    ap.add_argument("--ms", type=float, default=150.0, help="time budget per implementation per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; each cell is their median (default %(default)s)")
    ap.add_argument("--m", default="1,8,32,128", help="batch rows (tokens) per call")
    args = ap.parse_args()

    import gguf

    from pagedserve import _core

    cpu = _core.cpu
    torch.set_num_threads(args.threads)
    ms = [int(v) for v in args.m.split(",")]
    rng = np.random.default_rng(0)
    print(f"threads={args.threads}  kernel variant={cpu.kernel_isa()} (GEMM {cpu.kernel_tables()['gemm']})  torch {torch.__version__}  "
          f"ms per call (median of {args.rounds} rounds)")
    header = (f"{'K->N':>11} {'M':>4} {'q4_1':>9} {'q8_0':>9} {'f32':>9} {'bf16':>9} "
              f"{'f32/q4_1':>9} {'bf16/q4_1':>9}")
    print(header)
    print("-" * len(header))
    for k, n in SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        weights = {}
        for qt, gt in (("q4_1", gguf.GGMLQuantizationType.Q4_1), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
            raw = gguf.quants.quantize(w, gt)
            weights[qt] = cpu.QuantizedWeight(torch.from_numpy(np.ascontiguousarray(raw)), qt, n, k)
            if qt == "q4_1":
                wf = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gt)))
        wb = wf.bfloat16()
        for m in ms:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            out = torch.empty(m, n)
            impls = {
                "q4_1": lambda: weights["q4_1"].linear(x, out, None, args.threads),
                "q8_0": lambda: weights["q8_0"].linear(x, out, None, args.threads),
                "f32": lambda: F.linear(x, wf),
                "bf16": lambda: F.linear(xb, wb),
            }
            times = {name: [] for name in impls}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, fn in impls.items():
                        times[name].append(per_call_ms(fn, args.ms))
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"{f'{k}->{n}':>11} {m:>4} {med['q4_1']:9.4f} {med['q8_0']:9.4f} {med['f32']:9.4f} "
                  f"{med['bf16']:9.4f} {med['f32'] / med['q4_1']:9.2f} {med['bf16'] / med['q4_1']:9.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
