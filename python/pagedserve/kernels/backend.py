"""The attention-backend contract (vLLM's AttentionBackend is the model;
docs/architecture.md, "The attention backend contract").

A backend is a subclass of ``AttentionBackend`` with one registry entry
(pagedserve.kernels). The engine builds one instance per model
(``AttentionBackend(spec)``) and asks it for everything attention needs:

- the KV cache layout: ``kv_cache_shape`` (one layer, K and V together),
  ``allocate_kv_cache``, ``split_kv_cache`` into the (k_cache, v_cache) views
  its kernels take; the store never assumes a layout;
- once per engine step, ``make_plan(metadata)``: the shared metadata checks,
  then whatever the backend derives from the metadata alone (work partition,
  masks), shared by every layer;
- per layer, ``reshape_and_cache`` and ``paged_attention``;
- ``copy_blocks`` for copy-on-write of shared blocks.

Class-level facts: ``name``, ``priority`` (``--attention-backend auto`` takes
the highest available), ``devices``, ``dtypes``, ``availability()`` with a
reason, ``variants()`` (kernel builds a test can run one by one), and
``unsupported_features(features)`` (what of a model's attention it cannot do).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Availability:
    """Whether something can run here, and if not, why."""

    available: bool
    reason: str = ""


@dataclass(frozen=True)
class KernelVariant:
    """One build of a backend's kernels (e.g. an ISA variant of the CPU kernels).

    Attributes:
        name: e.g. "avx512".
        available: this machine can execute it.
        reason: why not, when it cannot.
    """

    name: str
    available: bool
    reason: str = ""


@dataclass(frozen=True)
class AttentionSpec:
    """What one backend instance serves: every attention layer of one model.

    Attributes:
        num_heads, num_kv_heads, head_dim: the model's attention shape (H % Hkv == 0).
        block_size: tokens per KV block.
        num_blocks: physical blocks in the KV store.
        dtype: dtype of the KV cache, queries and outputs.
        device: where the KV store and the kernels' tensors live.
        batch_invariant: a query token's output must not depend on the rest of
            its step (EngineArgs.batch_invariant): the cpu backend then never
            splits along the KV length. The Metal backend does not read it yet
            (its split-KV stays automatic).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    batch_invariant: bool = True


@dataclass
class AttentionMetadata:
    """One step's attention metadata (host tensors, from pagedserve._core.ModelInput).

    Attributes:
        slot_mapping: [T] int64, KV slot of each new token (block_id * block_size + offset).
        query_start_loc: [B+1] int32, prefix sums of the query lengths (tokens).
        seq_lens: [B] int32, keys visible per sequence (tokens, the queries included).
        block_tables: [B, max_blocks] int32, physical block ids, -1 padded.
        causal: query token i of sequence b sits at position seq_lens[b] - q_len[b] + i
            and sees keys at positions <= its own (all keys when False).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    causal: bool = True


@dataclass(frozen=True)
class AttentionFeatures:
    """What a model's attention needs beyond plain causal softmax attention
    (pagedserve.model.features reads them from a Hugging Face config).

    Attributes:
        sliding_window: keys older than this many positions are masked (in at
            least one layer), or None.
        logit_softcap: attention scores pass through cap * tanh(s / cap), or None.
        alibi: ALiBi position biases instead of rotary or learned positions.
        sinks: learned attention-sink logits per head (gpt-oss).
    """

    sliding_window: int | None = None
    logit_softcap: float | None = None
    alibi: bool = False
    sinks: bool = False

    def describe(self) -> list[str]:
        """One phrase per feature present, for messages."""
        out = []
        if self.sliding_window is not None:
            out.append(f"sliding-window attention (window {self.sliding_window})")
        if self.logit_softcap is not None:
            out.append(f"attention logit soft-capping (cap {self.logit_softcap})")
        if self.alibi:
            out.append("ALiBi position biases")
        if self.sinks:
            out.append("attention sinks")
        return out


def check_layer_params(sliding_window, logit_softcap) -> tuple[int, float]:
    """Validates one layer's attention parameters as paged_attention receives
    them; returns (window, cap) with 0 meaning none. Raises KernelArgumentError
    for a window that is not an int in [1, 2^31) or a cap that is not a finite
    positive float32."""
    from ..errors import KernelArgumentError

    window = 0
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or not 1 <= sliding_window < 2**31:
            raise KernelArgumentError(f"sliding_window must be None or an int in [1, 2^31), got {sliding_window!r}")
        window = sliding_window
    cap = 0.0
    if logit_softcap is not None:
        try:
            cap = float(logit_softcap)
        except (TypeError, ValueError):
            cap = float("nan")
        if isinstance(logit_softcap, bool) or not (math.isfinite(cap) and cap > 0.0):
            raise KernelArgumentError(f"logit_softcap must be None or a finite number > 0, got {logit_softcap!r}")
        if not 1.2e-38 < cap < 3.4e38:  # what float32 holds as a normal number
            raise KernelArgumentError(f"logit_softcap {cap} is outside float32's normal range")
    return window, cap


class AttentionBackend(ABC):
    """Base class of attention backends. Shapes below: T query tokens, H query
    heads, Hkv KV heads, D head_dim, B sequences.

    Args:
        spec: the AttentionSpec this instance serves.
    Raises:
        pagedserve.errors.BackendUnavailableError from subclasses that cannot
        serve the spec (device, dtype).
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    # ---- class-level facts ----------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        """Whether the backend can run on this machine at all (built, libraries load)."""
        return Availability(True)

    @classmethod
    def variants(cls) -> list[KernelVariant]:
        """The kernel builds a caller may switch between with ``use_variant``
        (the parity suite runs each); [] when there is only one."""
        return []

    @classmethod
    def use_variant(cls, name: str) -> None:
        """Makes kernel variant ``name`` the one plans built from now on use.
        Raises ValueError if it is unknown or cannot run here."""
        raise ValueError(f"the {cls.name} backend has no kernel variants")

    @classmethod
    def active_variant(cls) -> str | None:
        """The kernel variant in use, or None when the backend has no variants."""
        return None

    @classmethod
    def unsupported_features(cls, features: AttentionFeatures) -> list[str]:
        """What of ``features`` this backend cannot compute (messages); [] if it
        serves them all. The default: only plain causal attention."""
        return features.describe()

    @staticmethod
    def only_window_and_softcap(features: AttentionFeatures) -> list[str]:
        """unsupported_features of a backend that implements sliding windows and
        logit soft-capping but neither ALiBi nor sinks."""
        return AttentionFeatures(alibi=features.alibi, sinks=features.sinks).describe()

    # ---- KV cache layout --------------------------------------------------
    @abstractmethod
    def kv_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (K and V together) in this
        backend's layout, for spec.num_blocks blocks."""

    def allocate_kv_cache(self, num_layers: int) -> torch.Tensor:
        """The whole KV store, [num_layers, *kv_cache_shape()], spec.dtype on
        spec.device, zeroed. Backends with special memory (GPU-visible shared
        buffers) override this."""
        return torch.zeros((num_layers, *self.kv_cache_shape()), dtype=self.spec.dtype, device=self.spec.device)

    @abstractmethod
    def split_kv_cache(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer's tensor; dim 0 of each is the block id."""

    def copy_blocks(self, kv_cache: torch.Tensor, blocks_to_copy: torch.Tensor) -> None:
        """Copies whole blocks in every layer, K and V (copy-on-write).

        kv_cache: the store from allocate_kv_cache. blocks_to_copy: [C, 2] int (src, dst).
        """
        src = blocks_to_copy[:, 0].to(device=kv_cache.device, dtype=torch.long)
        dst = blocks_to_copy[:, 1].to(device=kv_cache.device, dtype=torch.long)
        for layer in kv_cache:
            for cache in self.split_kv_cache(layer):
                cache[dst] = cache[src]

    # ---- per step and per layer ---------------------------------------------
    @abstractmethod
    def make_plan(self, metadata: AttentionMetadata) -> Any:
        """Everything derived from the step's metadata alone, built once per step
        and passed to every layer's paged_attention. It must validate the
        metadata first with the checks every backend shares
        (``pagedserve._core.check_attention_metadata``, or its C++ function in
        csrc/backends/common/), so no kernel reads through a bad index.
        Raises pagedserve.errors.KernelArgumentError."""

    @abstractmethod
    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Writes key/value [T, Hkv, D] (any float dtype; cast to the cache's)
        into the layer's caches at slot_mapping [T] int64 (negative: skip)."""

    @abstractmethod
    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Any,
                        scale: float, sliding_window: int | None = None,
                        logit_softcap: float | None = None) -> torch.Tensor:
        """Attention of query [T, H, D] over each sequence's blocks -> [T, H, D]
        in the cache dtype. ``plan`` comes from make_plan for this step. The
        layer's own parameters: ``sliding_window`` (a query at position p sees
        keys at positions > p - sliding_window, transformers' mask) and
        ``logit_softcap`` (each scaled score s becomes cap * tanh(s / cap)). A
        backend that does not implement one says so in unsupported_features, so
        it never receives it."""
