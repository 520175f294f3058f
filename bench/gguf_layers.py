"""Where a decode token's linear-layer time goes, per GGUF tensor kind and type:
every 2-d weight of a GGUF file (the embedding aside) is loaded once into our
kernel's tiles, then one pass calls each in file order on [rows, in_features]
random activations, as a decode step would (each weight read from memory, the
model being larger than the caches), with the exact float32 path
(QuantizedWeight.linear_f32, the default) and the int8 one (.linear,
--quantization; an unquantised F16 / BF16 / F32 weight takes linear_f32 there too). Per pass the total, and per (kind, type) the sum over the
layers, best of --rounds passes.

    python bench/gguf_layers.py [--model qwen2.5-coder-1.5b | --gguf FILE] [--rows 1] [--threads 2]
                                [--isa avx2] [--rounds 5]

--model names a packaged model (bench/startup.py's PACKAGED_MODELS, e.g.
qwen2.5-coder-1.5b, gemma3-270m); --isa a kernel variant
(`_core.cpu.set_kernel_isa`, as PAGEDSERVE_CPU_ISA). The attention, norms and
the rest of the step are not included: compare the total with
bench/decode_tpot.py's TPOT to see their share. A checkout-only script (not
under ``pagedserve bench``).
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch


def load_weights(path: str, cpu) -> list[tuple[str, str, object]]:
    """[(kind, GGUF type name, QuantizedWeight)] for every 2-d tensor but the
    token embedding, in file order; kind is the tensor name without its layer
    ("ffn_up", "attn_q", "output")."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = []
    for t in reader.tensors:
        if len(t.shape) != 2 or t.name == "token_embd.weight":
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        raw = torch.from_numpy(np.array(np.asarray(t.data).view(np.uint8).reshape(n, -1)))  # a writable copy
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.removesuffix(".weight")
        out.append((kind, t.tensor_type.name, cpu.QuantizedWeight(raw, t.tensor_type.name.lower(), n, k)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default="qwen2.5-coder-1.5b", help="a packaged model (default %(default)s)")
    src.add_argument("--gguf", help="a GGUF file instead")
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call (decoding sequences)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--isa", help="kernel variant (default: the best this CPU runs)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from pagedserve import _core

    cpu = _core.cpu
    if args.isa:
        cpu.set_kernel_isa(args.isa)
    if args.gguf:
        path = args.gguf
    else:
        from startup import gguf_of  # bench/startup.py (this script's folder is on sys.path)
        path = str(gguf_of(args.model))
    weights = load_weights(path, cpu)
    x = {w.in_features: torch.randn(args.rows, w.in_features) for _, _, w in weights}
    y = {w.out_features: torch.empty(args.rows, w.out_features) for _, _, w in weights}
    held = sum(w.nbytes for _, _, w in weights)
    print(f"{path}: {len(weights)} weights, {held / 1e6:.0f} MB held; variant {cpu.kernel_isa()}, "
          f"rows {args.rows}, threads {args.threads}, best of {args.rounds} passes")
    for path_name in ("linear_f32", "linear"):
        best: dict = collections.defaultdict(lambda: float("inf"))
        totals = []
        for _ in range(args.rounds):
            spent: dict = collections.defaultdict(float)
            start = time.perf_counter()
            for kind, qtype, w in weights:
                # unquantised weights (F16, BF16, F32) have no integer kernel: linear_f32 in both passes
                call = w.linear if path_name == "linear" and w.integer_kernels else w.linear_f32
                t0 = time.perf_counter()
                call(x[w.in_features], y[w.out_features], None, args.threads)
                spent[(kind, qtype)] += time.perf_counter() - t0
            totals.append(time.perf_counter() - start)
            for key, s in spent.items():
                best[key] = min(best[key], s)
        totals.sort()
        print(f"\n{path_name}: a pass {totals[0] * 1e3:.1f} ms (best), {totals[len(totals) // 2] * 1e3:.1f} "
              f"(median), {totals[-1] * 1e3:.1f} (worst)")
        for (kind, qtype), s in sorted(best.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<14} {qtype:<5} {s * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
