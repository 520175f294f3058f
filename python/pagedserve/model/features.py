"""What a Hugging Face model's attention needs beyond plain causal softmax
attention, read from its config, so that a model the attention backends cannot
compute exactly is refused at load time with the reason instead of decoding
wrongly (the attention hook would otherwise drop a sliding window or a
soft-cap silently).
"""

from __future__ import annotations

import torch

from ..kernels.backend import AttentionFeatures


def _get(obj, name: str, default=None):
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def attention_features(hf_config, max_model_len: int, model: torch.nn.Module | None = None) -> AttentionFeatures:
    """The attention features of a model (transformers config; the loaded
    model too, when given, for parameters the config does not announce).

    A sliding window counts only if it can mask something: with
    max_model_len <= window every key a query may see is inside the window
    (transformers masks key k for query q when q - k >= window).
    """
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    window = _get(cfg, "sliding_window")
    layer_types = _get(cfg, "layer_types")
    if layer_types:  # the per-layer truth where the config has it (Gemma, Qwen2's max_window_layers, ...)
        uses_window = window is not None and "sliding_attention" in layer_types
    else:
        uses_window = window is not None and _get(cfg, "use_sliding_window", True) is not False
    if isinstance(window, int) and max_model_len <= window:
        uses_window = False
    softcap = _get(cfg, "attn_logit_softcapping")
    attn_config = _get(cfg, "attn_config")
    alibi = bool(_get(cfg, "alibi", False) or _get(cfg, "position_embedding_type") == "alibi"
                 or (attn_config is not None and _get(attn_config, "alibi", False))
                 or _get(cfg, "model_type") in ("bloom", "mpt", "jais"))
    sinks = _get(cfg, "model_type") == "gpt_oss" or (
        model is not None and any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()))
    return AttentionFeatures(sliding_window=int(window) if uses_window else None,
                             logit_softcap=float(softcap) if softcap else None, alibi=alibi, sinks=sinks)


def dynamic_rope_limit(hf_config) -> tuple[str, int] | None:
    """(rope type, position limit) when the model's RoPE recomputes its
    frequencies from the longest position in each forward pass (transformers'
    "longrope" — Phi-3 128k, Phi-3.5, Phi-4-mini — and "dynamic" NTK): in a
    packed batch that longest position belongs to another sequence, so the
    engine computes such a model exactly only while every position stays below
    the limit, where the frequencies never change. None otherwise."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    params = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    sets = [params] if "rope_type" in params or "type" in params else [v for v in params.values()
                                                                        if isinstance(v, dict)]
    for p in sets:
        kind = p.get("rope_type") or p.get("type") or ""
        if kind == "longrope":
            limit = p.get("original_max_position_embeddings") or _get(cfg, "original_max_position_embeddings")
            return kind, int(limit)
        if "dynamic" in kind:
            return kind, int(p.get("original_max_position_embeddings") or _get(cfg, "max_position_embeddings"))
    return None


# What causal LMs do to the lm_head's output, by model_type (the runner applies
# the lm_head itself, so it must repeat it); Granite divides by logits_scaling,
# HyperCLOVAX multiplies by it.
_DIVIDE_BY_LOGITS_SCALING = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa")
_MULTIPLY_BY_LOGITS_SCALING = ("hyperclovax",)


def logits_transform(hf_config):
    """What a causal LM's own forward does to the lm_head's output, which the
    runner must repeat: Gemma 2/3's final soft-cap (cap * tanh(x / cap)),
    Granite's division by logits_scaling, HyperCLOVAX's multiplication by it,
    Cohere's multiplication by logit_scale. Returns a function logits -> logits,
    or None when there is nothing to do. (The start-up check compares the
    engine's logits with the Hugging Face forward's, so a step missing from
    this list refuses the model instead of serving wrong logits.)"""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = _get(cfg, "model_type")
    cap = _get(cfg, "final_logit_softcapping")
    scaling = _get(cfg, "logits_scaling")
    divide = scaling if kind in _DIVIDE_BY_LOGITS_SCALING and scaling not in (None, 1, 1.0) else None
    multiply = _get(cfg, "logit_scale") if kind in ("cohere", "cohere2", "cohere2_moe") else None
    if kind in _MULTIPLY_BY_LOGITS_SCALING and scaling not in (None, 1, 1.0):
        multiply = scaling
    if multiply in (1, 1.0):
        multiply = None
    if not cap and divide is None and multiply is None:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if multiply is not None:
            logits = logits * multiply
        if divide is not None:
            logits = logits / divide
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform
