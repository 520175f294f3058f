"""ModelRunner: runs the model once per engine step over the flat batch the
C++ scheduler decided (laid out by ``_core.ModelInput``) and owns everything
that touches logits: the sampling rows' logits and the tokens sampled from them
(grammar masks, penalties, logprobs), the rows that verify speculative drafts,
prompt logprobs and the hidden states embedding requests pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels.backend import AttentionBackend, AttentionMetadata
from .attention import ForwardContext, forward_context
from .features import logits_transform
from .linear_method import LinearLayer
from .sampler import Sampler, SamplerOutput, SamplingRow, TopLogprobs, compute_prompt_logprobs

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_SLICE = 128  # prompt positions scored per lm_head call (memory bound)


@dataclass
class PromptLogprobRows:
    """One request's prompt positions to score this step.

    Attributes:
        indices: positions in the step's flat batch whose hidden states predict the targets.
        target_ids: the prompt tokens they predict (one per index).
        num_top: the request's prompt_logprobs (top entries per position).
    """

    indices: list[int]
    target_ids: list[int]
    num_top: int


@dataclass
class StepInput:
    """What one engine step asks of the runner.

    Attributes:
        model_input: pagedserve._core.ModelInput (see forward()).
        sampling_rows: one SamplingRow per sampling sequence, in the scheduler's
            sampling_seq_indices order (its logits row is that of logits_indices).
        draft_indices: flat-batch positions whose logits verify speculative drafts.
        prompt_logprobs: per request that scores prompt positions this step, its rows.
        pooled: per embedding request that prefills this step, the flat-batch
            positions whose final hidden states it pools.
    """

    model_input: object
    sampling_rows: list[SamplingRow]
    draft_indices: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    pooled: list[list[int]] = field(default_factory=list)


@dataclass
class StepOutput:
    """What the runner computed for a StepInput.

    Attributes:
        sampled: the tokens drawn from the sampling rows (flat: row after row, draw after draw).
        logits: [S, vocab] float32, the sampling rows' logits (S = len(sampling_rows)).
        draft_logits: [D, vocab] float32, the draft rows' logits.
        prompt_logprobs: per PromptLogprobRows, (logprobs [n], top [n], ranks [n]) of its targets.
        pooled: per entry of StepInput.pooled, the final hidden states [n, hidden] of its positions.
    """

    sampled: SamplerOutput
    logits: torch.Tensor
    draft_logits: torch.Tensor
    prompt_logprobs: list[tuple[list[float], list[TopLogprobs], list[int]]]
    pooled: list[torch.Tensor]


class ModelRunner:
    """Executes one step's ModelInput on a Hugging Face causal LM.

    Args:
        model: transformers causal LM loaded with attn_implementation="pagedserve",
            on ``device``.
        kv_cache: the engine's KVCache (on ``device``).
        backend: the engine's AttentionBackend instance.
        max_model_len: tokens per sequence at most (for the attention hook's checks).
        lean: the lean decoder that replaces the Hugging Face decoder's forward, or None.
        sampler: the Sampler of the sampling rows (one with no EOS ids when None).
    """

    def __init__(self, model: torch.nn.Module, kv_cache, backend: AttentionBackend, max_model_len: int,
                 lean=None, sampler: Sampler | None = None) -> None:
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
        self.sampler = sampler or Sampler()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """One engine step: the forward pass over every scheduled token, then
        the sampled tokens (Sampler: grammar masks, penalties, logprobs),
        the draft rows' logits, prompt logprobs (scored from their hidden states
        _PROMPT_LOGPROBS_SLICE positions at a time, so a 2048-token chunk's
        [2048, vocab] logits never exist at once) and the pooled rows' hidden
        states. Raises what forward() and the Sampler raise."""
        extra = [i for rows in step.prompt_logprobs for i in rows.indices] + [i for idx in step.pooled for i in idx]
        # greedy rows read only their maximum: the output layer may then leave -inf where no maximum can be
        argmax_only = not step.draft_indices and self.sampler.takes_only_argmax(step.sampling_rows)
        logits, hidden = self.forward(step.model_input, torch.tensor(extra, dtype=torch.long) if extra else None,
                                      torch.tensor(step.draft_indices, dtype=torch.long) if step.draft_indices
                                      else None, argmax_only=argmax_only)
        num_sampling = len(step.sampling_rows)
        logits, draft_logits = logits[:num_sampling], logits[num_sampling:]
        scored, start = [], 0
        for rows in step.prompt_logprobs:
            lps, tops, ranks = [], [], []
            for lo in range(0, len(rows.indices), _PROMPT_LOGPROBS_SLICE):
                hi = min(lo + _PROMPT_LOGPROBS_SLICE, len(rows.indices))
                got = compute_prompt_logprobs(self.compute_logits(hidden[start + lo:start + hi]),
                                              torch.tensor(rows.target_ids[lo:hi], dtype=torch.long), rows.num_top)
                lps += got[0]
                tops += got[1]
                ranks += got[2]
            scored.append((lps, tops, ranks))
            start += len(rows.indices)
        pooled = []
        for idx in step.pooled:
            pooled.append(hidden[start:start + len(idx)])
            start += len(idx)
        return StepOutput(self.sampler(logits, step.sampling_rows), logits, draft_logits, scored, pooled)

    @torch.inference_mode()
    def forward(self, inp, extra_logits_indices: torch.Tensor | None = None,
                draft_logits_indices: torch.Tensor | None = None,
                argmax_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
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
            argmax_only: only each logits row's first maximum is read (greedy
                rows, Sampler.takes_only_argmax): compute_logits may then leave
                -inf where no row's maximum can be.
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
        logits = self.compute_logits(hidden.index_select(0, rows), argmax_only=argmax_only)
        extra = None
        if extra_logits_indices is not None and extra_logits_indices.numel():
            extra = hidden.index_select(0, extra_logits_indices.to(self.device))
        return logits, extra

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """hidden [N, hidden_size] (model dtype) -> logits [N, vocab] float32 on
        the CPU, after what the model's own forward does to them (final
        soft-cap, scaling: pagedserve.model.features.logits_transform). A
        quantised output layer, or one on the GGUF's blocks with no dense
        copy, gets the hidden states widened to float32 (the
        same values: its kernel quantises them to int8 either way) and so
        writes float32 logits: no bfloat16 rounding of the logits, and no
        [N, vocab] conversion afterwards (its cost: docs/benchmarks.md,
        "Behind the code").

        argmax_only: the caller reads only each row's first maximum (greedy
        sampling). With an output layer on Q8_0 blocks and no transform of the
        logits, the values are then exact only where they could be a row's
        maximum and -inf elsewhere (GGUFFloatLinear.greedy_logits: an int8
        pass with an error bound per output, then the exact kernel on the few
        candidates), and the argmax is the full layer's."""
        if hidden.dtype != torch.float32 and getattr(self.lm_head, "float_logits", False):
            hidden = hidden.float()  # the blocks' kernels widen bfloat16 rows anyway: float32 logits, not rounded
        if argmax_only and self.logits_transform is None and isinstance(self.lm_head, LinearLayer):
            return self.lm_head.greedy_logits(hidden).float()  # the full layer where it cannot prune
        logits = self.lm_head(hidden)
        if self.logits_transform is not None:
            logits = self.logits_transform(logits)
        return logits.float().cpu()
