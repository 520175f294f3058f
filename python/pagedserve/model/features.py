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
    layer_types = _get(cfg, "layer_types") or []
    uses_window = window is not None and (
        _get(cfg, "use_sliding_window", True) is not False or "sliding_attention" in layer_types)
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


def logits_transform(hf_config):
    """What a causal LM's own forward does to the lm_head's output, which the
    runner must repeat since it applies the lm_head itself: Gemma 2/3's final
    soft-cap (cap * tanh(x / cap)), Granite's division by logits_scaling,
    Cohere's multiplication by logit_scale. Returns a function logits -> logits,
    or None when there is nothing to do. (The start-up check compares the
    engine's logits with the Hugging Face forward's, so a transform missing
    from this list refuses the model instead of serving wrong logits.)"""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    cap = _get(cfg, "final_logit_softcapping")
    divide = _get(cfg, "logits_scaling")
    multiply = _get(cfg, "logit_scale")
    if not cap and divide in (None, 1, 1.0) and multiply in (None, 1, 1.0):
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if multiply not in (None, 1, 1.0):
            logits = logits * multiply
        if divide not in (None, 1, 1.0):
            logits = logits / divide
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform
