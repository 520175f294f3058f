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


def unsupported_model_features(hf_config) -> list[str]:
    """Model-level computations the engine's runner skips and so cannot serve
    (the runner applies the lm_head itself): final logit soft-capping."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    cap = _get(cfg, "final_logit_softcapping")
    return [f"final logit soft-capping (cap {cap})"] if cap else []
