"""Our attention function, plugged into transformers' attention-function
interface (``AttentionInterface``) under the name ``"pagedserve"``.

Per layer it writes the new tokens' K/V into the paged store at slot_mapping
(the backend's reshape_and_cache), then attends over each sequence's blocks
(the backend's paged_attention) with the step's plan. The step's plan, KV
store and backend reach it through ``forward_context``, set by the
ModelRunner around the one forward pass of the step.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from ..kernels.backend import AttentionBackend

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass
class ForwardContext:
    """What every layer of one forward pass shares.

    Attributes:
        plan: the backend's make_plan(metadata) of this step.
        slot_mapping: [T] int64 KV slot of each token.
        kv_cache: pagedserve.model.kv_cache.KVCache.
        backend: the AttentionBackend instance.
        max_model_len: sliding windows at least this long mask nothing.
        calls: attention layers run so far in this pass (the start-up check
            makes sure every layer came through here, once).
        windows: the sliding windows the layers asked for.
    """

    plan: Any
    slot_mapping: Any
    kv_cache: Any
    backend: AttentionBackend
    max_model_len: int
    calls: int = 0
    windows: set = field(default_factory=set)


_local = threading.local()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    """Makes ``ctx`` visible to paged_attention_forward for one forward pass."""
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = None


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D]
    (RoPE applied) -> ([1, T, H, D], None). The layer's own sliding_window and
    softcap (transformers passes them per layer: Mistral, Gemma 2/3, Qwen2/3,
    Phi-3, SmolLM3) go to the backend; the mask transformers built is not used,
    the plan carries the step's causal structure. Raises RuntimeError outside a
    forward_context or for attention sinks, which no backend implements."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("pagedserve attention called outside ModelRunner.execute")
    if kwargs.get("s_aux") is not None:  # safety net behind the load-time refusal (model/features.py)
        raise RuntimeError("this layer uses attention sinks, which the attention backends do not implement")
    if sliding_window is not None and sliding_window >= ctx.max_model_len:
        sliding_window = None  # can mask nothing: no position is that far from another
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(ctx, module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 scale, sliding_window, softcap)
    return out.unsqueeze(0), None


def attend(ctx: ForwardContext, layer_idx: int, query, key, value, scale: float, sliding_window: int | None = None,
           softcap: float | None = None):
    """One layer's paged attention, for every forward (the Hugging Face modules'
    hook above and the lean Llama forward): writes the step's key/value
    [T, Hkv, D] into layer ``layer_idx``'s blocks at ctx.slot_mapping
    (reshape_and_cache), then attends query [T, H, D] over each sequence's
    blocks with the step's plan (paged_attention) -> [T, H, D] in the cache
    dtype; counts the call and its window in ctx (the start-up check). scale:
    the softmax scale; sliding_window / softcap: the layer's own (None: none)."""
    ctx.calls += 1
    ctx.windows.add(sliding_window)
    k_cache, v_cache = ctx.kv_cache.layer(layer_idx)
    ctx.backend.reshape_and_cache(key, value, k_cache, v_cache, ctx.slot_mapping)
    return ctx.backend.paged_attention(query, k_cache, v_cache, ctx.plan, scale, sliding_window=sliding_window,
                                       logit_softcap=softcap)


def register() -> str:
    """Registers the function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
