"""The C++ CPU backend (csrc/backends/cpu/): the default on CPU. Implements
per-layer sliding windows (a decode reads only the blocks inside the window)
and attention logit soft-capping.

KV layout, per layer one tensor [2, num_blocks, Hkv, block_size * D]:
  k_cache [num_blocks, Hkv, D, block_size]: each block's keys transposed, so a
      query's scores against a block are D vector FMAs across the block's keys
      with no horizontal sums (vLLM's CPU key layout serves the same purpose);
  v_cache [num_blocks, Hkv, block_size, D].
The kernels read K/V straight from the blocks with an online softmax, thread
over (sequence, KV head, query chunk) and split long decodes along the KV
length (csrc/backends/cpu/attention/attention_cpu.h). The per-step plan
(``cpu_core.AttentionPlan``) validates the metadata, partitions the work and
sizes the scratch once per step; each layer only checks its tensors against it.
The kernels are compiled for several ISAs and the best this CPU runs is chosen
at start-up (``variants()``; env PAGEDSERVE_CPU_ISA forces a lower one).
"""

from __future__ import annotations

import torch

from . import cpu_core
from .backend import (AttentionBackend, AttentionFeatures, AttentionMetadata, AttentionSpec, KernelVariant,
                      check_layer_params)


class CpuPlan:
    """One step's plans: the C++ AttentionPlan without a window (built and
    validated at once) and one per sliding window a layer asks for (built on the
    first such layer of the step, then shared by the others).

    Args:
        spec: the backend's AttentionSpec.
        metadata: the step's AttentionMetadata.
    Raises:
        KernelArgumentError (a ValueError) on bad metadata.
    """

    def __init__(self, spec: AttentionSpec, metadata: AttentionMetadata) -> None:
        self.spec, self.metadata = spec, metadata
        self.plans: dict[int, cpu_core.AttentionPlan] = {}
        self.for_window(None)

    def for_window(self, sliding_window: int | None) -> cpu_core.AttentionPlan:
        """The C++ plan for this sliding window (None or 0: none)."""
        key = sliding_window or 0
        plan = self.plans.get(key)
        if plan is None:
            s, md = self.spec, self.metadata
            plan = self.plans[key] = cpu_core.AttentionPlan(
                md.query_start_loc, md.seq_lens, md.block_tables, s.num_heads, s.num_kv_heads, s.head_dim,
                s.block_size, s.num_blocks, md.causal, torch.get_num_threads(), key, split_kv=not s.batch_invariant)
        return plan


class CpuAttentionBackend(AttentionBackend):
    """C++ paged attention on the CPU, float32 or bfloat16 caches."""

    name = "cpu"
    priority = 100
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16)

    # Always available: it is part of every build, and its baseline variant runs
    # on any CPU. A PAGEDSERVE_CPU_ISA that names a variant this CPU cannot run
    # is an error at start-up (active_variant raises), never a silent fallback.

    @classmethod
    def variants(cls) -> list[KernelVariant]:
        """The registry's variants, one per attention table this CPU runs
        (avx_vnni runs avx2's attention, so a test need not run both), and
        those it cannot run with the reason."""
        distinct = set(cpu_core.variants_for("attention"))
        return [KernelVariant(name, ok, "" if ok else f"this CPU lacks {needs}")
                for name, ok, needs in cpu_core.compiled_isas() if name in distinct or not ok]

    @classmethod
    def use_variant(cls, name: str) -> None:
        cpu_core.set_kernel_isa(name)

    @classmethod
    def active_variant(cls) -> str:
        """Raises pagedserve.errors.InvalidArgumentError if PAGEDSERVE_CPU_ISA
        names a variant this build lacks or this CPU cannot execute."""
        return cpu_core.kernel_isa()

    def kv_cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (2, s.num_blocks, s.num_kv_heads, s.block_size * s.head_dim)

    def split_kv_cache(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        head = (s.num_blocks, s.num_kv_heads)
        return (layer_cache[0].view(*head, s.head_dim, s.block_size),
                layer_cache[1].view(*head, s.block_size, s.head_dim))

    def copy_blocks(self, kv_cache: torch.Tensor, blocks_to_copy: torch.Tensor) -> None:
        src, dst = blocks_to_copy[:, 0].long(), blocks_to_copy[:, 1].long()
        kv_cache[:, :, dst] = kv_cache[:, :, src]  # every layer, K and V, in one indexed copy

    @classmethod
    def unsupported_features(cls, features: AttentionFeatures) -> list[str]:
        return cls.only_window_and_softcap(features)

    def make_plan(self, metadata: AttentionMetadata) -> CpuPlan:
        """Validates the step's metadata and partitions its work (raises
        KernelArgumentError, a ValueError, on a bad index)."""
        return CpuPlan(self.spec, metadata)

    def allocate_kv_cache(self, num_layers: int) -> torch.Tensor:
        """The zeroed store, advised for transparent huge pages before it is
        first written (``cpu_core.advise_huge_pages``): every decode step
        reads blocks spread over the whole store, and with 4 KiB pages their
        TLB misses cost (most in a virtual machine). Its memory is an
        anonymous mapping (zero_store), zero by the OS's guarantee and
        resident only once written: a start does not touch a 1 GiB store's
        pages (about 1 s here), and the process holds the KV it uses."""
        shape = (num_layers, *self.kv_cache_shape())
        return zero_store(shape, self.spec.dtype)

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if key.dtype != k_cache.dtype:
            key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        cpu_core.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, torch.get_num_threads())

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CpuPlan,
                        scale: float, sliding_window: int | None = None,
                        logit_softcap: float | None = None) -> torch.Tensor:
        if query.dtype != k_cache.dtype:
            query = query.to(k_cache.dtype)
        if query.stride(-1) != 1:
            query = query.contiguous()
        window, cap = check_layer_params(sliding_window, logit_softcap)
        out = torch.empty(query.shape, dtype=query.dtype)
        plan.for_window(window).run(out, query, k_cache, v_cache, scale, cap)
        return out


def zero_store(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of ``shape`` and ``dtype`` on fresh anonymous memory
    (Python's ``mmap``: pages the OS maps as zero and backs on first write),
    aligned to 2 MiB and advised for transparent huge pages. Where anonymous
    mappings are not available, ``torch.zeros``. The mapping lives as long
    as the tensor (numpy's buffer keeps it)."""
    import mmap

    import numpy as np

    align = 2 << 20
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    try:
        region = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return torch.zeros(shape, dtype=dtype)
    raw = np.frombuffer(region, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    flat = torch.from_numpy(raw[offset:offset + nbytes])
    cpu_core.advise_huge_pages(flat.data_ptr(), nbytes)
    return flat.view(dtype).view(shape)


def scratch_bytes(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Bytes of scratch one worker thread uses, whatever the sequence lengths."""
    return cpu_core.paged_attention_scratch_bytes(num_heads, num_kv_heads, head_dim, block_size)
