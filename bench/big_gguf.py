"""A 7B-class start without a 7B download: writes a GGUF file of
Llama-3-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV heads,
intermediate 14336, vocabulary 128,256) with random Q4_K_M-style blocks
(Q4_K for most matrices, Q6_K for attn_v, ffn_down and the output layer,
F32 norms) by gguf-py, then starts PagedServe on it in this process and
decodes. Prints the file's size, the time to start, peak RSS (VmHWM) against
file + KV store + 1 GiB, and the time per output token. Random weights: the
tokens are noise; what is measured is whether the file starts and how fast a
step runs. Not part of CI (4.6 GB written, minutes on 2 cores).

    python bench/big_gguf.py [--path /tmp/llama3-8b-shape.gguf] [--keep]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, HEAD_DIM = 32, 4096, 32, 8, 14336, 128256, 128
# byte offsets of the fp16 scales in each K-quant block (d, dmin; Q6_K: d)
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes]: random K-quant blocks whose fp16 scales are small (weights of order 0.01-0.1)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows * (cols // block), size), dtype=np.uint8)
    for off in K_SCALES[qtype]:
        raw[:, off:off + 2] = rng.uniform(1e-4, 1e-3, size=raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write(path: Path, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    w.add_tensor("token_embd.weight", k_blocks("Q4_K", VOCAB, HIDDEN, rng), raw_dtype=q4)
    for i in range(LAYERS):
        for name, rows, cols, qtype in (("attn_q", HEADS * HEAD_DIM, HIDDEN, "Q4_K"),
                                        ("attn_k", KV_HEADS * HEAD_DIM, HIDDEN, "Q4_K"),
                                        ("attn_v", KV_HEADS * HEAD_DIM, HIDDEN, "Q6_K"),
                                        ("attn_output", HIDDEN, HEADS * HEAD_DIM, "Q4_K"),
                                        ("ffn_gate", FFN, HIDDEN, "Q4_K"), ("ffn_up", FFN, HIDDEN, "Q4_K"),
                                        ("ffn_down", HIDDEN, FFN, "Q6_K")):
            w.add_tensor(f"blk.{i}.{name}.weight", k_blocks(qtype, rows, cols, rng),
                         raw_dtype=q4 if qtype == "Q4_K" else q6)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output.weight", k_blocks("Q6_K", VOCAB, HIDDEN, rng), raw_dtype=q6)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="/tmp/llama3-8b-shape.gguf")
    ap.add_argument("--keep", action="store_true", help="keep the file (default: delete it at the end)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    path = Path(args.path)
    if not path.exists():
        t = time.perf_counter()
        write(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s", flush=True)
    size = path.stat().st_size
    from pagedserve import LLM, SamplingParams

    block_size = 16
    num_blocks = args.max_model_len // block_size
    t = time.perf_counter()
    llm = LLM(model=str(path), max_model_len=args.max_model_len, num_kv_blocks=num_blocks,
              enable_prefix_caching=False)
    start = time.perf_counter() - t
    kv = llm.engine.kv_cache.nbytes
    peak = vm("VmHWM")
    print(f"started in {start:.1f} s; weights held {llm.engine.weight_bytes / 2**30:.2f} GiB; peak RSS "
          f"{peak / 2**30:.2f} GiB vs file + KV + 1 GiB = {(size + kv + 2**30) / 2**30:.2f} GiB "
          f"({'within' if peak <= size + kv + 2**30 else 'above'})", flush=True)
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, VOCAB, 32)]

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    timed(2)  # warm-up
    first, whole = timed(1), timed(args.output_len)
    tpot = (whole - first) / (args.output_len - 1)
    print(f"TTFT (32-token prompt) {first:.2f} s, TPOT {tpot * 1000:.0f} ms ({args.output_len} tokens); peak RSS "
          f"now {vm('VmHWM') / 2**30:.2f} GiB; {os.cpu_count()} cores", flush=True)
    if not args.keep:
        path.unlink()


if __name__ == "__main__":
    main()
