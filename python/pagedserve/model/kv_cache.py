"""The paged KV store: one tensor per engine, allocated once at start-up on the
engine's device, in the layout the attention backend asks for
(``AttentionBackend.kv_cache_shape``; docs/architecture.md lists each
backend's). Slot s of a layer is block s // block_size, offset s % block_size
in whatever layout; the C++ BlockPool hands out the same block ids.
"""

from __future__ import annotations

import torch

from ..kernels.backend import AttentionBackend


class KVCache:
    """Owns the KV store tensor and its per-layer (k_cache, v_cache) views.

    Args:
        num_layers: attention layers of the model.
        backend: the engine's attention backend; its spec gives num_blocks,
            block_size, num_kv_heads, head_dim, dtype and device.
    """

    def __init__(self, num_layers: int, backend: AttentionBackend) -> None:
        spec = backend.spec
        self.backend = backend
        self.num_blocks, self.block_size = spec.num_blocks, spec.block_size
        self.store = backend.allocate_kv_cache(num_layers)
        self._layers = [backend.split_kv_cache(self.store[i]) for i in range(num_layers)]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, in the backend's layout (views, no copy)."""
        return self._layers[layer_idx]

    def copy_blocks(self, blocks_to_copy: torch.Tensor) -> None:
        """Copies whole blocks (every layer, K and V) for copy-on-write.

        blocks_to_copy: [C, 2] int (src, dst) block ids.
        """
        self.backend.copy_blocks(self.store, blocks_to_copy)

    @property
    def nbytes(self) -> int:
        """Size of the store in bytes."""
        return self.store.numel() * self.store.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V (every layout stores
        exactly block_size * num_kv_heads * head_dim elements per block for each)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem
