"""A backend that exists only in the tests: registered in conftest.py, it must
reach the CLI's choices, the parity suite and the engine with no other file
changed. It keeps its own KV layout (vLLM's flash layout, [num_blocks,
block_size, Hkv, D] for K and V) and computes attention by gathering each
sequence's blocks and calling torch's SDPA: slow, simple, correct."""

from __future__ import annotations

import torch

from pagedserve import _core
from pagedserve.kernels.backend import AttentionBackend, AttentionMetadata, check_layer_params
from pagedserve.kernels.torch_ref import dense_attention


class FakeGatherBackend(AttentionBackend):
    name = "fake"
    priority = -1  # never chosen by auto
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16)

    def kv_cache_shape(self):
        s = self.spec
        return (2, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def split_kv_cache(self, layer_cache):
        return layer_cache[0], layer_cache[1]

    def make_plan(self, md: AttentionMetadata):
        s = self.spec
        _core.check_attention_metadata(md.query_start_loc, md.seq_lens, md.block_tables, s.num_heads,
                                       s.num_kv_heads, s.head_dim, s.block_size, s.num_blocks)
        bs = self.spec.block_size
        slots = []  # per sequence: the slots of its positions 0..seq_len-1
        for b, n in enumerate(md.seq_lens.tolist()):
            pos = torch.arange(n)
            slots.append(md.block_tables[b].long()[pos // bs] * bs + pos % bs)
        return md.query_start_loc, slots, md.causal

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        bs = self.spec.block_size
        k_cache[slots // bs, slots % bs] = key[keep].to(k_cache.dtype)
        v_cache[slots // bs, slots % bs] = value[keep].to(v_cache.dtype)

    @classmethod
    def unsupported_features(cls, features):
        return cls.only_window_and_softcap(features)

    def paged_attention(self, query, k_cache, v_cache, plan, scale, sliding_window=None, logit_softcap=None):
        sliding_window, logit_softcap = check_layer_params(sliding_window, logit_softcap)
        qsl, slots, causal = plan
        bs = self.spec.block_size
        keys = [k_cache[s // bs, s % bs] for s in slots]
        values = [v_cache[s // bs, s % bs] for s in slots]
        return dense_attention(query, keys, values, qsl, scale, causal, sliding_window, logit_softcap).to(
            k_cache.dtype)
