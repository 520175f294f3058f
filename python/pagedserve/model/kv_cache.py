"""The paged KV store: one tensor per engine, allocated once at start-up.

Layout (the one place it is defined): [num_layers, 2, num_blocks, num_kv_heads,
block_size, head_dim] (index 0 = K, 1 = V), dtype = model dtype. Slot s of a
layer is block s // block_size, offset s % block_size. Within a block each KV
head's block_size x head_dim rows are contiguous, so a kernel reads one head's
keys of a block as one dense matrix (vLLM's CPU layout does the same).
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
        self.store = torch.zeros(
            (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer, each [num_blocks, Hkv, block_size, D]."""
        return self.store[layer_idx, 0], self.store[layer_idx, 1]

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
