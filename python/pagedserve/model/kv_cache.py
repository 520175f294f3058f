"""The paged KV store: one tensor per engine, allocated once at start-up.

Layout (the one place it is defined): one tensor [num_layers, 2, num_blocks,
num_kv_heads, block_size * head_dim] (index 0 = K, 1 = V), dtype = model dtype.
Slot s of a layer is block s // block_size, offset s % block_size. Each
(block, KV head) holds a dense matrix:
  K: [head_dim, block_size], the block's keys transposed, so a query's scores
     against a block are head_dim vector FMAs across the block_size keys with
     no horizontal sums (vLLM's key cache layout serves the same purpose);
  V: [block_size, head_dim], rows accumulated with vector FMAs across head_dim.
layer() returns the views every backend takes:
  k_cache [num_blocks, Hkv, head_dim, block_size], v_cache [num_blocks, Hkv, block_size, head_dim].
"""

from __future__ import annotations

import torch


class KVCache:
    """Owns the KV store tensor.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        num_blocks: physical blocks (the C++ BlockPool has the same count).
        block_size: tokens per block.
        dtype: torch.float32 or torch.bfloat16.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.store = torch.zeros((num_layers, 2, num_blocks, num_kv_heads, block_size * head_dim), dtype=dtype)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache [num_blocks, Hkv, D, block_size], v_cache [num_blocks, Hkv, block_size, D]) of one layer."""
        shape = (self.num_blocks, self.num_kv_heads)
        return (self.store[layer_idx, 0].view(*shape, self.head_dim, self.block_size),
                self.store[layer_idx, 1].view(*shape, self.block_size, self.head_dim))

    def copy_blocks(self, blocks_to_copy: torch.Tensor) -> None:
        """Copies whole blocks (every layer, K and V) for copy-on-write.

        blocks_to_copy: [C, 2] int (src, dst) block ids.
        """
        src, dst = blocks_to_copy[:, 0].long(), blocks_to_copy[:, 1].long()
        self.store[:, :, dst] = self.store[:, :, src]

    @property
    def nbytes(self) -> int:
        """Size of the store in bytes."""
        return self.store.numel() * self.store.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem
