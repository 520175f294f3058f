"""Exact float32 quantized linear benchmark: pagedserve._core.cpu.QuantizedWeight.linear_f32
(GGUF Q4_1 / Q8_0 blocks expanded in registers to their exact float32 values,
float32 activations and accumulation) against torch's F.linear on the dense
dequantised float32 weight, on SmolLM2-135M's linear shapes (fused qkv,
o_proj, fused gate_up, down_proj: Q4_1; lm_head: Q8_0).

    python bench/quant_linear_f32.py [--threads 2] [--ms 60] [--rounds 7] [--m 1,8,32,128] [--spin-us 100]

Weights are random, quantised with gguf-py; torch's weight is their
dequantisation (the same float32 values). Each cell is the best over --rounds
rounds of the mean time per call within a round (each round runs both
implementations for about --ms milliseconds, in turn). Prints ms per call,
GFLOP/s (2 M N K per call) and torch / ours (> 1: ours is faster), then the
sum over one SmolLM2 decoder pass (30 layers x [qkv, o, gate_up, down] +
lm_head) per M. Our pool's workers poll --spin-us microseconds before they
sleep (the engine's setting on the quantised path; torch's OpenMP threads
spin too). A checkout-only script (not under ``pagedserve bench``).
"""
from __future__ import annotations

import argparse

import torch

from quant_linear import per_call_ms  # bench/quant_linear.py (this script's folder is on sys.path)
import torch.nn.functional as F

# (name, in_features K, out_features N, qtype, times per decoder pass)
SHAPES = [("qkv", 576, 960, "q4_1", 30), ("o", 576, 576, "q4_1", 30), ("gate_up", 576, 3072, "q4_1", 30),
          ("down", 1536, 576, "q4_1", 30), ("lm_head", 576, 49152, "q8_0", 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads for both implementations (default %(default)s)")
    ap.add_argument("--ms", type=float, default=60.0, help="time budget per implementation per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; each cell is their best (default %(default)s)")
    ap.add_argument("--m", default="1,8,32,128", help="batch rows (tokens) per call")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="set_thread_pool_spin_us (default: the engine's quantised-path value)")
    args = ap.parse_args()

    from pagedserve import _core
    from pagedserve.model.gguf_format import dequantize_rows, quantize_rows

    from pagedserve.model.prepare import QUANTIZED_POOL_SPIN_US

    cpu = _core.cpu
    spin = QUANTIZED_POOL_SPIN_US if args.spin_us is None else args.spin_us
    cpu.set_thread_pool_spin_us(spin)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ms = [int(v) for v in args.m.split(",")]
    print(f"threads={args.threads}  spin_us={spin}  kernel variant={cpu.kernel_isa()} (GEMM {cpu.kernel_tables()['gemm']})  torch {torch.__version__}  "
          f"ms per call (best of {args.rounds} rounds)")
    print(f"{'shape':>8} {'K->N':>11} {'M':>4} {'f32 ms':>8} {'GF/s':>6} {'torch ms':>9} {'GF/s':>6} {'torch/f32':>9}")
    totals = {m: [0.0, 0.0, 0.0] for m in ms}  # ours ms, torch ms, flops
    for name, k, n, qtype, times in SHAPES:
        blocks = quantize_rows(torch.randn(n, k) * 0.05, qtype)
        w = cpu.QuantizedWeight(blocks, qtype, n, k)
        dense = dequantize_rows(blocks, qtype)
        for m in ms:
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            ours = lambda: w.linear_f32(x, out, None, args.threads)  # noqa: E731
            ref = lambda: F.linear(x, dense)  # noqa: E731
            t_ours, t_ref = float("inf"), float("inf")
            for _ in range(args.rounds):
                t_ours = min(t_ours, per_call_ms(ours, args.ms))
                t_ref = min(t_ref, per_call_ms(ref, args.ms))
            flops = 2.0 * m * n * k
            print(f"{name:>8} {f'{k}->{n}':>11} {m:>4} {t_ours:8.4f} {flops / t_ours / 1e6:6.1f} {t_ref:9.4f} "
                  f"{flops / t_ref / 1e6:6.1f} {t_ref / t_ours:9.2f}", flush=True)
            totals[m][0] += times * t_ours
            totals[m][1] += times * t_ref
            totals[m][2] += times * flops
    print("one SmolLM2 decoder pass (30 layers x [qkv, o, gate_up, down] + lm_head):")
    for m, (t_ours, t_ref, flops) in totals.items():
        print(f"  M={m:>4}: linear_f32 {t_ours:7.3f} ms ({flops / t_ours / 1e6:6.1f} GF/s), torch {t_ref:7.3f} ms "
              f"({flops / t_ref / 1e6:6.1f} GF/s), torch/f32 {t_ref / t_ours:5.2f}")


if __name__ == "__main__":
    main()
