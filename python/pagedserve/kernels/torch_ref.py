"""PyTorch reference backend of the paged-attention contract (DESIGN.md section 4).

Blockwise attention with an online softmax (running max ``m``, running sum
``l``, float32 accumulator ``acc``; Milakov & Gimelshein 2018, FlashAttention,
Dao et al. 2022) that reads K/V straight from the physical blocks named by the
block table, a tile of ``blocks_per_tile`` blocks at a time, so its scratch is
O(blocks_per_tile * block_size) per (query token, head) whatever the sequence
length. Decode queries (query length 1) of all sequences are processed as one
batch, and so are prefill chunks of equal length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCKS_PER_TILE = 8


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes the new tokens' K/V into the paged cache, in place.

    Args:
        key, value: [T, Hkv, D], any float dtype (cast to the cache's dtype).
        k_cache: [num_blocks, Hkv, D, block_size], v_cache: [num_blocks, Hkv, block_size, D]
            (pagedserve.model.kv_cache layout: keys transposed per block).
        slot_mapping: [T] int32/int64, physical slot = block_id * block_size + offset.
    Raises:
        IndexError (from torch) if a slot is out of range.
    """
    hkv, block_size = v_cache.shape[1], v_cache.shape[2]
    slots = slot_mapping.long()
    blocks = (slots // block_size)[:, None]
    offsets = (slots % block_size)[:, None]
    heads = torch.arange(hkv)[None, :]
    k_cache[blocks, heads, :, offsets] = key.to(k_cache.dtype)  # indexed dims first: [T, Hkv, D]
    v_cache[blocks, heads, offsets] = value.to(v_cache.dtype)


@dataclass
class _Group:
    """Rows of the batch with the same query length, attended together (all
    decodes form one group; prefill chunks of equal length another)."""

    rows: torch.Tensor  # [B] batch rows
    tokens: torch.Tensor  # [B * Q] their query tokens in the flat batch
    num_queries: int  # Q: queries per row
    # per tile: (rows of the [num_blocks * Hkv, block_size, D] cache view [B, Hkv, nt],
    #            additive mask [B, 1, Q, K] with 0 = visible, -inf = hidden)
    tiles: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionPlan:
    """Everything paged_attention derives from the metadata alone (index math,
    masks); built once per engine step and reused by every layer."""

    groups: list[_Group]


def make_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
              block_size: int, num_kv_heads: int, causal: bool = True,
              blocks_per_tile: int = BLOCKS_PER_TILE) -> AttentionPlan:
    """Builds the AttentionPlan of one step (see paged_attention for the arguments)."""
    heads = torch.arange(num_kv_heads)[None, :, None]
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    groups = []
    for nq in sorted(set(q_lens.tolist())):  # rows with equal query length batch together
        rows = torch.nonzero(q_lens == nq).flatten()
        tokens = (qsl[rows][:, None] + torch.arange(nq)[None, :]).flatten()
        groups.append((rows, tokens, nq))
    plan = AttentionPlan([])
    for rows, tokens, nq in groups:
        lens = seq_lens[rows].long()
        q_pos = (lens - nq)[:, None] + torch.arange(nq)[None, :]  # [B, Q]
        num_blocks = (int(lens.max()) + block_size - 1) // block_size
        tiles = []
        for t0 in range(0, num_blocks, blocks_per_tile):
            ids = block_tables[rows, t0:min(t0 + blocks_per_tile, num_blocks)].long().clamp(min=0)
            k_pos = t0 * block_size + torch.arange(ids.shape[1] * block_size)
            visible = k_pos[None, None, :] < lens[:, None, None]  # [B, 1, K]
            if causal:
                visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, K]
            bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            tiles.append((ids[:, None, :] * num_kv_heads + heads, bias.expand(len(rows), nq, -1).unsqueeze(1)))
        plan.groups.append(_Group(rows, tokens, nq, tiles))
    return plan


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
            scale: float) -> torch.Tensor:
    """Online-softmax attention of q [B, Q, H, D] over the group's tiles -> [B, Q, H, D] float32."""
    b, nq, h, d = q.shape
    hkv, block_size = v_cache.shape[1], v_cache.shape[2]
    g = h // hkv
    k_rows = k_cache.view(-1, d, block_size)  # [num_blocks * Hkv, D, block_size]
    v_rows = v_cache.view(-1, block_size, d)  # [num_blocks * Hkv, block_size, D]
    # [B*Hkv, G*Q, D]: one batched matmul per tile, no broadcast copies of K/V
    qg = (q.float() * scale).view(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * nq, d)
    m = l = acc = None
    for ids, bias in group.tiles:
        nt = ids.shape[2]
        nk = nt * block_size
        k = k_rows[ids].view(b * hkv, nt, d, block_size).permute(0, 2, 1, 3).reshape(b * hkv, d, nk).float()
        v = v_rows[ids].view(b * hkv, nk, d).float()
        s = (torch.bmm(qg, k).view(b, hkv, g, nq, nk) + bias.unsqueeze(1)).view(b * hkv, g * nq, nk)
        m_tile = s.amax(dim=-1, keepdim=True)
        if m is None:  # first tile: it holds key 0, which every query sees
            m = m_tile
            p = torch.exp(s - m)
            l = p.sum(dim=-1, keepdim=True)
            acc = torch.bmm(p, v)
            continue
        m_new = torch.maximum(m, m_tile)
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, v)
        m = m_new
    out = (acc / l).view(b, hkv, g, nq, d)
    return out.permute(0, 3, 1, 2, 4).reshape(b, nq, h, d)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a flat varlen batch of queries over a paged KV cache.

    Query token i of sequence b sits at position seq_lens[b] - q_len[b] + i and
    sees key positions <= its own (all of 0..seq_lens[b]-1 when causal=False).
    GQA/MQA by head grouping (H % Hkv == 0).

    Args:
        query: [T, H, D] float32 or bfloat16.
        k_cache: [num_blocks, Hkv, D, block_size], v_cache: [num_blocks, Hkv, block_size, D]
            (pagedserve.model.kv_cache layout), contiguous.
        query_start_loc: [B+1] int32, prefix sums of query lengths (tokens).
        seq_lens: [B] int32, keys visible per sequence (tokens, includes the queries).
        block_tables: [B, max_blocks] int32, physical block ids, -1 padded.
        scale: softmax scale, usually D ** -0.5.
        plan: make_plan(...) of the same metadata, to share its index math
            across layers; built here when None.
    Returns:
        [T, H, D] in query's dtype.
    Raises:
        ValueError if H is not a multiple of Hkv.
    """
    t, h, d = query.shape
    hkv = k_cache.shape[1]
    if h % hkv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    if plan is None:
        plan = make_plan(query_start_loc, seq_lens, block_tables, v_cache.shape[2], hkv, causal)
    out = torch.empty((t, h, d), dtype=query.dtype)
    for group in plan.groups:
        q = query[group.tokens].view(len(group.rows), group.num_queries, h, d)
        out[group.tokens] = _attend(q, k_cache, v_cache, group, scale).reshape(-1, h, d).to(query.dtype)
    return out


def dense_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Same contract as paged_attention, by gathering each sequence's K/V into a
    contiguous tensor and calling scaled_dot_product_attention. Memory grows
    with the sequence length: a test and benchmark reference, not a backend."""
    t, h, d = query.shape
    hkv, block_size = v_cache.shape[1], v_cache.shape[2]
    out = torch.empty_like(query)
    for b in range(seq_lens.numel()):
        s, e, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        nb = (n + block_size - 1) // block_size
        ids = block_tables[b, :nb].long()
        k = k_cache[ids].permute(0, 3, 1, 2).reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, dim=1)
        v = v_cache[ids].transpose(1, 2).reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, dim=1)
        q = query[s:e].float()
        q_pos = n - (e - s) + torch.arange(e - s)
        mask = torch.arange(n)[None, :] <= q_pos[:, None] if causal else None
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1).to(query.dtype)
    return out
