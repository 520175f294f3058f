"""ModelRunner: runs the model once per engine step over the flat batch the
C++ scheduler decided (laid out by ``_core.ModelInput``), and returns logits
only for the tokens that sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..hardware import onednn_linear_unsupported
from ..kernels.backend import AttentionBackend, AttentionMetadata
from .attention import ForwardContext, forward_context
from .features import logits_transform

logger = logging.getLogger(__name__)


def padded_rows(m: int) -> int:
    """The row count oneDNN sees for m rows: m rounded up to a ladder of 34 sizes
    up to 2048 (multiples of 8 to 64, of 32 to 512, of 128 beyond). oneDNN keeps
    compiled kernels and descriptors per (rows, in, out) shape; with the rows
    being the step's token count, every new step size used to add state that
    was never freed (about 0.6 MiB per request in a soak); on the ladder the
    set of shapes is bounded, and so is the memory."""
    if m <= 64:
        return (m + 7) // 8 * 8
    if m <= 512:
        return (m + 31) // 32 * 32
    return (m + 127) // 128 * 128


class OneDNNLinear(torch.nn.Module):
    """nn.Linear computed by oneDNN (torch.ops.mkldnn._linear_pointwise) with its
    weight pre-packed once in oneDNN's blocked layout and dense activations, so
    no call converts layouts (measured on SmolLM2, 32 requests of 64 + 64 tokens,
    2-core AVX-512: 21.7-24.0 s of CPU vs 29.3-29.6 s with aten::mkldnn_linear
    and per-call to_mkldnn / to_dense). x: [..., in_features] dense -> [..., out_features] dense,
    same dtype as the weight (float32, or bfloat16 where the CPU supports
    oneDNN's bf16 path). Rows are padded to padded_rows(m) (zeros, sliced off
    after), so oneDNN only ever sees a bounded set of shapes."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # packed once; the pointwise op takes dense activations (no per-call layout conversions)
        weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        rows = padded_rows(m)
        if rows != m:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, rows - m))  # zero rows below, one allocation
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.weight, self.bias, "none", [], "")
        return y[:m].reshape(*lead, self.out_features)


def use_onednn_linear(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """Swaps the model's nn.Linear layers for OneDNNLinear, in place, where this
    CPU supports oneDNN for ``dtype``; returns the linear path in use, for the log.

    On CPU, oneDNN's GEMM with pre-packed weights beat the default BLAS call at
    the small row counts of decode steps on a 2-core AVX-512 machine (the
    49152 x 576 lm_head at 32 rows, 25 ms -> 14 ms). Same dtype and math,
    another summation order. Where oneDNN cannot run the dtype here (bfloat16
    without avx512bw/vl/dq or avx_ne_convert), torch's own GEMM is kept: it is
    correct on every CPU, only slower.
    """
    why = onednn_linear_unsupported(dtype)
    if why is not None:
        return f"torch's default GEMM ({why})"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:  # not subclasses: their forward may do more than x @ W.T + b
                setattr(parent, name, OneDNNLinear(child))
    return "oneDNN with pre-packed weights"


@dataclass
class StartupCheck:
    """What ModelRunner.startup_check saw.

    Attributes:
        attention_calls: attention layers that ran through our hook in one pass.
        windows: the sliding windows those layers asked for (None: none).
        max_abs_diff: largest |engine logit - Hugging Face logit| over the prompt.
        tolerance: the bound it must stay within for this dtype.
    """

    attention_calls: int
    windows: set
    max_abs_diff: float
    tolerance: float


class ModelRunner:
    """Executes one step's ModelInput on a Hugging Face causal LM.

    Args:
        model: transformers causal LM loaded with attn_implementation="pagedserve",
            on ``device``.
        kv_cache: the engine's KVCache (on ``device``).
        backend: the engine's AttentionBackend instance.
        max_model_len: tokens per sequence at most (for the attention hook's checks).
    """

    def __init__(self, model: torch.nn.Module, kv_cache, backend: AttentionBackend, max_model_len: int) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.logits_transform = logits_transform(model.config)
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = backend.spec.device
        self.max_model_len = max_model_len
        self.last_forward: ForwardContext | None = None  # the last pass's context (layers run, windows)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, inp, extra_logits_indices: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass over all scheduled tokens of all sequences.

        Args:
            inp: pagedserve._core.ModelInput (numpy views: input_ids, positions,
                slot_mapping, logits_indices int64; query_start_loc, seq_lens,
                block_tables, blocks_to_copy int32), or anything with those arrays.
            extra_logits_indices: [E] int64 positions in the flat batch whose
                logits are wanted too (prompt logprobs), or None.
        Returns:
            (logits [S, vocab] float32 on the CPU, S = len(inp.logits_indices),
            in the order of the scheduler's sampling_seq_indices; the final hidden
            states [E, hidden] at extra_logits_indices, or None: compute_logits
            turns them into logits a slice at a time, so E x vocab floats never
            exist at once).
        """
        if inp.blocks_to_copy.shape[0]:  # copy-on-write decided by the scheduler, before any write
            self.kv_cache.copy_blocks(torch.from_numpy(inp.blocks_to_copy))
        input_ids = self._to_device(inp.input_ids).unsqueeze(0)
        positions = self._to_device(inp.positions).unsqueeze(0)
        md = AttentionMetadata(slot_mapping=torch.from_numpy(inp.slot_mapping),
                               query_start_loc=torch.from_numpy(inp.query_start_loc),
                               seq_lens=torch.from_numpy(inp.seq_lens),
                               block_tables=torch.from_numpy(inp.block_tables))
        plan = self.backend.make_plan(md)  # once per step, shared by every layer
        slot_mapping = md.slot_mapping if self.device.type == "cpu" else self._to_device(inp.slot_mapping)
        self.last_forward = ctx = ForwardContext(plan, slot_mapping, self.kv_cache, self.backend, self.max_model_len)
        with forward_context(ctx):
            hidden = self.decoder(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state[0]
        logits = self.compute_logits(hidden[self._to_device(inp.logits_indices)])
        extra = None
        if extra_logits_indices is not None and extra_logits_indices.numel():
            extra = hidden[extra_logits_indices.to(self.device)]
        return logits, extra

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (model dtype) -> logits [N, vocab] float32 on
        the CPU, after what the model's own forward does to them (final
        soft-cap, scaling: pagedserve.model.features.logits_transform)."""
        logits = self.lm_head(hidden)
        if self.logits_transform is not None:
            logits = self.logits_transform(logits)
        return logits.float().cpu()

    @torch.inference_mode()
    def startup_check(self, ids: torch.Tensor, reference: torch.Tensor, noise: float = 0.0) -> StartupCheck:
        """Runs check_prompt's tokens through the engine's path — a prefill of
        all but the last into block 0.. (which no sequence holds yet), then one
        decode step that reads them back from the paged store — and compares the
        logits with ``reference`` (hf_reference_logits of the model as loaded,
        before the engine changed anything). Any kernel or GEMM path that cannot
        run here fails now, not at the first request. Raises whatever the steps
        raise.

        Args:
            ids: [n + 1] int64 token ids.
            reference: [n + 1, vocab] float32 logits of the Hugging Face forward.
            noise: the spread of Hugging Face's own attention implementations on
                this prompt (bfloat16), added to the tolerance.
        """
        n, bs = ids.numel() - 1, self.kv_cache.block_size
        blocks = np.arange((n + 1 + bs - 1) // bs, dtype=np.int32)[None, :]

        def step(start: int, count: int, logits_at: list[int]):
            return self.execute(SimpleNamespace(
                input_ids=ids[start:start + count].numpy(), positions=np.arange(start, start + count),
                slot_mapping=np.arange(start, start + count), logits_indices=np.array(logits_at),
                query_start_loc=np.array([0, count], dtype=np.int32),
                seq_lens=np.array([start + count], dtype=np.int32),
                block_tables=blocks, blocks_to_copy=np.zeros((0, 2), dtype=np.int32)))[0]

        ours = [step(0, n, list(range(n)))]
        layers, windows = self.last_forward.calls, set(self.last_forward.windows)
        ours.append(step(n, 1, [0]))
        got = torch.cat(ours)
        if not bool(torch.isfinite(got).all()):
            raise RuntimeError("the start-up check step produced non-finite logits")
        # float32 paths differ only in summation order; bfloat16 rounds every product, and its error grows
        # with depth (seen: 0.24 at 24 layers, 0.34 at 48 on tiny random models whose logits reach ~4), so in
        # bfloat16 the check catches only gross mismatches; float32 is the precise one
        rel = 1e-3 if self.backend.spec.dtype == torch.float32 else 5e-2 * max(1.0, (layers / 8) ** 0.5)
        tolerance = rel * (1.0 + float(reference.abs().max())) + 2.0 * noise
        return StartupCheck(layers, windows, float((got - reference).abs().max()), tolerance)


def check_prompt(vocab_size: int, block_size: int, max_model_len: int) -> torch.Tensor:
    """The start-up check's tokens: [n + 1] int64 with n = min(8, block_size - 1,
    max_model_len - 1), fixed for reproducibility."""
    n = max(1, min(8, block_size - 1, max_model_len - 1))
    return (torch.arange(n + 1) * 7919 + 13) % vocab_size


@torch.inference_mode()
def hf_reference_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The Hugging Face forward's logits of ``ids`` ([n, vocab] float32 on the
    CPU) with eager attention, and how far its sdpa attention lands from them
    (the rounding noise of this model in its dtype; 0 in float32 or where sdpa
    is unavailable). The model's attention implementation is restored after."""
    previous = model.config._attn_implementation
    device = next(model.parameters()).device

    def forward(impl: str) -> torch.Tensor:
        model.set_attn_implementation(impl)
        return model(input_ids=ids[None].to(device), use_cache=False).logits[0].float().cpu()

    try:
        eager = forward("eager")
        noise = 0.0
        if next(model.parameters()).dtype != torch.float32:
            try:
                noise = float((forward("sdpa") - eager).abs().max())
            except (ValueError, RuntimeError, NotImplementedError):  # no sdpa for this architecture
                noise = 0.0
    finally:
        model.set_attn_implementation(previous)
    return eager, noise
