"""C++ CPU backend (csrc/attention_cpu.cc): the default on CPU.

Reads K/V straight from the physical blocks with an online softmax; threads
over (sequence, KV head, query chunk) and splits long decodes along the KV
length, using torch's intra-op thread count. Takes the torch tensors without
copying them; checks shapes, dtypes, layout and every index before reading.
"""

from __future__ import annotations

import torch

from .. import _core


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, Hkv, block_size, D]
    at slot_mapping [T] (int32/int64). key/value are cast to the cache dtype if needed.
    Raises pagedserve.errors.KernelArgumentError (a ValueError) on bad arguments."""
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    _core.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, causal: bool = True) -> torch.Tensor:
    """Same contract as pagedserve.kernels.torch_ref.paged_attention: query [T, H, D]
    (last dim contiguous, cache dtype), caches [num_blocks, Hkv, block_size, D],
    query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks] int32 -> [T, H, D].
    Raises pagedserve.errors.KernelArgumentError (a ValueError) on bad arguments."""
    if query.dtype != k_cache.dtype:
        query = query.to(k_cache.dtype)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    _core.paged_attention(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                          causal, torch.get_num_threads())
    return out


def scratch_bytes(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Bytes of scratch one worker thread uses, whatever the sequence lengths."""
    return _core.paged_attention_scratch_bytes(num_heads, num_kv_heads, head_dim, block_size)
