"""ModelRunner: runs the model once per engine step over the flat batch the
C++ scheduler decided, and returns logits only for the tokens that sample."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, ForwardContext, forward_context


class ModelRunner:
    """Executes SchedulerOutputs on a Hugging Face causal LM.

    Args:
        model: transformers causal LM loaded with attn_implementation="pagedserve".
        kv_cache: the engine's KVCache.
        backend: an attention backend module (pagedserve.kernels.get_backend).
    """

    def __init__(self, model: torch.nn.Module, kv_cache, backend) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.kv_cache = kv_cache
        self.backend = backend

    @torch.inference_mode()
    def execute(self, out) -> torch.Tensor:
        """One forward pass over all scheduled tokens of all sequences.

        Args:
            out: pagedserve._core.SchedulerOutput (numpy views, int32).
        Returns:
            logits [S, vocab] float32, S = len(out.logits_indices), in the
            order of out.sampling_seq_indices.
        """
        input_ids = torch.from_numpy(out.input_ids).long().unsqueeze(0)
        positions = torch.from_numpy(out.positions).long().unsqueeze(0)
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(out.slot_mapping).long(),
            query_start_loc=torch.from_numpy(out.query_start_loc),
            seq_lens=torch.from_numpy(out.seq_lens),
            block_tables=torch.from_numpy(out.block_tables),
        )
        with forward_context(ForwardContext(md, self.kv_cache, self.backend)):
            hidden = self.decoder(input_ids=input_ids, position_ids=positions,
                                  use_cache=False).last_hidden_state
        hidden = hidden[0, torch.from_numpy(out.logits_indices).long()]
        return self.lm_head(hidden).float()
