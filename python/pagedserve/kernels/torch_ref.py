"""The PyTorch reference backend: the attention contract in plain torch ops,
device-agnostic, and the yardstick the other backends are tested against.

KV layout, per layer one tensor [2, num_blocks, Hkv, block_size, D]: K and V
alike, [num_blocks, Hkv, block_size, D] each (no transposition: this backend
gathers whole blocks and multiplies them as matrices).

Blockwise attention with an online softmax (running max ``m``, running sum
``l``, float32 accumulator ``acc``; Milakov & Gimelshein 2018, FlashAttention,
Dao et al. 2022) that reads K/V straight from the physical blocks named by the
block table, a tile of ``BLOCKS_PER_TILE`` blocks at a time, so its scratch is
O(BLOCKS_PER_TILE * block_size) per (query token, head) whatever the sequence
length. Decode queries (query length 1) of all sequences are processed as one
batch, and so are prefill chunks of equal length; the index math and masks
are the per-step plan, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _core
from .backend import AttentionBackend, AttentionFeatures, AttentionMetadata, check_layer_params

BLOCKS_PER_TILE = 8


@dataclass
class _Group:
    """Rows of the batch with the same query length, attended together."""

    tokens: torch.Tensor  # [B * Q] their query tokens in the flat batch
    num_rows: int  # B
    num_queries: int  # Q: queries per row
    # per tile: (rows of the [num_blocks * Hkv, block_size, D] cache view [B, Hkv, nt],
    #            visible [B, 1, Q, K] bool, keys inside the sequence [B, 1, K] bool)
    tiles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class TorchAttentionPlan:
    """Everything paged_attention derives from the metadata alone (index math,
    masks), on the backend's device; built once per engine step."""

    groups: list[_Group]
    num_tokens: int


def make_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
              block_size: int, num_kv_heads: int, causal: bool = True, device: torch.device | str = "cpu",
              sliding_window: int | None = None, blocks_per_tile: int = BLOCKS_PER_TILE) -> TorchAttentionPlan:
    """Builds the plan of one step for one sliding window (arguments: see
    AttentionMetadata; sliding_window None: none)."""
    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    qsl = query_start_loc.long().to(device)
    lens_all = seq_lens.long().to(device)
    tables = block_tables.long().to(device)
    q_lens = qsl[1:] - qsl[:-1]
    plan = TorchAttentionPlan([], int(query_start_loc[-1]))
    for nq in sorted(set(q_lens.tolist())):  # rows with equal query length batch together
        if nq == 0:
            continue
        rows = torch.nonzero(q_lens == nq).flatten()
        tokens = (qsl[rows][:, None] + torch.arange(nq, device=device)[None, :]).flatten()
        lens = lens_all[rows]
        q_pos = (lens - nq)[:, None] + torch.arange(nq, device=device)[None, :]  # [B, Q]
        num_blocks = (int(lens.max()) + block_size - 1) // block_size
        tiles = []
        for t0 in range(0, num_blocks, blocks_per_tile):
            ids = tables[rows, t0:min(t0 + blocks_per_tile, num_blocks)].clamp(min=0)
            k_pos = t0 * block_size + torch.arange(ids.shape[1] * block_size, device=device)
            in_seq = k_pos[None, None, :] < lens[:, None, None]  # [B, 1, K]
            visible = in_seq
            if causal:
                visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, K]
            if sliding_window:
                visible = visible & (k_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
            tiles.append((ids[:, None, :] * num_kv_heads + heads, visible.expand(len(rows), nq, -1).unsqueeze(1),
                          in_seq))
        plan.groups.append(_Group(tokens, len(rows), nq, tiles))
    return plan


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    """Online-softmax attention of q [B, Q, H, D] over the group's tiles -> [B, Q, H, D] float32.
    softcap: scores s become softcap * tanh(s / softcap) before the mask."""
    b, nq, h, d = q.shape
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    g = h // hkv
    k_rows = k_cache.view(-1, block_size, d)  # [num_blocks * Hkv, block_size, D]
    v_rows = v_cache.view(-1, block_size, d)
    # [B*Hkv, G*Q, D]: one batched matmul per tile, no broadcast copies of K/V
    qg = (q.float() * scale).view(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * nq, d)
    m = l = acc = None
    for ids, visible, in_seq in group.tiles:
        nk = ids.shape[2] * block_size
        k = k_rows[ids].view(b * hkv, nk, d).float()
        # slots past the sequence may hold anything (a block's earlier owner): zero them, as 0 * NaN is NaN
        v = v_rows[ids].view(b, hkv, nk, d).float().masked_fill(~in_seq[:, :, :, None], 0.0).view(b * hkv, nk, d)
        s = torch.bmm(qg, k.transpose(1, 2))
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.view(b, hkv, g, nq, nk).masked_fill(~visible.unsqueeze(1), float("-inf")).view(b * hkv, g * nq, nk)
        m_tile = s.amax(dim=-1, keepdim=True)
        if m is None:  # first tile
            m = m_tile.clamp(min=torch.finfo(s.dtype).min)  # a row may see nothing in it (sliding window)
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


class TorchPlanSet:
    """One step's plans, one per sliding window a layer asks for (built on first
    use in the step, shared by the other layers)."""

    def __init__(self, backend: "TorchAttentionBackend", metadata: AttentionMetadata) -> None:
        self.backend, self.metadata = backend, metadata
        self.plans: dict[int, TorchAttentionPlan] = {}

    def for_window(self, sliding_window: int | None) -> TorchAttentionPlan:
        key = sliding_window or 0
        if key not in self.plans:
            md, s = self.metadata, self.backend.spec
            self.plans[key] = make_plan(md.query_start_loc, md.seq_lens, md.block_tables, s.block_size,
                                        s.num_kv_heads, md.causal, s.device, key or None)
        return self.plans[key]


class TorchAttentionBackend(AttentionBackend):
    """Blockwise online-softmax attention in torch ops, on any torch device."""

    name = "torch"
    priority = 10
    devices = ("cpu", "cuda", "mps")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def kv_cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (2, s.num_blocks, s.num_kv_heads, s.block_size, s.head_dim)

    def split_kv_cache(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer_cache[0], layer_cache[1]

    @classmethod
    def unsupported_features(cls, features: AttentionFeatures) -> list[str]:
        return cls.only_window_and_softcap(features)

    def make_plan(self, metadata: AttentionMetadata) -> TorchPlanSet:
        """Validates the host metadata with the checks every backend shares (raises
        KernelArgumentError), then builds the window-free plan on the device."""
        s = self.spec
        _core.check_attention_metadata(metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                                       s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, s.num_blocks)
        plans = TorchPlanSet(self, metadata)
        plans.for_window(None)
        return plans

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Raises IndexError (from torch) if a slot is out of range."""
        hkv, block_size = k_cache.shape[1], k_cache.shape[2]
        slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        blocks = (slots // block_size)[:, None]
        offsets = (slots % block_size)[:, None]
        heads = torch.arange(hkv, device=k_cache.device)[None, :]
        k_cache[blocks, heads, offsets] = key.to(k_cache.dtype)  # indexed dims first: [T, Hkv, D]
        v_cache[blocks, heads, offsets] = value.to(v_cache.dtype)

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: TorchPlanSet, scale: float, sliding_window: int | None = None,
                        logit_softcap: float | None = None) -> torch.Tensor:
        """Raises ValueError if H is not a multiple of Hkv."""
        t, h, d = query.shape
        if h % k_cache.shape[1]:
            raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {k_cache.shape[1]}")
        window, cap = check_layer_params(sliding_window, logit_softcap)
        out = torch.empty((t, h, d), dtype=k_cache.dtype, device=query.device)
        for group in plan.for_window(window).groups:
            q = query[group.tokens].view(group.num_rows, group.num_queries, h, d)
            out[group.tokens] = _attend(q, k_cache, v_cache, group, scale, cap).reshape(-1, h, d).to(out.dtype)
        return out


def dense_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    query_start_loc: torch.Tensor, scale: float, causal: bool = True,
                    sliding_window: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
    """The contract's meaning without any paging: sequence b's queries
    query[qsl[b]:qsl[b+1]] ([q_len, H, D]) attend over its whole K/V given as
    keys[b], values[b] ([seq_len, Hkv, D], positions 0..seq_len-1), in float32,
    with the same mask (causal, sliding window: key k visible to query q iff
    k > q - sliding_window) and soft-cap (cap * tanh(s / cap)), through torch's
    scaled_dot_product_attention (an explicit softmax when soft-capped). Memory
    grows with the sequence length: a test and benchmark reference, not a
    backend. Returns [T, H, D] float32."""
    t, h, d = query.shape
    out = torch.empty((t, h, d), dtype=torch.float32, device=query.device)
    for b, (k, v) in enumerate(zip(keys, values)):
        s, e, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), k.shape[0]
        if e == s:
            continue
        group = h // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[s:e].float().transpose(0, 1)  # [H, q_len, D]
        q_pos = n - (e - s) + torch.arange(e - s, device=query.device)
        k_pos = torch.arange(n, device=query.device)
        visible = torch.ones((e - s, n), dtype=torch.bool, device=query.device)
        if causal:
            visible &= k_pos[None, :] <= q_pos[:, None]
        if sliding_window:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if logit_softcap:
            scores = logit_softcap * torch.tanh(torch.matmul(q, k.transpose(1, 2)) * scale / logit_softcap)
            o = torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1), v)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out
