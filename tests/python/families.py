"""Tiny random-weight models of every decoder family PagedServe serves, built
from transformers configs and saved locally (no hub). Each entry: the config
class, the model class, and the config fields that exercise what the family
adds (sliding windows, soft-capping, q/k norms, fused projections, learned
positions, scaling multipliers)."""

from __future__ import annotations

import torch
import transformers

WINDOW = 24  # sliding window of the windowed families: shorter than most test prompts
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.15)

# name -> (config class, model class, family-specific config, what it exercises)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "RoPE, GQA"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "q/k/v biases"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "q/k RMSNorm"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}, "sliding window on every layer"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 5.0,
                "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16},
               "alternating sliding/global layers, attention and final logit soft-capping, scaled embeddings"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 16},
               "sliding/global layers with their own RoPE bases, q/k norm, scaled embeddings"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, "fused qkv and gate/up projections"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "vocab_size": 256, "bos_token_id": 1,
              "eos_token_id": 2, "initializer_range": 0.15},
             "learned absolute positions, MHA, fused qkv (Conv1D)"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "q/k norm over the projections, post-norms"),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                 "attention_multiplier": 0.2},
                "embedding/residual/attention multipliers, logits scaling"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, "layers without RoPE (NoPE)"),
}


def available() -> list[str]:
    """The families this transformers provides."""
    return [n for n, (cfg, model, _, _) in FAMILIES.items()
            if hasattr(transformers, cfg) and hasattr(transformers, model)]


def build(name: str, path, seed: int = 0, vocab_size: int | None = None, overrides: dict | None = None) -> str:
    """Saves a tiny random model of the family at path (vocab_size: to match a
    tokenizer saved beside it; overrides: config fields on top of the
    family's); returns the path."""
    cfg_name, model_name, extra, _ = FAMILIES[name]
    kw = dict(extra) if name == "gpt2" else {**COMMON, **extra}
    kw.update(overrides or {})
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).save_pretrained(path)
    return str(path)


def windowed(name: str) -> bool:
    return "sliding_window" in FAMILIES[name][2]
