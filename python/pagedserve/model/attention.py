"""Our attention function, plugged into transformers' attention-function
interface (``AttentionInterface``) under the name ``"pagedserve"``.

Per layer it writes the new tokens' K/V into the paged store at slot_mapping
(reshape_and_cache), then attends over each sequence's blocks (paged_attention).
The step's metadata reaches it through ``forward_context``, set by the
ModelRunner around the one forward pass of the step.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from types import ModuleType

import torch

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass
class AttentionMetadata:
    """Per-step attention metadata (all CPU tensors).

    Attributes:
        slot_mapping: [T] int64, cache slot of each new token.
        query_start_loc: [B+1] int32, query prefix sums.
        seq_lens: [B] int32, keys visible per sequence.
        block_tables: [B, max_blocks] int32, -1 padded.
        plan: backend-specific precomputation shared by all layers of the step
            (built by the first layer through backend.make_plan, if it has one).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    plan: object = None


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    kv_cache: object  # pagedserve.model.kv_cache.KVCache
    backend: ModuleType


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
                            **kwargs):
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D]
    (RoPE applied) -> ([1, T, H, D], None). Raises RuntimeError outside a forward_context."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("pagedserve attention called outside ModelRunner.execute")
    md = ctx.metadata
    k_cache, v_cache = ctx.kv_cache.layer(module.layer_idx)
    q = query[0].transpose(0, 1)
    ctx.backend.reshape_and_cache(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache,
                                  v_cache, md.slot_mapping)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kwargs = {}
    if hasattr(ctx.backend, "make_plan"):
        if md.plan is None:
            md.plan = ctx.backend.make_plan(md.query_start_loc, md.seq_lens, md.block_tables,
                                            v_cache.shape[2], v_cache.shape[1])
        kwargs["plan"] = md.plan
    out = ctx.backend.paged_attention(q, k_cache, v_cache, md.query_start_loc, md.seq_lens,
                                      md.block_tables, scale, **kwargs)
    return out.unsqueeze(0), None


def register() -> str:
    """Registers the function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
