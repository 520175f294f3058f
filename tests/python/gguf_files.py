"""Tiny GGUF files of the families PagedServe reads in place, written with
gguf-py (no hub, no llama.cpp): a tiny random model's shapes, its linear
layers stored in every GGUF block type in turn (the K-quants as random blocks
with small scales: gguf-py cannot quantise to them), norms in F32, the
embedding in Q8_0, and the metadata transformers' GGUF reader needs (the
hyper-parameters and a 256-token byte-level vocabulary)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from families import FAMILIES
import transformers

# the linear layers' types, cycled over the file's linear tensors (K-quants only where in_features % 256 == 0)
TYPES = ("q4_k", "q8_0", "q5_k", "q4_0", "q6_k", "q4_1", "q5_0", "q5_1", "f16", "bf16", "f32")
K_QUANTS = ("q4_k", "q5_k", "q6_k")
# byte offsets of the fp16 scales in each K-quant block (d, dmin; Q6_K: d)
_K_SCALES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.05, tie_word_embeddings=True)
EXTRA = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128},
         "gemma3": {"head_dim": 64, "sliding_window": 512, "query_pre_attn_scalar": 64}}


def _k_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
    raw = rng.integers(0, 256, size=(rows * (cols // block), size), dtype=np.uint8)
    for off in _K_SCALES[name]:
        scale = rng.uniform(1e-4, 2e-3, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _stored(weight: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(data for GGUFWriter.add_tensor, raw_dtype or None) of a float32 [N, K] matrix stored as ``qtype``."""
    if qtype == "f32":
        return weight, None
    if qtype == "f16":
        return weight.astype(np.float16), None
    t = gguf.GGMLQuantizationType[qtype.upper()]
    if qtype in K_QUANTS:
        return _k_blocks(qtype, *weight.shape, rng), t
    return gguf.quants.quantize(weight, t), t


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order of a llama q/k projection (what the reader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(family: str, path: Path, seed: int = 0, types=TYPES, drop: tuple[str, ...] = ()) -> tuple[Path, list[str]]:
    """Writes a tiny GGUF of ``family`` ("llama", "qwen2", "qwen3", "gemma3")
    at ``path``, without the GGUF tensors named in ``drop``. Returns (path,
    the block types its linear tensors use)."""
    cfg_name, model_name, extra, _ = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**SHAPE, **EXTRA[family]})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    arch = "gemma3" if family == "gemma3" else family
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(config.vocab_size)
    if family == "gemma3":
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_sliding_window(config.sliding_window)
    if family == "llama":
        w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([bytes([i]).decode("latin-1") for i in range(config.vocab_size)])
    w.add_token_types([1] * config.vocab_size)
    w.add_token_merges([])
    w.add_token_scores([0.0] * config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    used, i = [], 0
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: the embedding
        base, suffix = hf_name.rsplit(".", 1)
        gname = name_map.get_name(base) + "." + suffix
        if gname in drop:
            continue
        data = p.detach().float().numpy()
        if family == "gemma3" and gname.endswith("norm.weight"):
            data = data + 1  # Gemma's GGUF norms are stored as 1 + w
        if data.ndim == 1:
            w.add_tensor(gname, data)
            continue
        if family == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gname else config.num_key_value_heads
            data = _permute(data, heads)
        if gname == "token_embd.weight":
            qtype = "q8_0"
        else:
            candidates = [t for t in types if t not in K_QUANTS or data.shape[1] % 256 == 0]
            qtype = candidates[i % len(candidates)]
            i += 1
            used.append(qtype)
        stored, raw_dtype = _stored(np.ascontiguousarray(data), qtype, rng)
        w.add_tensor(gname, stored, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, sorted(set(used))
