"""The Apple Metal backend (csrc/backends/metal/, kernels in metal/*.metal):
paged attention on the GPU of Apple silicon, in float32, float16 or bfloat16
(float32 accumulation). Built where ``PAGEDSERVE_METAL`` (AUTO by default)
finds macOS on arm64 with a working Metal toolchain; elsewhere the registry
lists it with the reason it is unavailable.

KV layout, per layer one tensor [2, num_blocks, Hkv, block_size, D]:
k_cache and v_cache [num_blocks, Hkv, block_size, D] (K then V), the layout the
kernels read with one SIMD group per query head group.

The KV store is one shared-storage MTLBuffer: the CPU and the GPU see the same
memory (Apple silicon's unified memory), and ``allocate_kv_cache`` hands it to
Python as a CPU tensor viewing that buffer without a copy (``torch.frombuffer``
over the buffer protocol; bfloat16 and float16 through a view of the bytes).
The buffer is freed when the last view of it is gone. The model itself runs on
the CPU; each layer's ``reshape_and_cache`` and ``paged_attention`` copy their
inputs into preallocated shared staging buffers, run one Metal command buffer
and wait for it (docs: the per-layer synchronisation and what it costs).
Running the whole model on MPS, with the store as an MPS tensor, is a later
step.

``split_kv`` ("auto", "on", "off") and ``partition_size`` on an instance choose
split-KV decode (flash-decoding) for the plans it makes; the tests use them.
Environment: PAGEDSERVE_METALLIB=<path> loads that .metallib and nothing else
(no fallback) instead of the one installed next to ``_core``;
PAGEDSERVE_METAL_SOURCE=1 compiles the embedded kernel source at run time
instead; setting both is an error; both are read once, when the device opens.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from .. import _core
from ..errors import BackendUnavailableError, KernelArgumentError
from .backend import (AttentionBackend, AttentionMetadata, AttentionSpec, Availability, check_layer_params)

_metal = getattr(_core, "metal", None)  # absent from builds without the Metal backend (every Linux build)
_availability: Availability | None = None


def _not_built_reason() -> str:
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return ("this build has no Metal backend: it was configured with PAGEDSERVE_METAL=OFF or without a "
                "working Metal toolchain (`xcrun -sdk macosx metal` must compile a kernel; with Xcode 26 or later: "
                "`xcodebuild -downloadComponent MetalToolchain`); reinstall after fixing that")
    return ("this build has no Metal backend: it needs macOS on Apple silicon, built with PAGEDSERVE_METAL "
            "(AUTO, the default, or ON)")


def device_info() -> dict | None:
    """The Metal device and where its kernels came from (name, library,
    max_buffer_length, recommended_working_set, unified_memory), or None where
    the backend is unavailable."""
    if not MetalAttentionBackend.availability().available:
        return None
    return _metal.device_info()


class MetalPlan:
    """One step's C++ plan (``_core.metal.Plan``: the validated metadata, its
    own copy of it, and the decode/merge/prefill launches), shared by every
    layer of the step.

    Raises:
        KernelArgumentError (a ValueError) on bad metadata.
    """

    def __init__(self, backend: MetalAttentionBackend, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self.plan = backend._impl.make_plan(metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                                            metadata.causal, split=backend.split_kv,
                                            partition_size=backend.partition_size)


class MetalAttentionBackend(AttentionBackend):
    """Paged attention in Metal kernels over a KV store in shared memory."""

    name = "metal"
    priority = 200  # above cpu's 100: `auto` picks the GPU on Apple silicon
    devices = ("cpu",)  # the store and every tensor crossing are CPU-visible
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    split_kv: str = "auto"     # split-KV decode: "auto", "on" or "off"
    partition_size: int = 512  # keys per split-KV partition (a multiple of 32)

    @classmethod
    def availability(cls) -> Availability:
        """Built (``_core.metal`` exists) and a Metal device with its kernel
        library opens (decided once per process)."""
        global _availability
        if _availability is None:
            if _metal is None:
                _availability = Availability(False, _not_built_reason())
            else:
                try:
                    _metal.device_info()
                    _availability = Availability(True)
                except Exception as e:  # no GPU, or no kernel library: the reason says which
                    _availability = Availability(False, f"no usable Metal device or kernel library: {e}")
        return _availability

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        avail = self.availability()
        if not avail.available:
            raise BackendUnavailableError(f"the metal attention backend is unavailable: {avail.reason}")
        if torch.device(spec.device).type != "cpu":
            raise BackendUnavailableError(f"the metal backend's tensors live on the CPU (shared memory), not "
                                          f"{spec.device}")
        if spec.dtype not in self.dtypes:
            raise BackendUnavailableError(f"the metal backend takes float32, float16 or bfloat16, not {spec.dtype}")
        self._impl = _metal.Backend(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size,
                                    spec.num_blocks, str(spec.dtype).removeprefix("torch."))

    # ---- KV layout -----------------------------------------------------------
    def kv_cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (2, s.num_blocks, s.num_kv_heads, s.block_size, s.head_dim)

    def allocate_kv_cache(self, num_layers: int) -> torch.Tensor:
        """The store as a CPU tensor viewing one zeroed shared MTLBuffer (no
        copy); the buffer lives as long as any view of it. Raises RuntimeError
        when the device cannot allocate it (past its largest buffer)."""
        buffer = self._impl.allocate_kv_store(num_layers)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)  # holds `buffer` until the last view is gone
        return flat.view(self.spec.dtype).view(num_layers, *self.kv_cache_shape())

    def split_kv_cache(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer_cache[0], layer_cache[1]

    def copy_blocks(self, kv_cache: torch.Tensor, blocks_to_copy: torch.Tensor) -> None:
        """On the CPU, in the shared store (the GPU sees it at its next command buffer)."""
        src, dst = blocks_to_copy[:, 0].long(), blocks_to_copy[:, 1].long()
        kv_cache[:, :, dst] = kv_cache[:, :, src]

    # ---- per step and per layer ----------------------------------------------
    def make_plan(self, metadata: AttentionMetadata) -> MetalPlan:
        """Validates the step's metadata (the shared checks, in C++) and plans
        its launches. Raises KernelArgumentError."""
        return MetalPlan(self, metadata)

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if key.dtype != k_cache.dtype:
            key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        self._impl.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: MetalPlan,
                        scale: float, sliding_window: int | None = None,
                        logit_softcap: float | None = None) -> torch.Tensor:
        window, cap = check_layer_params(sliding_window, logit_softcap)
        if window or cap:
            raise KernelArgumentError("the metal backend implements neither sliding windows nor logit soft-capping")
        if query.dtype != k_cache.dtype:
            query = query.to(k_cache.dtype)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        self._impl.paged_attention(out, query, k_cache, v_cache, plan.plan, float(scale))
        return out

    # ---- measurements ------------------------------------------------------------
    @property
    def last_gpu_seconds(self) -> float:
        """GPU time of the last call's command buffer (GPUEndTime - GPUStartTime)."""
        return self._impl.last_gpu_seconds

    @property
    def staging_stats(self) -> dict[str, Any]:
        """Allocations and sizes of this instance's staging buffers, metadata
        uploads and command buffers run (the tests check nothing is allocated per call)."""
        return self._impl.staging_stats
