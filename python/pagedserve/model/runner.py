"""ModelRunner: runs the model once per engine step over the flat batch the
C++ scheduler decided (laid out by ``_core.ModelInput``), and returns logits
only for the tokens that sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..kernels.backend import AttentionBackend, AttentionMetadata
from .attention import ForwardContext, forward_context
from .features import logits_transform
from .gguf_linear import GGUFFloatLinear
from .quantization import QuantLinear

logger = logging.getLogger(__name__)


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
        lean: the lean decoder that replaces the Hugging Face decoder's forward, or None.
    """

    def __init__(self, model: torch.nn.Module, kv_cache, backend: AttentionBackend, max_model_len: int,
                 lean=None) -> None:
        self.model = model
        # lean_llama.LeanLlamaDecoder or native_step.NativeStepDecoder; None: the Hugging Face decoder
        self.lean = lean
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
    def execute(self, inp, extra_logits_indices: torch.Tensor | None = None,
                draft_logits_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass over all scheduled tokens of all sequences.

        Args:
            inp: pagedserve._core.ModelInput (numpy views: input_ids, positions,
                slot_mapping, logits_indices int64; query_start_loc, seq_lens,
                block_tables, blocks_to_copy int32), or anything with those arrays.
            extra_logits_indices: [E] int64 positions in the flat batch whose
                logits are wanted too (prompt logprobs), or None.
            draft_logits_indices: [D] int64 positions whose logits verify
                speculative drafts, or None: computed in the same output-layer
                call as the sampling rows (one read of its weights), appended
                after them.
        Returns:
            (logits [S + D, vocab] float32 on the CPU, S = len(inp.logits_indices),
            in the order of the scheduler's sampling_seq_indices, then the D draft rows; the final hidden
            states [E, hidden] at extra_logits_indices, or None: compute_logits
            turns them into logits a slice at a time, so E x vocab floats never
            exist at once).
        """
        if inp.blocks_to_copy.shape[0]:  # copy-on-write decided by the scheduler, before any write
            self.kv_cache.copy_blocks(torch.from_numpy(inp.blocks_to_copy))
        input_ids = self._to_device(inp.input_ids)
        positions = self._to_device(inp.positions)
        md = AttentionMetadata(slot_mapping=torch.from_numpy(inp.slot_mapping),
                               query_start_loc=torch.from_numpy(inp.query_start_loc),
                               seq_lens=torch.from_numpy(inp.seq_lens),
                               block_tables=torch.from_numpy(inp.block_tables))
        plan = self.backend.make_plan(md)  # once per step, shared by every layer
        slot_mapping = md.slot_mapping if self.device.type == "cpu" else self._to_device(inp.slot_mapping)
        self.last_forward = ctx = ForwardContext(plan, slot_mapping, self.kv_cache, self.backend, self.max_model_len)
        if self.lean is not None:
            hidden = self.lean(input_ids, positions, ctx)
        else:
            with forward_context(ctx):
                hidden = self.decoder(input_ids=input_ids[None], position_ids=positions[None],
                                      use_cache=False).last_hidden_state[0]
        # index_select, not hidden[idx]: on the CPU advanced indexing runs as a parallel op even for a few rows,
        # and torch's OpenMP thread it wakes then spins for milliseconds on the core our kernels' next call needs
        rows = self._to_device(inp.logits_indices)
        if draft_logits_indices is not None and draft_logits_indices.numel():
            rows = torch.cat([rows, draft_logits_indices.to(self.device)])
        logits = self.compute_logits(hidden.index_select(0, rows))
        extra = None
        if extra_logits_indices is not None and extra_logits_indices.numel():
            extra = hidden.index_select(0, extra_logits_indices.to(self.device))
        return logits, extra

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (model dtype) -> logits [N, vocab] float32 on
        the CPU, after what the model's own forward does to them (final
        soft-cap, scaling: pagedserve.model.features.logits_transform). A
        quantised output layer, or one on the GGUF's blocks with no dense
        copy, gets the hidden states widened to float32 (the
        same values: its kernel quantises them to int8 either way) and so
        writes float32 logits: no bfloat16 rounding of the logits, and no
        [N, vocab] conversion afterwards (measured: 5 of 9 ms per 32-row
        decode step on a 2-core AVX-512 Xeon)."""
        if hidden.dtype != torch.float32 and (isinstance(self.lm_head, QuantLinear) or (
                isinstance(self.lm_head, GGUFFloatLinear) and self.lm_head.dense is None)):
            hidden = hidden.float()  # the blocks' kernels widen bfloat16 rows anyway: float32 logits, not rounded
        logits = self.lm_head(hidden)
        if self.logits_transform is not None:
            logits = self.logits_transform(logits)
        return logits.float().cpu()

    @torch.inference_mode()
    def check_logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, int, set]:
        """The start-up check's two steps on ``ids`` ([n + 1] int64): a prefill of
        the first n tokens into blocks 0.. (which no sequence holds yet), then one
        decode step of the last that reads them back from the paged store.
        Returns (logits [n + 1, vocab] float32 on the CPU, the attention layers
        the prefill ran, their sliding windows). Raises RuntimeError on a
        non-finite logit, and whatever the steps raise."""
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
        return got, layers, windows

    @torch.inference_mode()
    def startup_check(self, ids: torch.Tensor, reference: torch.Tensor, noise: float = 0.0,
                      quantized: bool = False) -> StartupCheck:
        """Runs check_prompt's tokens through the engine's path (check_logits:
        a prefill, then a decode step that reads it back from the paged store)
        and compares the logits with ``reference`` (hf_reference_logits of the model as loaded,
        before the engine changed anything). Any kernel or GEMM path that cannot
        run here fails now, not at the first request. Raises whatever the steps
        raise.

        Args:
            ids: [n + 1] int64 token ids.
            reference: [n + 1, vocab] float32 logits of the Hugging Face forward.
            noise: the spread of Hugging Face's own attention implementations on
                this prompt (bfloat16), added to the tolerance.
            quantized: the linear layers run on quantised weights and int8
                activations (--quantization): the check then only catches gross
                errors (a wrong block order, a broken kernel); accuracy is
                measured by bench/throughput.py --quantization.
        """
        got, layers, windows = self.check_logits(ids)
        # float32 paths differ only in summation order; bfloat16 rounds every product, and its error grows
        # with depth (seen: 0.24 at 24 layers, 0.34 at 48 on tiny random models whose logits reach ~4), so in
        # bfloat16 the check catches only gross mismatches; float32 is the precise one
        depth = max(1.0, (layers / 8) ** 0.5)
        if quantized:  # 4-bit weights quantised from floats move logits by ~20% on random tiny models
            rel = 3e-1 * depth
        elif self.backend.spec.dtype == torch.float32:
            rel = 1e-3
        else:
            rel = 5e-2 * depth
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
